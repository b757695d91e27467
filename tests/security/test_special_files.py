"""A FIFO (or a link to one) in place of a file of a checkpoint is refused, naming it -- it never
blocks ``open()``.

Opening a named pipe for reading waits for a writer, for ever. Before, ckptshim opened zarr
chunks (for their compressed headers), ``.zarray`` files and T5X chunks through tensorstore,
DeepSpeed layer files, torch files and safetensors files with a plain ``open()``; only the DCP,
OCDBT, Hugging Face and ``_METADATA`` paths checked for a regular file first. Now every file
ckptshim opens is opened by ``formats/base.py``'s ``open_regular`` (a ``stat``, then an
``O_NONBLOCK`` open checked again), and the walk every folder format makes when it is opened
refuses anything that is neither a regular file nor a folder -- tensorstore, which opens chunks
itself, never meets one. Each case runs ``ckptshim inspect`` in a confined child with a time limit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hostile import confined
from support.fixtures import writable_copy
from test_symlinks import CASES

def _inspect(root: Path, seconds: float = 60):
    return confined(f"""
        from ckptshim.cli import main
        print("EXIT", main(["inspect", {str(root)!r}]))
        """, memory_mb=2048, seconds=seconds)


def _fifo_in_place_of(tmp_path: Path, source: Path, member: str) -> tuple[Path, Path]:
    root = writable_copy(source, tmp_path / "ckpt")
    file = root / member
    assert file.is_file(), member
    file.unlink()
    os.mkfifo(file)
    return root, file


@pytest.mark.parametrize("case", sorted(CASES))
def test_fifo_in_place_of_a_checkpoint_file_is_refused(tmp_path, case):
    """The files of every format (the symlink suite's table): a DCP rank file, a per-leaf zarr
    chunk and ``.zarray``, a T5X chunk, an OCDBT data file and manifest, a PaxML chunk, a
    DeepSpeed layer file, a Flax step file."""
    root, fifo = _fifo_in_place_of(tmp_path, *CASES[case])
    outcome = _inspect(root)
    assert not outcome.timed_out, f"opening {fifo.name} blocked"
    assert "EXIT 1" in outcome.stdout, outcome.stdout[-2000:] + outcome.stderr[-2000:]
    assert "named pipe (FIFO)" in outcome.stderr and str(fifo) in outcome.stderr, outcome.stderr[-2000:]


def test_link_to_a_fifo_inside_the_checkpoint_is_refused(tmp_path):
    """A chunk that is a link -- inside the checkpoint, so allowed -- to a FIFO beside it."""
    root, fifo = _fifo_in_place_of(tmp_path, *CASES["per-leaf-zarr-chunk"])
    moved = fifo.with_name("elsewhere")
    fifo.rename(moved)
    fifo.symlink_to(moved.name)
    outcome = _inspect(root)
    assert not outcome.timed_out
    assert "EXIT 1" in outcome.stdout and "named pipe (FIFO)" in outcome.stderr, outcome.stderr[-2000:]


def test_fifo_safetensors_shard_of_a_hugging_face_folder_is_refused(tmp_path):
    """The shard a Hugging Face folder's index names, as a FIFO: the walk refuses the pipe."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt_neox"}')
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model-00001.safetensors"}}')
    os.mkfifo(folder / "model-00001.safetensors")
    outcome = _inspect(folder)
    assert not outcome.timed_out
    assert "EXIT 1" in outcome.stdout and "named pipe (FIFO)" in outcome.stderr, outcome.stderr[-2000:]


def test_open_regular_never_blocks_on_a_fifo_swapped_in(tmp_path):
    """The shared helper itself: a FIFO is refused from its ``stat``; opened anyway (the race of
    a swap after the check) it is refused from the open descriptor, which ``O_NONBLOCK`` keeps
    from waiting for a writer."""
    from ckptshim.errors import UnsafeCheckpointError
    from ckptshim.formats.base import open_regular

    fifo = tmp_path / "chunk"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeCheckpointError, match="named pipe"):
        open_regular(fifo)
    regular = tmp_path / "file"
    regular.write_bytes(b"abc")
    with open_regular(regular) as raw:
        assert raw.read() == b"abc"
