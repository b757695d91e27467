"""transformers' checkpoint conversion mapping, as ckptshim aliases.

transformers 5 renames checkpoint keys while ``from_pretrained`` loads them (GPT-NeoX's
``embed_out.`` became ``lm_head.``), from a table it publishes per model class
(``transformers.conversion_mapping.get_model_conversion_mapping``). A plain
``model.load_state_dict(torch.load(...))`` never sees that table, so the torch hook turns it into
:class:`~ckptshim.rules.aliases.Alias` rules.

Only renames that name whole key components literally become aliases (``^embed_out\\.`` ->
prefix ``embed_out`` <-> ``lm_head``; ``LayerNorm.gamma`` anywhere; a ``PrefixChange``).
Patterns with capture groups, wildcards or partial names, renames scoped to a sub-model, and
converters that merge or split tensors are skipped with a debug log: a loose translation could
match keys transformers would not touch, and an alias applies to both sides of every load.

transformers is never imported here: the mapping is read only when the model is a
``PreTrainedModel``, so transformers is already in ``sys.modules``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import Any

from ckptshim.inventory import KeyPath, split_key
from ckptshim.log import logger
from ckptshim.rules.aliases import Alias
from ckptshim.rules.prefixes import WRAPPER_SEGMENTS

_COMPONENT = re.compile(r"[A-Za-z0-9_]+")


def aliases_for(module: Any) -> tuple[Alias, ...]:
    """Aliases from the conversion mapping of every outermost transformers model in ``module``.

    A model nested under another module (``self.lm = GPTNeoXForCausalLM(...)``) gets its
    anchored renames under its own path; wrapper components in that path are ignored, as the
    planner ignores them in keys.
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    mapping = sys.modules.get("transformers.conversion_mapping")
    if modeling is None or mapping is None or not hasattr(mapping, "get_model_conversion_mapping"):
        return ()
    aliases: list[Alias] = []
    claimed: list[str] = []
    for path, sub in module.named_modules():
        if not isinstance(sub, modeling.PreTrainedModel):
            continue
        if any(owner == "" or path.startswith(owner + ".") for owner in claimed):
            continue
        claimed.append(path)
        prefix = tuple(part for part in split_key(path) if part not in WRAPPER_SEGMENTS)
        aliases += aliases_from_transforms(mapping.get_model_conversion_mapping(sub), prefix)
    return tuple(aliases)


def aliases_from_transforms(transforms: Iterable[Any], prefix: KeyPath = ()) -> tuple[Alias, ...]:
    """The literal renames among transformers ``WeightTransform``\\ s, as aliases under ``prefix``."""
    core = sys.modules["transformers.core_model_loading"]
    aliases: list[Alias] = []
    for transform in transforms:
        if transform.scope_prefix:
            logger.debug("skipping %r: scoped to the sub-model %r", transform, transform.scope_prefix)
        elif isinstance(transform, core.PrefixChange):
            base = split_key(transform.model_prefix)
            part = split_key(transform.prefix_to_add or transform.prefix_to_remove)
            aliases.append(Alias(prefix + base, prefix + base + part, "prefix"))
        elif type(transform) is core.WeightRenaming and len(transform.target_patterns) == 1:
            aliases += _renames(transform, prefix)
        else:
            logger.debug("skipping %r: not a plain rename", transform)
    return tuple(aliases)


def _renames(transform: Any, prefix: KeyPath) -> list[Alias]:
    target = _literal(transform.target_patterns[0])
    out = []
    for pattern in transform.source_patterns:
        source = _literal(pattern)
        if target is None or source is None:
            logger.debug("skipping %r: %r is not a literal rename", transform, pattern)
            continue
        anchored, other = source
        canonical = target[1]
        if canonical != other:
            out.append(Alias(prefix + canonical, prefix + other, "prefix") if anchored
                       else Alias(canonical, other, "anywhere"))
    return out


def _literal(pattern: str) -> tuple[bool, KeyPath] | None:
    """``(anchored, components)`` for a pattern that names whole components, else ``None``.

    transformers ends an unterminated pattern at a name boundary, so ``LayerNorm.gamma`` names
    whole components; ``\\.hc_pre\\.hc_`` (ends inside a name) and ``(q|k)_norm`` do not.
    """
    anchored = pattern.startswith("^")
    body = pattern.removeprefix("^").replace("\\.", ".")
    parts = tuple(body.strip(".").split("."))
    if not all(_COMPONENT.fullmatch(part) for part in parts):
        return None
    if not body.endswith(".") and not parts[-1][-1].isalnum():
        return None
    return anchored, parts
