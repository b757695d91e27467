"""DCP folders whose ``.metadata`` lies about its chunks, or attacks its unpickler.

Each folder is laid out as ``FileSystemWriter`` lays one out, with ``.metadata`` built from
torch's own metadata classes (``hostile.write_sharded_dcp``), so only the lie differs from a
real sharded save.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckptshim  # noqa: E402
from ckptshim.cli import main  # noqa: E402
from ckptshim.errors import CorruptCheckpointError  # noqa: E402
from ckptshim.formats import dcp as dcp_format  # noqa: E402
from ckptshim.formats import detect  # noqa: E402
from hostile import confined, read_dcp_metadata, refusal, write_sharded_dcp  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
FULL = torch.arange(16.0).reshape(4, 4)


@pytest.fixture(autouse=True)
def _hooks_on():
    ckptshim.install()
    yield


def _folder(tmp_path: Path, chunks) -> Path:
    folder = tmp_path / "ckpt"
    write_sharded_dcp(folder, {"w": FULL}, {"w": chunks})
    return folder


def test_control_row_shards_read_exactly(tmp_path):
    folder = _folder(tmp_path, [((0, 0), (2, 4)), ((2, 0), (2, 4))])
    checkpoint = detect.open_checkpoint(folder)
    assert checkpoint.complete
    assert np.array_equal(checkpoint.read(checkpoint.inventory[("w",)]), FULL.numpy())
    out = {"w": torch.zeros(4, 4)}
    dcp.load(out, checkpoint_id=folder, no_dist=True)
    assert torch.equal(out["w"], FULL)


@pytest.mark.parametrize("chunks, problem", [
    pytest.param([((0, 0), (2, 4)), ((1, 0), (2, 4))], "overlap", id="overlapping-rows-counts-add-up"),
    pytest.param([((0, 0), (4, 2)), ((0, 1), (4, 2))], "overlap", id="overlapping-columns"),
    pytest.param([((0, 0), (2, 4))], "hold 8 of 16", id="missing-rows"),
])
def test_chunks_that_do_not_tile_the_tensor(tmp_path, chunks, problem, capsys):
    """Two chunks of 8 elements each over a 16-element tensor, overlapping on row 1 and leaving
    row 3 unwritten: the element counts add up, so the coverage check passed and ``convert``
    wrote uninitialised heap memory for row 3."""
    folder = _folder(tmp_path, chunks)
    checkpoint = detect.open_checkpoint(folder)
    assert not checkpoint.complete and any(problem in p for p in checkpoint.all_problems())
    with pytest.raises(CorruptCheckpointError, match=problem):
        checkpoint.read(checkpoint.inventory[("w",)])
    assert main(["convert", str(folder), str(tmp_path / "out.safetensors"), "--to", "safetensors"]) == 1
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()
    out = {"w": torch.full((4, 4), 7.0)}
    with pytest.raises(BaseException) as info:
        dcp.load(out, checkpoint_id=folder, no_dist=True)
    assert refusal(info.value) is not None and torch.equal(out["w"], torch.full((4, 4), 7.0))


def test_many_column_shards_are_checked_quickly(tmp_path):
    """The overlap check sweeps along the axis the chunks split: 2,000 column shards take no
    more than a moment (a pairwise check would take 4 million comparisons)."""
    import time

    chunks = [dcp_format.Chunk((0, i), (4, 1)) for i in range(2000)]
    start = time.perf_counter()
    assert dcp_format._first_overlap(chunks) is None
    assert time.perf_counter() - start < 1
    assert dcp_format._first_overlap(chunks + [dcp_format.Chunk((3, 1999), (1, 1))]) is not None


def _metadata_pickle(tmp_path: Path, body: bytes) -> Path:
    """The control's folder whose ``.metadata`` (pickled by ``pickle.dump``, protocol 4, as DCP
    writes it) also builds ``body`` after the metadata object and pops it again (``POP``)."""
    folder = _folder(tmp_path, [((0, 0), (4, 4))])
    raw = pickle.dumps(read_dcp_metadata(folder), protocol=4)
    assert raw.endswith(b"b.")
    (folder / ".metadata").write_bytes(raw[:-1] + body + b"0.")
    return folder


def _peak_opening(folder: Path):
    """Open ``folder`` with ckptshim in a confined interpreter (1 GiB): what it lists, and its peak."""
    return confined(f"""
        from pathlib import Path
        from ckptshim.formats import detect
        checkpoint = detect.open_checkpoint(Path({str(folder)!r}))
        print("OPENED", sorted(".".join(k) for k in checkpoint.inventory))
        """, memory_mb=1024, seconds=60)


def test_metadata_memo_index_in_the_billions(tmp_path):
    """One ``LONG_BINPUT 775000000`` in ``.metadata``: the C unpickler zeroed about 12 GiB. Opening
    it costs what opening the same folder without it costs (torch's import is most of both)."""
    control = _peak_opening(_folder(tmp_path / "control", [((0, 0), (4, 4))]))
    body = b"}" + b"r" + (775_000_000).to_bytes(4, "little")  # an empty dict, memoised far away
    outcome = _peak_opening(_metadata_pickle(tmp_path, body))
    for run in (control, outcome):
        assert run.returncode == 0 and "OPENED ['w']" in run.stdout, run.stderr[-2000:]
    assert outcome.peak_rss_mb < control.peak_rss_mb + 32, (outcome.peak_rss_mb, control.peak_rss_mb)
