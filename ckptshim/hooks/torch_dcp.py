"""The ``torch.distributed.checkpoint`` hook: ``dcp.load`` and ``set_(model_)state_dict``.

``dcp.load`` (every public alias: ``torch.distributed.checkpoint.load``, ``state_dict_loader.load``
and the deprecated ``load_state_dict``) runs DCP's own load with two parts swapped, both chosen
by :mod:`ckptshim.loading.dcp`: the storage reader (for a DCP folder, DCP's own
``FileSystemReader`` with its metadata read safely; for a format DCP cannot read, ckptshim's) and
the planner (ckptshim's key mapping around the caller's planner or DCP's default, which plans on
the stored metadata itself wherever ckptshim has no plan or nothing to change: DCP's own errors,
with ckptshim's diagnosis as a note). A checkpoint in object storage (``s3://``, ``gs://``) named
by ``checkpoint_id`` is read by ckptshim's remote reader where ckptshim can read the URL (else the
load is DCP's alone). Everything runs inside DCP's collective steps, so a refusal on any rank reaches every
rank as DCP's ``CheckpointException`` (holding ckptshim's error) instead of hanging the others,
and it is raised while planning, before any tensor is written. A bug inside ckptshim -- an
exception that is not a ``ShimError`` and was raised in ckptshim's code -- is raised as an
``InternalError``, never handed to DCP's own load: DCP's reader and default planner unpickle
``.metadata`` and stored objects without limits.

``set_model_state_dict``/``set_state_dict`` (``torch.distributed.checkpoint.state_dict``) are
patched, once their module is imported, so that the given model state dict is re-keyed to what
the model expects first (:mod:`ckptshim.loading.torch_state_dict`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn
from torch.distributed.checkpoint import CheckpointException

from ckptshim.errors import ShimError
from ckptshim.hooks.post_import import when_imported
from ckptshim.hooks.seam import Patches, Seam, bind, framework_call, guarded, internal_error
from ckptshim.log import logger

SEAM = Seam("torch-dcp", "torch.distributed.checkpoint.load", falls_back=False)
#: The setters hand torch's own call a state dict of tensors already in memory: safe to fall back.
SETTERS_SEAM = Seam("torch-dcp", "torch.distributed.checkpoint.state_dict.set_model_state_dict", falls_back=True)
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
            _load_patches.wrap(owner, "load_state_dict", _load)
        _load_patches.wrap(dcp.FileSystemReader, "read_metadata", _read_metadata)
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
        with _setters_lock:
            if not _wanted or _set_patches.active:
                return
            try:
                _set_patches.wrap(module, "set_model_state_dict", _set_state_dict)
                _set_patches.wrap(module, "set_state_dict", _set_state_dict)
            except Exception:
                _set_patches.restore()
                raise
    except Exception:
        logger.warning("could not patch %s; set_model_state_dict is not shimmed", module.__name__,
                       exc_info=True)


# -- dcp.load -------------------------------------------------------------------------------------


def _legacy_order(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``dcp.load(state_dict, storage_reader)``, the argument order torch still accepts (with a
    warning, through its ``_api_bc_check``), in today's spelling."""
    if len(args) == 2 and "storage_reader" not in kwargs:
        return args[:1], {**kwargs, "storage_reader": args[1]}
    return args, kwargs


def _load(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    def native() -> Any:
        return wrapped(*args, **kwargs)

    if wrapped.__name__ == "load":
        args, kwargs = _legacy_order(args, kwargs)
    call = bind(wrapped, args, kwargs)
    if call is None:
        return native()  # a bad call: DCP reports it
    from ckptshim.loading import dcp as dcp_loading  # by the first load: see hooks/torch_module.py

    checkpoint_id, reader = call.get("checkpoint_id"), call["storage_reader"]
    where = checkpoint_id if checkpoint_id is not None else getattr(reader, "path", None)
    remote = dcp_loading.remote(checkpoint_id, reader)

    def shimmed() -> Any:
        if remote:
            folder, storage_reader = dcp_loading.remote_reader(checkpoint_id, reader,
                                                               lambda: planner.remaps)  # the planner below
            planner = dcp_loading.load_planner(call["planner"], where if folder is None else folder, storage_reader,
                                               remote=True)
        else:
            folder = dcp_loading.checkpoint_folder(checkpoint_id)
            storage_reader = dcp_loading.storage_reader(folder, reader)
            planner = dcp_loading.load_planner(call["planner"], getattr(storage_reader, "path", where), storage_reader)
        if "checkpoint_id" in call:  # the deprecated aliases take a reader only
            call["checkpoint_id"] = folder
        swapped = dict(call, storage_reader=storage_reader, planner=planner)
        return wrapped(swapped.pop("state_dict"), **swapped)

    try:
        return guarded(SEAM, shimmed, native, where)
    except CheckpointException as error:
        if not _is_internal(error):
            raise
        raise internal_error(SEAM, error, where) from error


def _read_metadata(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """DCP's own ``FileSystemReader``/``FsspecReader`` (DCP's choice, or the caller's) read
    ``.metadata`` through ckptshim's allow-list, never ``pickle.load``: every load ckptshim steps
    aside from, whatever the URL's spelling or the bucket's listing rights, keeps the promise
    that nothing is unpickled beyond what ``torch.load(weights_only=True)`` allows. A refusal
    is raised where torch's reader raises, so DCP reports it as it reports a missing file."""
    from ckptshim.execute.dcp_storage import read_metadata_safely  # by the first load: see hooks/torch_module.py

    return read_metadata_safely(instance, kwargs.get("rank"))


def _is_internal(error: BaseException) -> bool:
    """Whether every rank's failure is a non-``ShimError`` raised inside ckptshim's code."""
    failures = getattr(error, "failures", {}) or {}
    return bool(failures) and all(
        not isinstance(exc, ShimError) and bool(trace) and trace[-1].filename.startswith(_PACKAGE_DIR)
        for exc, trace in failures.values())


# -- set_model_state_dict / set_state_dict -------------------------------------------------------


def _set_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Both setters: ``set_model_state_dict(model, model_state_dict, *, options)`` and
    ``set_state_dict(model, optimizers, *, model_state_dict, optim_state_dict, options)``."""
    call = bind(wrapped, args, kwargs)
    if call is None or not isinstance(call["model"], nn.Module) or not isinstance(call["model_state_dict"], Mapping):
        return wrapped(*args, **kwargs)
    from ckptshim.loading import torch_state_dict  # by the first load: see hooks/torch_module.py

    strict = getattr(call.get("options"), "strict", True)  # StateDictOptions(), torch's default, is strict
    torch_call = framework_call(wrapped)

    def shimmed() -> Any:
        rekeyed = torch_state_dict.prepare(call["model"], call["model_state_dict"], strict)
        if rekeyed is None:
            return torch_call(*args, **kwargs)
        rekeyed.writes.write_assembled()
        call["model_state_dict"] = rekeyed.state_dict
        if "optim_state_dict" in call:
            call["optim_state_dict"] = torch_state_dict.renamed_optimizer(rekeyed.plan, call["optim_state_dict"])
        model, *positional = (call.pop(name) for name in ("model", "optimizers") if name in call)
        return torch_call(model, *positional, **call)

    return guarded(SETTERS_SEAM, shimmed, lambda: wrapped(*args, **kwargs))
