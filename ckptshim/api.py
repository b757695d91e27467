"""The functions behind ``ckptshim.inspect``, ``plan`` and ``convert`` (and the CLI)."""

from __future__ import annotations

from pathlib import Path

from ckptshim.formats import completeness
from ckptshim.formats.base import Checkpoint
from ckptshim.formats.detect import open_checkpoint
from ckptshim.planner import Plan
from ckptshim.rules import Rules


def inspect(path: str | Path) -> Checkpoint:
    """Open a checkpoint and describe it from metadata alone (format, entries, completeness)."""
    return open_checkpoint(path)


def plan(source: str | Path, like: str | Path, rules: Rules | None = None) -> Plan:
    """Dry run: how the checkpoint at ``source`` would load into the layout of ``like``.

    ``like`` is another checkpoint, or ``"module:function"`` naming a function that returns a
    model, a state dict or an abstract tree (see :mod:`ckptshim.loading.like`). Without explicit
    ``rules``, the rules a load would use: JAX's for JAX-style layouts (``/`` keys: Linen/NNX
    spellings, MaxText scan axes, the PaxML profiles), torch's otherwise (wrappers, stacked
    layer lists, the GPT-NeoX <-> Hugging Face names when one side is each).
    """
    from ckptshim.loading.files import plan_onto

    checkpoint = open_checkpoint(source)
    try:
        return plan_onto(checkpoint, like, rules)
    finally:
        checkpoint.close()


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
        "files": [{"path": f.path, "size": f.size, "expected_size": f.expected_size, "writer": f.writer,
                   **({"kind": f.kind} if f.kind != "file" else {}),
                   **({"contents": list(f.contents)} if f.contents else {})}
                  for f in checkpoint.files],
        "writers": completeness.as_json(completeness.by_writer(checkpoint.files)),
        "complete": checkpoint.complete,
        "problems": checkpoint.all_problems(),
    }


def convert(source: str | Path, destination: str | Path, to: str, like: str | Path | None = None,
            *, force: bool = False, progress: bool | None = None) -> Path:
    """Write ``source`` to ``destination`` in format ``to`` (``"safetensors"``, ``"dcp"``, ``"orbax"``).

    See :func:`ckptshim.conversion.convert`: streamed array by array into a temporary sibling that
    is renamed into place on success; ``source`` is never written; ``destination`` is replaced
    only with ``force``.
    """
    from ckptshim.conversion import convert as run_convert

    return run_convert(source, destination, to, like, force=force, progress=progress)
