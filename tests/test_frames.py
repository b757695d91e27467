"""Chunk lengths read from compressed frame headers, on chunks tensorstore itself writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

from ckptshim.formats import frames


def write_zarr(folder: Path, data: np.ndarray, compressor: dict) -> list[Path]:
    """One zarr v2 array, one chunk per row block, written by tensorstore; its chunk files."""
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(folder)},
            "metadata": {"shape": list(data.shape), "chunks": [data.shape[0] // 2, data.shape[1]],
                         "dtype": "<f4", "compressor": compressor}}
    ts.open(spec, create=True).result().write(data).result()
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


DATA = {
    # incompressible: raw blocks, several of them (a zstd block holds at most 128 KiB)
    "random": np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32),
    # one repeated byte: RLE blocks, whose size field is not their length on disk
    "zeros": np.zeros((256, 1024), np.float32),
    # compressible but not trivially: compressed blocks
    "ramp": np.tile(np.arange(1024, dtype=np.float32), (256, 1)),
}
COMPRESSORS = {"zstd": {"id": "zstd", "level": 1}, "blosc": {"id": "blosc", "cname": "lz4", "clevel": 5,
                                                              "shuffle": 1}}


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
@pytest.mark.parametrize("kind", sorted(DATA))
def test_needed_length_is_the_file_length(tmp_path, compressor, kind):
    for chunk in write_zarr(tmp_path / "a", DATA[kind], COMPRESSORS[compressor]):
        fd = os.open(chunk, os.O_RDONLY)
        try:
            assert frames.needed_length(fd, compressor) == chunk.stat().st_size
        finally:
            os.close(fd)
        assert frames.short_chunk(chunk, compressor, chunk.name) is None


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_a_cut_chunk_is_named_with_what_it_needs(tmp_path, compressor, keep):
    chunk = write_zarr(tmp_path / "a", DATA["random"], COMPRESSORS[compressor])[0]
    whole = chunk.stat().st_size
    chunk.write_bytes(chunk.read_bytes()[: int(whole * keep)])
    problem = frames.short_chunk(chunk, compressor, "a/0.0")
    assert problem is not None and problem.startswith("a/0.0 is ")
    assert "truncated" in problem or "damaged" in problem


def test_zeroed_zstd_chunk_is_damaged(tmp_path):
    chunk = write_zarr(tmp_path / "a", DATA["ramp"], COMPRESSORS["zstd"])[0]
    chunk.write_bytes(bytes(chunk.stat().st_size))
    assert "a/0.0 is damaged" in frames.short_chunk(chunk, "zstd", "a/0.0")
