"""The functions behind ``ckptshim.inspect``, ``plan`` and ``convert`` (and the CLI)."""

from __future__ import annotations

from pathlib import Path

from ckptshim.formats import completeness
from ckptshim.formats.base import Checkpoint
from ckptshim.formats.detect import open_checkpoint
from ckptshim.planner import Plan
from ckptshim.rules import Rules
from ckptshim.storage import Location


def inspect(path: str | Path) -> Checkpoint:
    """Open a checkpoint and describe it from its metadata alone; no tensor bytes are read.

    What ``ckptshim inspect`` prints. Nothing is unpickled beyond what
    ``torch.load(weights_only=True)`` allows, and nothing is written.

    Args:
        path: A checkpoint file or folder in any format ckptshim reads (``torch.save`` file,
            safetensors file, Hugging Face folder, DCP folder, Orbax item, step folder or
            ``CheckpointManager`` root, Flax msgpack, T5X, PaxML, DeepSpeed/GPT-NeoX).

    Returns:
        Checkpoint: The opened checkpoint: ``format`` and ``version``, ``inventory`` (every
            array's key, shape, dtype and bytes), ``files``, and ``complete`` (every byte the
            metadata promises is present). Close it with ``close()`` when done (it may hold
            memory maps).

    Raises:
        UnknownFormatError: No format ckptshim knows recognises ``path``.
        CorruptCheckpointError: The metadata cannot be read.
        MissingExtraError: Reading this format needs a framework that is not installed (the
            message names the extra, e.g. ``pip install 'ckptshim[jax]'``).

    Example:
        ```python
        checkpoint = ckptshim.inspect("run/checkpoints/1000")
        print(checkpoint.format, checkpoint.inventory.total_bytes, checkpoint.complete)
        ```
    """
    return open_checkpoint(path)


def plan(source: str | Path, like: str | Path, rules: Rules | None = None) -> Plan:
    """Dry run: how the checkpoint at ``source`` would load into the layout of ``like``.

    What ``ckptshim plan`` prints. Reads metadata only, on both sides.

    Args:
        source: The checkpoint to load (any format [`inspect`][ckptshim.inspect] reads).
        like: The target layout: another checkpoint, or ``"module:function"`` naming a function
            (importable from the current folder or ``sys.path``) that takes no arguments and
            returns a torch ``nn.Module``, a state dict, or a JAX tree whose leaves may be
            ``jax.ShapeDtypeStruct`` (as ``jax.eval_shape`` returns).
        rules: The rules to plan with. By default, those a load would use: JAX's for JAX-style
            layouts (``/`` keys: Linen/NNX spellings, MaxText scan axes, the PaxML profiles),
            torch's otherwise (wrapper prefixes, stacked layer lists, the GPT-NeoX <-> Hugging
            Face names when one side is each).

    Returns:
        Plan: ``ops`` (renames, stacks, splits, casts, ... in target order) and what no op
            accounts for, ``missing`` (target keys nothing provides), ``unexpected`` (source
            keys nothing uses) and ``mismatched`` (same name, another shape or dtype);
            ``complete`` when there are none. ``ckptshim.planner.explain(plan)`` gives the
            lines ``ckptshim plan`` prints.

    Raises:
        PlanError: The mapping would be a guess (two keys that could each be the one wanted).
        MissingExtraError: ``like``'s module, or reading a side, needs a framework that is not
            installed.
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
            *, force: bool = False, progress: bool | None = None) -> Path | Location:
    """Write ``source``'s arrays to ``destination`` in another format, bit for bit (never cast).

    What ``ckptshim convert`` does: the arrays stream one at a time into a temporary sibling of
    ``destination`` that is renamed into place only when complete (in an ``s3://``/``gs://``
    bucket: a temporary prefix copied into place, a folder marked complete last; see
    docs/object-storage.md); ``source`` is only read.

    Args:
        source: The checkpoint to read (any format [`inspect`][ckptshim.inspect] reads); it must be complete.
        destination: Where to write: a folder, or for ``"safetensors"`` a file ending in
            ``.safetensors`` (else ``model.safetensors`` inside the folder); locally, or an
            ``s3://``/``gs://`` URL for ``"safetensors"`` and ``"dcp"``.
        to: ``"safetensors"``; ``"dcp"`` (written by torch's own ``FileSystemWriter``; needs
            torch); or ``"orbax"`` (written by Orbax's own PyTree handler, as
            ``StandardCheckpointer.save`` writes it; needs jax and orbax-checkpoint).
        like: Map the arrays onto this layout first, with the plan [`plan`][ckptshim.plan] shows (a
            checkpoint or ``"module:function"``, as there).
        force: Replace an existing ``destination`` (only once the new one is complete).
        progress: ``True``/``False`` to show or hide the progress bar; ``None`` shows it only
            when stderr is a terminal and ``CKPTSHIM_PROGRESS`` is not ``0``.

    Returns:
        Path | Location: The path written (a ``ckptshim.storage.Location`` for a URL).

    Raises:
        ConvertError: ``destination`` exists (without ``force``) or overlaps ``source``, or
            ``to`` is not a format ckptshim writes.
        CorruptCheckpointError: ``source`` is incomplete.
        PlanError: ``like``'s layout leaves a target array without a value.
        MissingExtraError: Writing ``to`` needs a framework that is not installed.
    """
    from ckptshim.conversion import convert as run_convert

    return run_convert(source, destination, to, like, force=force, progress=progress)
