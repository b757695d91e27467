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

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from ckptshim.errors import NoPlan, ShimError, UnknownFormatError, describe
from ckptshim.execute.dcp_storage import DcpReader, FormatReader, RemoteDcpReader
from ckptshim.execute.dcp_planner import RemappingLoadPlanner
from ckptshim.formats import dcp, hf_dir, torchtune
from ckptshim.storage import Location

if TYPE_CHECKING:
    from ckptshim.execute.dcp_virtual import KeyMapping

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
        fmt = _torch_format(location)
    except UnknownFormatError:  # a file DCP cannot read either: FormatReader explains; a folder: DCP's
        return FormatReader(location, hook=HOOK) if Path(location).is_file() else given
    if fmt is dcp:
        return DcpReader(location, given.transforms.extension_registry if given is not None else None)
    return FormatReader(location, fmt, hook=HOOK)  # which says, once it has opened the checkpoint, what it reads


def checkpoint_folder(checkpoint_id: Any) -> Any:
    """The local folder ``dcp.load`` reads for ``checkpoint_id``: for a Megatron-LM save root
    (``latest_checkpointed_iteration.txt``), which DCP cannot read, the iteration folder it
    names; else ``checkpoint_id`` itself (a folder with DCP metadata of its own is what DCP
    reads). A bucket prefix's save root is resolved by :func:`remote_reader` from its listing."""
    if checkpoint_id is None or "://" in str(checkpoint_id) or not Path(checkpoint_id).is_dir() \
            or dcp.sniff(Path(checkpoint_id)):
        return checkpoint_id
    from ckptshim.formats import megatron_core  # only for a folder DCP cannot read

    return megatron_core.iteration_folder(Path(checkpoint_id)) or checkpoint_id


#: The first formats :func:`~ckptshim.formats.detect.detect` tries for a torch load, in its
#: order (``tests/test_first_call.py`` checks it against ``detect.FORMATS``).
FIRST_TRIED = (hf_dir, torchtune, dcp)


def _torch_format(location: str | Path) -> Any:
    """``detect(location, backend="torch")``, where a DCP folder is recognised by the same
    sniffers in the same order (:data:`FIRST_TRIED`) without importing every other format;
    anything else by :func:`~ckptshim.formats.detect.detect` itself, which also words every
    refusal."""
    path = Path(location)
    try:
        for fmt in FIRST_TRIED:
            if fmt.READERS["torch"](path):
                if fmt is dcp:
                    return dcp
                break
    except (OSError, ShimError):
        pass  # detect says what is wrong, in its own words
    from ckptshim.formats.detect import detect

    return detect(location, backend="torch")


def remote(checkpoint_id: Any, given: StorageReader | None) -> bool:
    """Whether DCP itself would read this checkpoint from object storage (a URL other than
    ``file://``, through its ``FsspecReader``): :func:`remote_reader` chooses its reader."""
    from torch.distributed.checkpoint import FileSystemReader

    if given is not None and type(given) is not FileSystemReader:
        return False  # the caller's own reader (an FsspecReader they built included) is theirs
    location = str(checkpoint_id if checkpoint_id is not None else getattr(given, "path", ""))
    return "://" in location and _local_path(location) is None


