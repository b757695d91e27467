"""The ``torch.distributed.checkpoint`` hook: ``dcp.load`` and ``set_(model_)state_dict``.

``dcp.load`` (every public alias: ``torch.distributed.checkpoint.load``, ``state_dict_loader.load``
and the deprecated ``load_state_dict``) is patched to run DCP's own load with two parts swapped:

- the planner becomes :class:`~ckptshim.execute.dcp_planner.RemappingLoadPlanner` around the
  caller's planner (or DCP's default), which maps the state dict's keys onto the checkpoint's:
  ``_orig_mod.``/``module.``/checkpoint-wrapper hops at any depth, a missing or extra top-level
  ``"model"`` level, per-layer lists against stacked layers;
- the storage reader becomes ckptshim's for local paths it recognises: DCP directories (safe
  metadata unpickling, every chunk read once, all files checked before any write) and
  ``torch.save`` files, safetensors files and Hugging Face directories, which DCP cannot read.

Everything runs inside DCP's collective steps, so a refusal on any rank reaches every rank as
DCP's ``CheckpointException`` (holding ckptshim's error) instead of hanging the others, and it
is raised while planning, before any tensor is written. A bug inside ckptshim -- an exception
that is not a ``ShimError`` and was raised in ckptshim's code -- is raised as an
``InternalError``, never handed to DCP's own load: DCP's reader and default planner unpickle
``.metadata`` and stored objects without limits.

``set_model_state_dict``/``set_state_dict`` (``torch.distributed.checkpoint.state_dict``)
are patched so that the given model state dict is re-keyed to what the model expects first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from ckptshim.errors import ShimError, UnknownFormatError
from ckptshim.hooks.post_import import when_imported
from ckptshim.hooks.seam import Patches, Seam, guarded, internal_error
from ckptshim.log import logger

HOOK = "torch.distributed.checkpoint.load"
SEAM = Seam("torch-dcp", HOOK, falls_back=False)
_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent) + os.sep

_load_patches = Patches()
_set_patches = Patches()
_wanted = False
#: The setters are patched on whichever thread imports their module, outside the registry's
#: lock; this lock keeps an uninstall from landing between the two of them. Nothing is
#: imported for the first time while it is held (wrapt came with the load patches).
_setters_lock = threading.Lock()


def install() -> None:
    """Patch DCP's load functions now and the state-dict setters once their module is imported."""
    global _wanted
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_loader

    with _setters_lock:
        _wanted = True
    if not _load_patches.active:
        for owner in (dcp, state_dict_loader):
            _load_patches.wrap(owner, "load", _load)
            _load_patches.wrap(owner, "load_state_dict", _load_state_dict)
    when_imported("torch.distributed.checkpoint.state_dict", _patch_setters)


def uninstall() -> None:
    global _wanted
    with _setters_lock:
        _wanted = False
        _set_patches.restore()
    _load_patches.restore()


def _patch_setters(module: ModuleType) -> None:
    """Runs inside the user's ``import``: whatever goes wrong is logged, never raised."""
    try:
        from ckptshim.execute.dcp_state_dict import set_model_state_dict, set_state_dict

        with _setters_lock:
            if not _wanted or _set_patches.active:
                return
            try:
                _set_patches.wrap(module, "set_model_state_dict", set_model_state_dict)
                _set_patches.wrap(module, "set_state_dict", set_state_dict)
            except Exception:
                _set_patches.restore()
                raise
    except Exception:
        logger.warning("could not patch %s; set_model_state_dict is not shimmed", module.__name__,
                       exc_info=True)


def _load_arguments(state_dict, storage_reader=None, *, checkpoint_id=None, planner=None,
                    process_group=None, no_dist=False) -> dict[str, Any]:
    """``dcp.load``'s parameters (the second positional one is the old ``storage_reader``)."""
    return dict(state_dict=state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                planner=planner, process_group=process_group, no_dist=no_dist)


def _legacy_arguments(state_dict, storage_reader, process_group=None, coordinator_rank=0,
                      no_dist=False, planner=None) -> dict[str, Any]:
    """The deprecated ``load_state_dict``'s parameters."""
    return dict(state_dict=state_dict, storage_reader=storage_reader, process_group=process_group,
                coordinator_rank=coordinator_rank, no_dist=no_dist, planner=planner)


def _load(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        call = _load_arguments(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # let DCP report the bad call
    state_dict = call.pop("state_dict")
    return _shimmed(lambda **swapped: wrapped(state_dict, **{**call, **swapped}),
                    lambda: wrapped(*args, **kwargs), call["checkpoint_id"], call["storage_reader"],
                    call["planner"])


def _load_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    try:
        call = _legacy_arguments(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    return _shimmed(lambda **swapped: wrapped(**{**call, **swapped}), lambda: wrapped(*args, **kwargs),
                    None, call["storage_reader"], call["planner"])


def _shimmed(load: Callable[..., Any], native: Callable[[], Any], checkpoint_id: Any,
             storage_reader: Any, planner: Any) -> Any:
    """Run ``load`` with ckptshim's planner and reader; DCP's own call if ckptshim has a bug."""
    from torch.distributed.checkpoint import CheckpointException

    from ckptshim.execute.dcp_planner import RemappingLoadPlanner

    def shimmed() -> Any:
        reader = _reader(checkpoint_id, storage_reader)
        return load(storage_reader=reader, planner=RemappingLoadPlanner(planner))

    where = checkpoint_id if checkpoint_id is not None else getattr(storage_reader, "path", None)
    try:
        return guarded(SEAM, shimmed, native, where)
    except CheckpointException as error:
        if not _is_internal(error):
            raise
        raise internal_error(SEAM, error, where) from error


def _reader(checkpoint_id: Any, storage_reader: Any) -> Any:
    """ckptshim's reader for a local checkpoint it knows; else the caller's (``None``: DCP's)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckptshim.execute.dcp_storage import DcpReader, FormatReader
    from ckptshim.formats import dcp
    from ckptshim.formats.detect import detect

    if storage_reader is not None and type(storage_reader) is not FileSystemReader:
        return storage_reader
    location = checkpoint_id if checkpoint_id is not None else getattr(storage_reader, "path", None)
    if location is None or "://" in str(location) or not Path(location).exists():
        return storage_reader
    try:
        fmt = detect(location, backend="torch")
    except UnknownFormatError:  # a file DCP cannot read either: FormatReader explains; a folder: DCP's
        return FormatReader(location) if Path(location).is_file() else storage_reader
    return DcpReader(location) if fmt is dcp else FormatReader(location)


def _is_internal(error: BaseException) -> bool:
    """Whether every rank's failure is a non-``ShimError`` raised inside ckptshim's code."""
    failures = getattr(error, "failures", {}) or {}
    return bool(failures) and all(
        not isinstance(exc, ShimError) and bool(trace) and trace[-1].filename.startswith(_PACKAGE_DIR)
        for exc, trace in failures.values())
