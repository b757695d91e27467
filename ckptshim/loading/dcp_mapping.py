"""The key mapping of a ``dcp.load`` whose state dict does not ask for the checkpoint's keys as
they are stored: the planner, the rules and the profiles, imported only for such a load
(:func:`ckptshim.loading.dcp.prepare_mapping` answers the others from the names and shapes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import StorageReader

from ckptshim.errors import PlanError
from ckptshim.execute.dcp_virtual import FlatKeys, KeyMapping
from ckptshim.execute.dcp_storage import DcpReader, FormatReader
from ckptshim.formats.hf_dir import config_of, model_config
from ckptshim.inventory import Entry, Inventory, dtype_name, join_key, split_key
from ckptshim.loading.producers import producer, producer_config
from ckptshim.loading.report import report_load
from ckptshim.loading.torch import state_dict_facts
from ckptshim.log import logger
from ckptshim.planner import Plan
from ckptshim.planner import plan as make_plan
from ckptshim.rules.context import LoadContext
from ckptshim.rules.profiles import rules_for


def checked_mapping(metadata: Metadata, flat: Mapping[str, Any], target_paths: Mapping[str, tuple],
                    allow_missing: bool, location: Any, reader: StorageReader | None, hook: str) -> KeyMapping:
    """The checked plan from the checkpoint's flat keys onto the state dict's (``flat``, as DCP
    flattens it), reported on every rank as ``hook``'s; :class:`~ckptshim.errors.NoPlan` where
    none fits."""
    where = str(location or "DCP checkpoint")
    source, target, note = _sides(metadata, flat, target_paths, where)
    tensors = {entry.key: flat[entry.location] for entry in target.inventory.values()
               if entry.key not in target.objects}
    context = LoadContext(source.inventory, target.inventory, "dcp", state_dict_facts(tensors),
                          _model_config(reader, location), producer(location))
    plan = make_plan(source.inventory, target.inventory, rules_for(context))
    plan.require_complete(allow_missing=allow_missing, allow_unexpected=True,
                          lenient="planner=DefaultLoadPlanner(allow_partial_load=True)")
    _check_objects(plan, source, target)
    report_load(hook, plan)  # on every rank: each loads its own part
    if note:
        logger.info("%s: %s", hook, note)
    return KeyMapping(plan, source, target)


def _model_config(reader: StorageReader | None, location: Any) -> dict | None:
    """The model config of the checkpoint ``reader`` opened (read once, with it); for a reader
    of the caller's own, the ``config.json`` at ``location``."""
    opened = getattr(reader, "checkpoint", None) if isinstance(reader, (DcpReader, FormatReader)) else None
    if opened is not None:
        found = config_of(opened)
    else:
        found = model_config(location) if location is not None else None
    return found if found is not None else producer_config(location)


def _app_levels(paths: Mapping[str, tuple]) -> set[str]:
    """The top-level state-dict names (``"model"``, ``"optim"``) that nest the flat keys."""
    return {str(path[0]) for path in paths.values() if len(path) > 1}


def _side(items: Mapping[str, tuple[tuple[int, ...], str] | None], paths: Mapping[str, tuple],
          strip_app: bool, source: str) -> FlatKeys:
    """Build one side; ``items`` maps each flat key to ``(shape, dtype)`` or ``None`` (an object).

    With ``strip_app`` the top-level state-dict name is left out of the key path, so that a
    checkpoint saved as ``{"model": sd}`` and a state dict passed as ``sd`` (or the other way
    round) line up.
    """
    entries, objects, seen = [], set(), {}
    for fqn, spec in items.items():
        path = paths.get(fqn, (fqn,))
        key = split_key(fqn)
        if strip_app and len(path) > 1:
            key = key[len(split_key(str(path[0]))):]
        if key in seen:
            raise PlanError(
                f"{source} keys {seen[key]!r} and {fqn!r} both mean {join_key(key)!r} once the "
                "top-level state-dict name is set aside, so ckptshim cannot tell which one to use. "
                "Pass the state dict nested the way the checkpoint was saved.")
        seen[key] = fqn
        if spec is None:
            objects.add(key)
            spec = ((), "uint8")  # a placeholder: objects only ever match objects by name
        entries.append(Entry(key, spec[0], spec[1], fqn))
    return FlatKeys(Inventory(entries, source), frozenset(objects))


def _sides(metadata: Metadata, flat: Mapping[str, Any], target_paths: Mapping[str, tuple],
           where: str) -> tuple[FlatKeys, FlatKeys, str | None]:
    """Both sides (the state dict as DCP flattens it), and a note when a top-level state-dict
    name was set aside to match them."""
    source_paths = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    source_apps, target_apps = _app_levels(source_paths), _app_levels(target_paths)
    renamed_app = len(source_apps) == len(target_apps) == 1 and source_apps != target_apps
    strip_source = bool(source_apps) and (not target_apps or renamed_app)
    strip_target = bool(target_apps) and (not source_apps or renamed_app)
    source_items = {fqn: ((tuple(md.size), dtype_name(md.properties.dtype))
                          if isinstance(md, TensorStorageMetadata) else None)
                    for fqn, md in metadata.state_dict_metadata.items()}
    target_items = {fqn: ((tuple(value.size()), dtype_name(value.dtype))
                          if isinstance(value, torch.Tensor) else None)
                    for fqn, value in flat.items()}
    names = [f"the {side}'s {', '.join(map(repr, sorted(apps)))}" for side, apps, strip in
             (("checkpoint", source_apps, strip_source), ("state dict", target_apps, strip_target)) if strip]
    return (_side(source_items, source_paths, strip_source, where),
            _side(target_items, target_paths, strip_target, "the state dict passed to dcp.load"),
            f"keys matched without the top-level name(s) {' and '.join(names)}" if names else None)


def _check_objects(plan: Plan, source: FlatKeys, target: FlatKeys) -> None:
    """A Python object loads only into a non-tensor value of the same name, and vice versa."""
    for op in plan.ops:
        if op.produces and op.sources:
            if any(k in source.objects for k in op.sources) != any(k in target.objects for k in op.targets):
                stored = "a Python object" if op.sources[0] in source.objects else "a tensor"
                raise PlanError(
                    f"checkpoint key {source.fqn(op.sources[0])!r} holds {stored}, but the state "
                    f"dict wants the other kind at {target.fqn(op.targets[0])!r}; DCP cannot load "
                    "one into the other. Pass a value of the stored kind.")


