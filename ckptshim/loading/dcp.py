"""``dcp.load`` through ckptshim: which storage reader reads the checkpoint, and what maps onto what.

The DCP hook swaps two parts of DCP's own load (see :mod:`ckptshim.hooks.torch_dcp`):

- :func:`storage_reader` -- ckptshim's readers for local checkpoints it recognises as torch
  formats (:func:`ckptshim.formats.detect.detect` with ``backend="torch"``): DCP directories
  (safe metadata unpickling, every chunk read once, every file checked before any write) and
  ``torch.save`` files, safetensors files, Hugging Face folders and DeepSpeed checkpoints,
  which DCP cannot read; :func:`remote_reader` -- the same for a DCP checkpoint in ``s3://``
  or ``gs://``;
- :func:`load_planner` -- a :class:`~ckptshim.execute.dcp_planner.RemappingLoadPlanner` around
  the caller's planner, which runs :func:`prepare_mapping` while DCP plans: the checkpoint's flat
  keys against the state dict's (wrapper hops at any depth, a missing or extra top-level
  ``"model"`` level, per-layer lists against stacked layers, tied weights, transformers'
  conversion mapping of the model the checkpoint's ``config.json`` names), checked, reported on
  every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from ckptshim.errors import NoPlan, PlanError, ShimError, UnknownFormatError, describe
from ckptshim.execute.dcp_planner import FlatKeys, KeyMapping, RemappingLoadPlanner
from ckptshim.execute.dcp_storage import DcpReader, FormatReader, RemoteDcpReader
from ckptshim.formats import dcp, hf_dir, megatron_core, safetensors, torch_pickle
from ckptshim.formats.detect import detect, remote_object
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
from ckptshim.storage import Location

HOOK = "torch.distributed.checkpoint.load"


def storage_reader(checkpoint_id: Any, given: StorageReader | None) -> StorageReader | None:
    """ckptshim's reader for a local checkpoint it knows; else the caller's (``None``: DCP's).

    A reader the caller built themselves (anything but DCP's plain ``FileSystemReader``) is theirs
    and runs untouched, as a ``torch.load(weights_only=False)`` they wrote would. A DCP folder is
    read by :class:`~ckptshim.execute.dcp_storage.DcpReader` -- DCP's own reader with the
    metadata read safely -- with the extension registry of the caller's ``FileSystemReader``, if
    they passed one (their custom stream transforms). A checkpoint named by a ``file://`` URL is
    read locally; other URLs never get here (:func:`remote`).
    """
    from torch.distributed.checkpoint import FileSystemReader

    if given is not None and type(given) is not FileSystemReader:
        return given
    location = checkpoint_id if checkpoint_id is not None else getattr(given, "path", None)
    if location is not None and "://" in str(location):
        location = _local_path(str(location))
    if location is None or not Path(location).exists():
        return given
    try:
        fmt = detect(location, backend="torch")
    except UnknownFormatError:  # a file DCP cannot read either: FormatReader explains; a folder: DCP's
        return FormatReader(location, hook=HOOK) if Path(location).is_file() else given
    if fmt is dcp:
        return DcpReader(location, given.transforms.extension_registry if given is not None else None)
    return FormatReader(location, fmt, hook=HOOK)  # which says, once it has opened the checkpoint, what it reads


def checkpoint_folder(checkpoint_id: Any) -> Any:
    """The folder ``dcp.load`` reads for ``checkpoint_id``: for a Megatron-LM save root
    (``latest_checkpointed_iteration.txt``), which DCP cannot read, the iteration folder it
    names; else ``checkpoint_id`` itself."""
    if checkpoint_id is None or "://" in str(checkpoint_id) or not Path(checkpoint_id).is_dir():
        return checkpoint_id
    return megatron_core.iteration_folder(Path(checkpoint_id)) or checkpoint_id


def remote(checkpoint_id: Any, given: StorageReader | None) -> bool:
    """Whether DCP itself would read this checkpoint from object storage (a URL other than
    ``file://``, through its ``FsspecReader``): :func:`remote_reader` chooses its reader."""
    from torch.distributed.checkpoint import FileSystemReader

    if given is not None and type(given) is not FileSystemReader:
        return False  # the caller's own reader (an FsspecReader they built included) is theirs
    location = str(checkpoint_id if checkpoint_id is not None else getattr(given, "path", ""))
    return "://" in location and _local_path(location) is None


def remote_reader(checkpoint_id: Any, given: StorageReader | None,
                  planner: RemappingLoadPlanner) -> RemoteDcpReader | FormatReader:
    """ckptshim's reader for a checkpoint in object storage (where :func:`remote`). A DCP
    checkpoint: its metadata read safely, and its chunks read by ckptshim where the plan remaps
    keys, by torch's own ``FsspecReader`` data path where it does not (``planner`` says which,
    once DCP has planned: :class:`~ckptshim.execute.dcp_storage.RemoteDcpReader`). A safetensors
    or ``torch.save`` object, or a Hugging Face folder of their weights, which DCP cannot read: a
    :class:`~ckptshim.execute.dcp_storage.FormatReader` reading each tensor by its byte range.

    :class:`~ckptshim.errors.NoPlan` -- DCP's own load, as without ckptshim -- where ckptshim
    cannot read the URL: a scheme it does not read, nothing or no checkpoint it knows below it,
    its fsspec client missing, unreachable or without credentials (whatever the client raises
    while listing: no byte of the checkpoint has been parsed yet, and DCP then reports what is
    wrong in its own words). A listing ckptshim refuses (too many entries, a name leaving the
    prefix) is a refusal, final as any.
    """
    url = str(checkpoint_id if checkpoint_id is not None else getattr(given, "path", ""))
    try:
        location = Location.of(url)
        try:
            listed = location.list()
        except FileNotFoundError:  # no prefix: a safetensors or torch.save object, or nothing
            fmt = remote_object(location, (safetensors, torch_pickle))
            if fmt is None:
                raise NoPlan(f"{url}: an object ckptshim does not read; DCP's own reader decides") from None
            return FormatReader(location, fmt, hook=HOOK)
    except UnknownFormatError as error:  # a legacy torch.save object: DCP's own error, with this note
        raise NoPlan(str(error)) from None
    except ShimError:
        raise
    except Exception as error:  # the client's own failure: see the docstring
        raise NoPlan(f"{url}: ckptshim does not read it ({describe(error)}); DCP's own reader does") from None
    names = [info.location.name for info in listed]
    if dcp.metadata_names(names):
        registry = given.transforms.extension_registry if given is not None else None
        return RemoteDcpReader(location, registry, listed, lambda: planner.remaps)
    if hf_dir.sniff_remote(names):
        return FormatReader(location, hf_dir, hook=HOOK)
    raise NoPlan(f"{url}: holds no {dcp.METADATA_FILE} nor Hugging Face weights that ckptshim could read first; "
                 "DCP's own reader decides")


def _local_path(url: str) -> str | None:
    """The local path a ``file://`` URL names; ``None`` for any other."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if parts.scheme == "file" and parts.netloc in ("", "localhost"):
        return unquote(parts.path)
    return None


def load_planner(inner: LoadPlanner | None, location: Any = None,
                 reader: StorageReader | None = None) -> RemappingLoadPlanner:
    """The planner ``dcp.load`` runs: ckptshim's key mapping in front of ``inner`` (or DCP's
    default), for the checkpoint at ``location`` (a local path, where known) that ``reader``
    reads."""
    return RemappingLoadPlanner(inner, partial(prepare_mapping, location=location, reader=reader))


def prepare_mapping(metadata: Metadata, state_dict: dict[str, Any], allow_missing: bool,
                    location: Any = None, reader: StorageReader | None = None) -> KeyMapping | None:
    """Plan the checkpoint's keys onto the state dict's and check the plan (nothing is read);
    ``None`` where every key the state dict asks for is stored under that name, shape and dtype
    (DCP's own planner plans on the stored metadata), :class:`~ckptshim.errors.NoPlan` where no
    plan makes them fit (DCP's own planner decides).

    DCP reads only what the state dict asks for and checks no value while planning, so a
    checkpoint key named like a derivable buffer is not dropped as one: like any key the state
    dict has no place for, it is unexpected, and left unread. Where no module is passed, the
    checkpoint's own ``config.json`` (beside it at ``location``; the metadata's ``checkpoint_id``
    is where it was saved) names the transformers model whose conversion mapping applies: read
    once, from the checkpoint ckptshim's ``reader`` opened where it read this one.
    """
    if location is None:
        location = getattr(metadata.storage_meta, "checkpoint_id", None)
    where = str(location or "DCP checkpoint")
    flat, target_paths = flatten_state_dict(state_dict)
    if _stored_as_asked(metadata, flat):
        return None
    source, target, note = _sides(metadata, flat, target_paths, where)
    tensors = {entry.key: flat[entry.location] for entry in target.inventory.values()
               if entry.key not in target.objects}
    context = LoadContext(source.inventory, target.inventory, "dcp", state_dict_facts(tensors),
                          _model_config(reader, location), producer(location))
    plan = make_plan(source.inventory, target.inventory, rules_for(context))
    plan.require_complete(allow_missing=allow_missing, allow_unexpected=True,
                          lenient="planner=DefaultLoadPlanner(allow_partial_load=True)")
    _check_objects(plan, source, target)
    report_load(HOOK, plan)  # on every rank: each loads its own part
    if note:
        logger.info("%s: %s", HOOK, note)
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


def _stored_as_asked(metadata: Metadata, flat: Mapping[str, Any]) -> bool:
    """Whether each flat key of the state dict is stored under that name, as a tensor of its size
    and dtype or, for any other value, as an object: there is nothing to map."""
    stored = metadata.state_dict_metadata
    for fqn, value in flat.items():
        md = stored.get(fqn)
        if isinstance(value, torch.Tensor):
            if not (isinstance(md, TensorStorageMetadata) and md.size == value.size()
                    and md.properties.dtype == value.dtype):
                return False
        elif not isinstance(md, BytesStorageMetadata):
            return False
    return True


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


