"""Every model class of transformers' conversion table, there and back: transformers' own way
back (``revert_weight_conversion``, what ``save_pretrained`` writes) planned onto the model by
ckptshim must account for every key.

``python tools/transformers_roundtrip.py [--only CLASS,...] [--json]`` builds each class that
the table names (by model type or class name) on the meta device from its default config (no
memory, no weights), takes its state dict, reverts it with transformers' own code into the layout
``from_pretrained`` converts from, and plans that onto the model with the rules a load of it would
use. Each class ends as ``complete``, ``refused: <why>`` (a converter ckptshim cannot express:
the load raises, naming it), ``unchanged`` (nothing in the table applies to this class),
``not built`` (the default config does not make a model), or ``incomplete`` -- a bug. Exit
status 1 when any class is incomplete. The test suite runs a sample; the whole table takes
minutes (the figures in docs/transformers.md come from a full run).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from collections import Counter


def classes() -> list[str]:
    """Every class the table reaches: each entry's own class name, or the classes transformers'
    auto mappings give its model type."""
    import transformers
    from transformers import conversion_mapping
    from transformers.models.auto import configuration_auto, modeling_auto

    table = conversion_mapping._build_checkpoint_conversion_mapping()  # transformers lists its entries nowhere else
    auto = [mapping for name, mapping in vars(modeling_auto).items()
            if name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES") and isinstance(mapping, dict)]
    found: dict[str, None] = {}
    for entry in sorted(table):
        if entry in configuration_auto.CONFIG_MAPPING_NAMES:
            for mapping in auto:
                names = mapping.get(entry)
                for name in ([names] if isinstance(names, str) else list(names or ())):
                    if hasattr(transformers, name):
                        found.setdefault(name)
        elif hasattr(transformers, entry):
            found.setdefault(entry)
    return list(found)


def roundtrip(name: str) -> str:
    """What ckptshim makes of class ``name``'s reverted state dict (see the module docstring)."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    from ckptshim.errors import PlanError
    from ckptshim.inventory import Entry, Inventory, dtype_name, split_key
    from ckptshim.planner import plan
    from ckptshim.rules import TargetFacts
    from ckptshim.rules.context import LoadContext
    from ckptshim.rules.profiles import rules_for
    from ckptshim.rules.profiles.transformers_mapping import ConversionLayout, from_module

    model_class = getattr(transformers, name)
    try:
        with torch.device("meta"):
            model = model_class(model_class.config_class())
        current = model.state_dict()
        saved = revert_weight_conversion(model, dict(current))
    except Exception as error:  # a default config that builds no model, an op meta tensors lack
        return f"not built ({type(error).__name__})"
    if saved.keys() == current.keys():
        return "unchanged"

    def inventory(state_dict):
        return Inventory([Entry(split_key(k), tuple(v.shape), dtype_name(v.dtype)) for k, v in state_dict.items()], name)

    source, target = inventory(saved), inventory(current)
    try:
        facts = TargetFacts(layouts=tuple(map(ConversionLayout, from_module(model))))
        found = plan(source, target, rules_for(LoadContext(source, target, "torch", facts)))
    except PlanError as error:
        if "cannot express" in str(error):
            return "refused: " + str(error).split(" with ", 1)[1].split(", which", 1)[0]
        raise
    return "complete" if found.complete else (f"incomplete: {len(found.missing)} missing, {len(found.unexpected)} "
                                              f"unexpected, {len(found.mismatched)} mismatched")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated class names (default: every class the table reaches)")
    parser.add_argument("--json", action="store_true", help="one JSON object {class: outcome} on stdout")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    outcomes = {name: roundtrip(name) for name in (args.only.split(",") if args.only else classes())}
    if args.json:
        print(json.dumps(outcomes))
    else:
        for name, outcome in outcomes.items():
            print(f"{name}: {outcome}")
        print(dict(Counter(outcome.split(":")[0].split(" (")[0] for outcome in outcomes.values())))
    return int(any(outcome.startswith("incomplete") for outcome in outcomes.values()))


if __name__ == "__main__":
    sys.exit(main())
