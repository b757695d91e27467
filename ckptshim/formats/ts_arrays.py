"""Reading zarr arrays (in a folder or an OCDBT database) through tensorstore, slice by slice.

:meth:`TensorstoreArrays.read_into` copies one index range of one array straight into a
caller-owned buffer (``ts.array(out, copy=False)`` as the write target), so a device's shard is
decompressed into its final memory with no intermediate full-size copy, and only the chunks
that overlap the range are fetched. Casts happen inside tensorstore (``ts.cast``), exactly as
Orbax casts when a restore asks for another dtype. Chunk data is not cached (each byte is read
once); the OCDBT index is, as Orbax does. An array stored as a folder of its own is opened with
the ``.zarray``/``zarr.json`` its checkpoint already read (and ckptshim validated): tensorstore
then assumes that metadata instead of reading it again (below a bucket prefix, one round trip
less per array).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptshim.formats.kvstore import Root, kvstore_spec

_CONTEXT_SPEC = {
    "cache_pool": {"total_bytes_limit": 0},
    "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
    "file_io_concurrency": {"limit": 128},
}


class TensorstoreArrays:
    """Zarr arrays stored under ``root`` (plain folders or OCDBT), opened once each, on demand."""

    def __init__(self, root: Root, ocdbt: bool, known: Mapping[str, bytes] | None = None) -> None:
        """``known``: array name -> the bytes of its metadata file, as the checkpoint read them."""
        import tensorstore as ts

        self._ts = ts
        self._root, self._ocdbt = root, ocdbt
        self._known = dict(known or {}) if not ocdbt else {}
        self._context = ts.Context(_CONTEXT_SPEC)
        self._open: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _store(self, name: str, driver: str):
        with self._lock:
            store = self._open.get(name)
        if store is None:
            kvstore = dict(kvstore_spec(self._root, self._ocdbt))
            if self._ocdbt:
                kvstore.update(path=name, cache_pool="cache_pool#ocdbt")
            else:
                kvstore["path"] += name + "/"
            spec = {"driver": driver, "kvstore": kvstore, "recheck_cached_data": False,
                    "recheck_cached_metadata": False}
            store = self._open_assumed(spec, name) if name in self._known else None
            if store is None:
                store = self._ts.open(spec, open=True, read=True, context=self._context).result()
            with self._lock:
                store = self._open.setdefault(name, store)
        return store

    def _open_assumed(self, spec: dict[str, Any], name: str):
        """The array opened with the metadata already read, or ``None`` where tensorstore does not
        take it as a spec (it then reads the metadata file itself, as without it)."""
        try:
            return self._ts.open({**spec, "metadata": json.loads(self._known[name])}, open=True, read=True,
                                 assume_metadata=True, context=self._context).result()
        except ValueError:
            return None

    def read_into(self, name: str, driver: str, index: tuple, out: np.ndarray):
        """Start copying ``array[index]`` into ``out`` (cast to ``out.dtype``); returns a future."""
        ts = self._ts
        source = self._store(name, driver)
        if index:
            source = source[index]
        if source.dtype.numpy_dtype != out.dtype:
            source = ts.cast(source, ts.dtype(out.dtype.name))
        return ts.array(out, copy=False, write=True).write(source)

    def close(self) -> None:
        with self._lock:
            self._open.clear()
