"""Flax's legacy single-file msgpack checkpoints (``checkpoint_<step>``), restored into a target.

The file may be in a bucket (``gs://``, ``s3://``): ckptshim reads it there as from a local copy
(Flax itself reads URLs only through TensorFlow's ``gfile``, where it is installed). For an
Orbax-backed checkpoint Flax calls an Orbax checkpointer, which the Orbax hook already
covers. A legacy msgpack file whose state dict does not match the target's
(``serialization.to_state_dict``) -- scanned vs unscanned layers, Linen vs NNX names -- is
restored here into the target's layout and shardings and handed to
``serialization.from_state_dict`` as Flax does; one that matches is left to Flax, and so is one
no rule makes fit (Flax then restores what the file holds, whatever the target's shapes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ckptshim.formats import flax_msgpack
from ckptshim.loading import agreement, jax as jax_loading
from ckptshim.loading.paths import item_location
from ckptshim.storage import Location


def legacy_file(ckpt_dir: str | os.PathLike, step: Any, prefix: str) -> Path | Location | None:
    """The legacy msgpack file ``restore_checkpoint`` would read, as Flax picks it; else ``None``
    (a URL of a scheme ckptshim does not read, or one its client cannot reach: Flax reads it
    through its own file systems). In a bucket the latest step is found from one listing, in
    Flax's order (:func:`~ckptshim.formats.flax_msgpack.step_files`)."""
    from flax.training import checkpoints

    path = item_location(ckpt_dir)
    if path is None or (isinstance(path, Location) and not jax_loading.reachable(path)):
        return None
    if step is not None:
        path = path / f"{prefix}{step}"
    elif isinstance(path, Location):
        latest = flax_msgpack.step_files(path, prefix)
        path = latest[-1] if latest else path
    elif path.is_dir():
        latest = checkpoints.latest_checkpoint(path, prefix)
        path = Path(latest) if latest else path
    return path if path.is_file() and flax_msgpack.sniff(path) else None


def restore_checkpoint(ckpt_dir: str | os.PathLike, target: Any, step: Any, prefix: str,
                       native: Callable[[], Any]) -> Any:
    """What ``restore_checkpoint`` returns: ckptshim's restore of a legacy file that does not fit
    ``target``, else ``native()``."""
    from flax import serialization

    path = None if target is None else legacy_file(ckpt_dir, step, prefix)
    if path is None:
        return native()
    with ExitStack() as stack:
        where = f"flax restore_checkpoint({path})"
        with agreement.agreeing(where, "planning") as planned:
            checkpoint = flax_msgpack.open_checkpoint(path)
            stack.callback(checkpoint.close)
            prepared = jax_loading.prepare(checkpoint, serialization.to_state_dict(target), where)
            native_fits = jax_loading.native_fits(prepared, readable=True, partial=False)
            planned.decision = "flax restores it" if native_fits else "ckptshim restores it"
        if native_fits:
            return native()
        state_dict = prepared.run()
    return serialization.from_state_dict(target, state_dict)
