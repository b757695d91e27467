"""Which format a path is in, from cheap fingerprints; and opening it.

One detector, one order. ``detect(path)`` recognises anything ckptshim reads (what ``ckptshim
inspect`` accepts: files, items, step folders, roots of steps); ``detect(path, backend=...)``
only what a load call of that backend can be given, as each format's ``READERS`` says: for
``"torch"`` (``dcp.load``, DeepSpeed) the files and folders torch's loaders read, for ``"jax"``
(an Orbax, Flax or T5X restore) one restorable item.

A checkpoint in object storage (``s3://``, ``gs://``) is recognised from one bounded listing of
its prefix (or, for one object, from its name -- ``.safetensors`` -- or its first bytes -- a
``torch.save`` archive), among the formats that read remote locations so far
(:data:`REMOTE_FORMATS`).
"""

from __future__ import annotations

import os
from collections.abc import Collection

from ckptshim.errors import CorruptCheckpointError, InternalError, UnknownFormatError
from ckptshim.formats import (dcp, deepspeed_pipeline, deepspeed_zero, flax_msgpack, hf_dir, megatron_core,
                              meta_llama, orbax, orbax_manager, paxml, paxml_flax, safetensors, t5x, torch_pickle,
                              torchtune)
from ckptshim.formats.base import Checkpoint, Format, reading
from ckptshim.storage import Location, UnsupportedLocation

#: Where two formats can claim the same files: (the one that wins, the one it wins over, why).
#: :data:`FORMATS` is tried in order, so each winner comes first there; :func:`ranked` checks it.
PRECEDENCE: tuple[tuple[Format, Format, str], ...] = (
    (hf_dir, safetensors, "a Hugging Face folder's weights are safetensors files; the folder says which"),
    (hf_dir, torch_pickle, "a Hugging Face folder's weights may be pytorch_model.bin; the folder says which"),
    (hf_dir, torchtune, "a Hugging Face folder's weights file is the one transformers reads, whatever else is beside it"),
    (deepspeed_zero, deepspeed_pipeline,
     "a ZeRO folder holds mp_rank_00_model_states.pt too (its 16-bit module), which the pipeline reader "
     "would read, missing the fp32 masters in the optimizer partitions"),
    (paxml_flax, orbax, "PaxML's Flax msgpack aggregate passes for Orbax's legacy aggregate"),
    (t5x, orbax, "T5X's msgpack aggregate passes for Orbax's legacy aggregate"),
    (paxml, orbax, "a PaxML state folder's per-leaf zarr arrays pass for an Orbax item"),
)


def ranked(formats: tuple[Format, ...], precedence: tuple[tuple[Format, Format, str], ...]) -> tuple[Format, ...]:
    """``formats`` itself, once every pair of ``precedence`` is checked to hold in its order (an
    :class:`~ckptshim.errors.InternalError` naming the pair otherwise: a registry edit that
    would let a format read another's files)."""
    order = {fmt.NAME: at for at, fmt in enumerate(formats)}
    for winner, loser, why in precedence:
        if order[winner.NAME] > order[loser.NAME]:
            raise InternalError(f"format registry: {winner.NAME} must be tried before {loser.NAME} ({why})")
    return formats


#: Every format, most specific first: a directory format before the single files it may contain,
#: and each pair of :data:`PRECEDENCE` in its order.
FORMATS: tuple[Format, ...] = ranked((hf_dir, torchtune, dcp, megatron_core, meta_llama, deepspeed_zero,
                                      deepspeed_pipeline, paxml_flax, t5x, paxml, orbax, orbax_manager, safetensors, torch_pickle, flax_msgpack), PRECEDENCE)
#: The backends whose load calls name a checkpoint (see each format's ``READERS``).
BACKENDS = ("torch", "jax")
#: The formats whose ``open_checkpoint`` reads a remote :class:`~ckptshim.storage.Location`, in
#: :data:`FORMATS`' order; those of :data:`LOCATION_SNIFFED` are recognised by their own sniffers.
REMOTE_FORMATS: tuple[Format, ...] = (hf_dir, torchtune, dcp, megatron_core, meta_llama, paxml_flax, t5x, paxml,
                                      orbax, safetensors, torch_pickle, flax_msgpack)
#: The remote formats whose ``sniff`` and ``READERS`` take a Location as they take a local path.
LOCATION_SNIFFED: tuple[Format, ...] = (torchtune, megatron_core, meta_llama, paxml_flax, t5x, paxml, orbax,
                                        flax_msgpack)
#: The remote formats of one object (not a prefix), in :data:`FORMATS`' order.
OBJECT_FORMATS: tuple[Format, ...] = (safetensors, torch_pickle)


