"""Compressed zarr chunks whose headers lie about what they decompress to.

A zstd frame of 128 KiB can declare (and hold, as RLE blocks) 4 GiB; a zarr array can declare a
chunk far larger than itself, which tensorstore decodes whole to read any of it. Both are
refused from headers alone, before anything is decompressed: ``inspect`` names the chunk, and
loads and ``convert`` refuse the incomplete checkpoint.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ckptshim.cli import main
from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import detect
from hostile import confined
from support.fixtures import FIXTURES, writable_copy

PER_LEAF = FIXTURES / "orbax_0.2.3_unscanned/pytree_checkpointer"
ARRAY = "params.decoder.decoder_norm.scale"  # float32[32], one zstd chunk "0"


def zstd_frame(content_size: int, rle_blocks: int, block: int = 2**17) -> bytes:
    """A zstd frame (RFC 8878) declaring ``content_size`` bytes, holding ``rle_blocks`` RLE
    blocks of ``block`` zero bytes each (four bytes of file per block)."""
    head = struct.pack("<I", 0xFD2FB528) + bytes([0b11100000]) + struct.pack("<Q", content_size)
    blocks = [struct.pack("<I", (1 if i == rle_blocks - 1 else 0) | 1 << 1 | block << 3)[:3] + b"\0"
              for i in range(rle_blocks)]
    return head + b"".join(blocks)


def _copy(tmp_path: Path, source: Path = PER_LEAF) -> Path:
    return writable_copy(source, tmp_path / "ckpt")


def _zarray(root: Path, name: str, **change) -> None:
    meta = json.loads((root / name / ".zarray").read_text())
    (root / name / ".zarray").write_text(json.dumps({**meta, **change}))


def test_zstd_chunk_declaring_four_gibibytes(tmp_path, capsys):
    """A 128 KiB chunk of a 128-byte array declaring 4 GiB: refused before decompressing."""
    root = _copy(tmp_path)
    (root / ARRAY / "0").write_bytes(zstd_frame(2**32, 2**15))
    assert (root / ARRAY / "0").stat().st_size < 140_000
    assert main(["inspect", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"{ARRAY}/0 is damaged: its zstd header declares 4294967296 bytes decompressed" in out
    outcome = confined(f"""
        import sys
        from ckptshim.cli import main
        sys.exit(main(["convert", {str(root)!r}, {str(tmp_path / "out")!r}, "--to", "safetensors"]))
        """, memory_mb=2500, seconds=120)
    assert outcome.returncode == 1 and "declares 4294967296 bytes" in outcome.stderr, outcome.stderr[-2000:]
    assert outcome.peak_rss_mb < 800 and not (tmp_path / "out").exists()


def test_chunk_far_larger_than_its_array_is_refused(tmp_path):
    """``chunks: [2**30]`` for a ``shape: [32]`` array, with a frame that really holds 4 GiB:
    tensorstore decodes the whole chunk (4 GiB) to read 128 bytes of it."""
    root = _copy(tmp_path)
    _zarray(root, ARRAY, chunks=[2**30])
    (root / ARRAY / "0").write_bytes(zstd_frame(2**32, 2**15))
    with pytest.raises(CorruptCheckpointError, match=r"chunks \[1073741824\] of 4294967296 bytes each"):
        detect.open_checkpoint(root)
    outcome = confined(f"""
        import sys
        from ckptshim.cli import main
        sys.exit(main(["convert", {str(root)!r}, {str(tmp_path / "out")!r}, "--to", "safetensors"]))
        """, memory_mb=2500, seconds=120)
    assert outcome.returncode == 1 and "Traceback" not in outcome.stderr and outcome.peak_rss_mb < 800


def test_blosc_header_declaring_more_than_its_chunk(tmp_path, capsys):
    """blosc's 16-byte header: nbytes (what it decompresses to) 2 GiB for a 128-byte chunk."""
    root = _copy(tmp_path)
    _zarray(root, ARRAY, compressor={"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1})
    payload = bytes(128)
    header = struct.pack("<BBBBIII", 2, 1, 0x02, 4, 2**31, 128, 16 + len(payload))
    (root / ARRAY / "0").write_bytes(header + payload)
    assert main(["inspect", str(root)]) == 1
    assert "blosc header declares 2147483648 bytes decompressed" in capsys.readouterr().out


def test_gzip_trailer_declaring_more_than_its_chunk(tmp_path, capsys):
    """T5X's gzip chunks: ISIZE, the trailer's uncompressed size, larger than the chunk."""
    step = FIXTURES / "t5x_tiny_decoder/legacy_checkpointer/checkpoint_0"
    root = _copy(tmp_path, step)
    chunk = next(p for p in sorted(root.rglob("*")) if p.is_file() and p.name[0].isdigit())
    data = bytearray(chunk.read_bytes())
    assert data[:2] == b"\x1f\x8b"
    data[-4:] = struct.pack("<I", 2**31)
    chunk.write_bytes(bytes(data))
    assert main(["inspect", str(root)]) == 1
    assert "gzip header declares 2147483648 bytes decompressed" in capsys.readouterr().out


def test_control_real_chunks_pass_their_header_checks():
    for root in (PER_LEAF, FIXTURES / "t5x_tiny_decoder/legacy_checkpointer/checkpoint_0",
                 FIXTURES / "paxml_runs/TinySpmdRepeat/checkpoints/checkpoint_00000001"):
        checkpoint = detect.open_checkpoint(root)
        assert checkpoint.complete, checkpoint.all_problems()