def remote_reader(checkpoint_id: Any, given: StorageReader | None,
                  remaps: Callable[[], bool]) -> tuple[Any, RemoteDcpReader | FormatReader]:
    """The checkpoint ``dcp.load`` reads in object storage (where :func:`remote`), and ckptshim's
    reader for it. The checkpoint is ``checkpoint_id``, or for a Megatron-LM save root (its
    listing holds ``latest_checkpointed_iteration.txt`` and no DCP metadata) the iteration
    folder that names, by its URL. A DCP
    checkpoint: its metadata read safely, and its chunks read by ckptshim where the plan remaps
    keys, by torch's own ``FsspecReader`` data path where it does not (``remaps()``, the load's
    planner, says which, once DCP has planned: :class:`~ckptshim.execute.dcp_storage.RemoteDcpReader`).
    A safetensors
    or ``torch.save`` object, or a Hugging Face folder of their weights, which DCP cannot read: a
    :class:`~ckptshim.execute.dcp_storage.FormatReader` reading each tensor by its byte range.

    :class:`~ckptshim.errors.NoPlan` -- DCP's own load, as without ckptshim -- where ckptshim
    cannot read the URL: a scheme it does not read, nothing or no checkpoint it knows below it,
    its fsspec client missing, unreachable or without credentials (whatever the client raises
    while listing: no byte of the checkpoint has been parsed yet, and DCP then reports what is
    wrong in its own words). A listing ckptshim refuses (too many entries, a name leaving the
    prefix) is a refusal, final as any.
    """
    from ckptshim.formats.detect import OBJECT_FORMATS, object_format

    url = str(checkpoint_id if checkpoint_id is not None else getattr(given, "path", ""))
    try:
        location = Location.of(url)
        try:
            listed = location.list()
        except FileNotFoundError:  # no prefix: a safetensors or torch.save object, or nothing
            fmt = object_format(location, OBJECT_FORMATS)
            if fmt is None:
                raise NoPlan(f"{url}: an object ckptshim does not read; DCP's own reader decides") from None
            return checkpoint_id, FormatReader(location, fmt, hook=HOOK)
    except UnknownFormatError as error:  # a legacy torch.save object: DCP's own error, with this note
        raise NoPlan(str(error)) from None
    except ShimError:
        raise
    except Exception as error:  # the client's own failure: see the docstring
        raise NoPlan(f"{url}: ckptshim does not read it ({describe(error)}); DCP's own reader does") from None
    names = [info.location.name for info in listed]
    if dcp.metadata_names(names):
        registry = given.transforms.extension_registry if given is not None else None
        return checkpoint_id, RemoteDcpReader(location, registry, listed, remaps)
    if hf_dir.sniff_listed(names):
        return checkpoint_id, FormatReader(location, hf_dir, hook=HOOK, listed=listed)
    from ckptshim.formats import megatron_core

    if megatron_core.LATEST_FILE in names:  # a save root: the iteration it names, read the same way
        folder = megatron_core.iteration_folder(location, listed)
        if folder is not None:
            return remote_reader(str(folder), given, remaps)
    from ckptshim.formats.detect import LOCATION_SNIFFED

    fmt = next((fmt for fmt in LOCATION_SNIFFED if "torch" in fmt.READERS and fmt.READERS["torch"](location)), None)
    if fmt is not None:  # a torch format DCP cannot read (Meta's consolidated.NN.pth beside params.json)
        return checkpoint_id, FormatReader(location, fmt, hook=HOOK)
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
                 reader: StorageReader | None = None, remote: bool = False) -> RemappingLoadPlanner:
    """The planner ``dcp.load`` runs: ckptshim's key mapping in front of ``inner`` (or DCP's
    default), for the checkpoint at ``location`` (a local path, where known) that ``reader``
    reads (``remote``: that :func:`remote_reader` gives). A reordered block is one strided copy
    only for ckptshim's own readers, which copy a block into its destination split into factors."""
    return RemappingLoadPlanner(inner, partial(prepare_mapping, location=location, reader=reader),
                                strided_reads=remote or isinstance(reader, (DcpReader, FormatReader)))


def prepare_mapping(metadata: Metadata, state_dict: dict[str, Any], allow_missing: bool,
                    location: Any = None, reader: StorageReader | None = None) -> KeyMapping | None:
    """Plan the checkpoint's keys onto the state dict's and check the plan (nothing is read);
    ``None`` where every key the state dict asks for is stored under that name, shape and dtype
    (DCP's own planner plans on the stored metadata), :class:`~ckptshim.errors.NoPlan` where no
    plan makes them fit (DCP's own planner decides). That first answer comes from the names,
    shapes and dtypes alone, before the planner, the rules and the profiles are imported: a load
    with nothing to map costs no more than DCP's own
    (:func:`~ckptshim.loading.dcp_mapping.checked_mapping` plans the others).

    DCP reads only what the state dict asks for and checks no value while planning, so a
    checkpoint key named like a derivable buffer is not dropped as one: like any key the state
    dict has no place for, it is unexpected, and left unread. Where no module is passed, the
    checkpoint's own ``config.json`` (beside it at ``location``; the metadata's ``checkpoint_id``
    is where it was saved) names the transformers model whose conversion mapping applies: read
    once, from the checkpoint ckptshim's ``reader`` opened where it read this one.
    """
    flat, target_paths = flatten_state_dict(state_dict)
    if _stored_as_asked(metadata, flat):
        return None
    from ckptshim.loading import dcp_mapping  # the planning machinery: only for a load that plans

    if location is None:
        location = getattr(metadata.storage_meta, "checkpoint_id", None)
    return dcp_mapping.checked_mapping(metadata, flat, target_paths, allow_missing, location, reader, HOOK)


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