def location(path: str | os.PathLike | Location) -> Location:
    """``path`` as a :class:`~ckptshim.storage.Location`: a local path, or an ``s3://`` or
    ``gs://`` URL. A URL of another scheme is an :class:`UnknownFormatError` (``pathlib`` would
    make a relative local path of it)."""
    try:
        return Location.of(path)
    except UnsupportedLocation as error:
        raise UnknownFormatError(f"{error}. Copy the checkpoint to a local folder and point at the copy.") from None


def object_format(where: Location, candidates: Collection[Format]) -> Format | None:
    """The format, among ``candidates``, of the single object at ``where`` (no prefix there), as
    its own sniffer says (a ``.safetensors`` object by its name, a ``torch.save`` archive by
    its first bytes, whatever its name); ``None`` for any other object, and a
    ``FileNotFoundError`` where there is none. A pre-1.6 ``torch.save`` file is an
    :class:`UnknownFormatError` that says to download it."""
    if where.stat().kind != "file":
        return None
    return next((fmt for fmt in OBJECT_FORMATS if fmt in candidates and fmt.sniff(where)), None)


def _detect_remote(where: Location, backend: str | None) -> Format:
    """The format of the checkpoint at ``where``: a prefix, recognised from one bounded listing
    (a Hugging Face folder before DCP, as locally), or one object (:func:`object_format`)."""
    candidates = [fmt for fmt in REMOTE_FORMATS if backend is None or backend in fmt.READERS]
    with reading(where, "recognising its format"):
        try:
            names: set[str] | None = {info.location.name for info in where.list()}
        except FileNotFoundError:
            names = None  # no prefix: an object, or nothing
        if names is None:
            try:
                found = object_format(where, candidates)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{where}: no such object or prefix") from None
            if found is not None:
                return found
    if names is not None and hf_dir in candidates and hf_dir.sniff_listed(names):
        return hf_dir
    if names is not None and dcp in candidates and dcp.metadata_names(names):
        return dcp
    if names is not None and orbax in candidates and orbax.sniff_listed(names):
        return orbax  # Orbax's _METADATA layouts; T5X and PaxML write no _METADATA
    with reading(where, "recognising its format"):
        for fmt in candidates:
            if fmt in LOCATION_SNIFFED and (fmt.sniff if backend is None else fmt.READERS[backend])(where):
                return fmt
    raise UnknownFormatError(
        f"{where} is not a checkpoint ckptshim reads from object storage (so far: "
        f"{', '.join(fmt.NAME for fmt in candidates) or 'none for this backend'}). Copy it to a local "
        "folder (gcloud storage cp -r, aws s3 cp --recursive) and point at the copy.")


def detect(path: str | os.PathLike | Location, backend: str | None = None) -> Format:
    """The format module that recognises ``path`` (for ``backend``'s load calls, if given), or a
    :class:`UnknownFormatError`."""
    where = location(path)
    if where.is_remote:  # the formats that read object storage, recognised from one listing
        return _detect_remote(where, backend)
    path = where.path
    with reading(path, "recognising its format"):
        if not path.exists():
            raise CorruptCheckpointError(f"{path}: no such file or directory")
        if path.is_dir() and not any(path.iterdir()):
            raise UnknownFormatError(f"{path} is an empty directory; point at a checkpoint file or folder.")
        candidates = FORMATS if backend is None else tuple(fmt for fmt in FORMATS if backend in fmt.READERS)
        for fmt in candidates:
            if (fmt.sniff if backend is None else fmt.READERS[backend])(path):
                return fmt
    known = ", ".join(fmt.NAME for fmt in candidates)
    if hf_dir in candidates and path.is_dir() and (path / "config.json").is_file():
        raise CorruptCheckpointError(
            f"{path} holds a config.json but no weights: none of {', '.join(hf_dir.WEIGHT_FILES)} "
            "is in it (missing). Restore the weights file (or re-copy the model folder).")
    raise UnknownFormatError(
        f"{path} is not in a format ckptshim knows ({known}). Run `ckptshim inspect` on the "
        "checkpoint's top-level folder, or check that the file is not truncated.")


def open_checkpoint(path: str | os.PathLike | Location, backend: str | None = None) -> Checkpoint:
    """Open ``path`` in whatever format it is in (metadata only; no tensor bytes are read); a
    Megatron-LM save root opens the iteration its ``latest_checkpointed_iteration.txt`` names."""
    where = location(path)
    with reading(where, "reading its latest iteration"):
        found = megatron_core.iteration_folder(where if where.is_remote else where.path)
    where = Location.of(found) if found is not None else where
    # the formats that read object storage take a Location; the others, local paths
    return detect(where, backend).open_checkpoint(where if where.is_remote else where.path)
