"""The functions behind ``ckptshim.inspect`` and ``ckptshim.plan`` (and the CLI)."""

from __future__ import annotations

from pathlib import Path

from ckptshim import config
from ckptshim.formats.base import Checkpoint
from ckptshim.formats.detect import open_checkpoint
from ckptshim.plan import Plan
from ckptshim.plan import plan as make_plan
from ckptshim.rules import DEFAULT_RULES, Rules
from ckptshim.rules.profiles import rules_for_trees


def inspect(path: str | Path) -> Checkpoint:
    """Open a checkpoint and describe it from metadata alone (format, entries, completeness)."""
    return open_checkpoint(path)


def plan(source: str | Path, like: str | Path, rules: Rules | None = None) -> Plan:
    """Dry run: how the checkpoint at ``source`` would load into the layout of ``like``.

    Without explicit ``rules``, JAX-style checkpoints (``/`` keys) plan with the rules the Orbax
    and Flax hooks use (Linen/NNX spellings, MaxText scan axes), torch ones with the defaults.
    """
    src, tgt = open_checkpoint(source), open_checkpoint(like)
    if rules is None:
        jax_trees = "/" in (src.key_sep, tgt.key_sep)
        rules = (rules_for_trees(src.inventory, tgt.inventory) if jax_trees
                 else DEFAULT_RULES.extend(strict=config.strict()))
    try:
        return make_plan(src.inventory, tgt.inventory, rules)
    finally:
        src.close()
        tgt.close()


def describe(checkpoint: Checkpoint) -> dict:
    """The JSON-ready description ``ckptshim inspect --json`` prints."""
    sep = checkpoint.key_sep
    return {
        "path": str(checkpoint.path),
        "format": checkpoint.format,
        "version": checkpoint.version,
        "entries": [{"key": sep.join(e.key), "shape": list(e.shape), "dtype": e.dtype, "bytes": e.nbytes}
                    for e in checkpoint.inventory.values()],
        "total_bytes": checkpoint.inventory.total_bytes,
        "files": [{"path": f.path, "size": f.size, "expected_size": f.expected_size,
                   **({"contents": list(f.contents)} if f.contents else {})}
                  for f in checkpoint.files],
        "complete": checkpoint.complete,
        "problems": checkpoint.all_problems(),
    }
