"""Every layout the hooked framework's reader accepts is recognised by ckptshim first.

torch 2.13's ``FileSystemReader`` reads ``.metadata``, and when that fails (absent, or not a
readable file) the rank-local ``__<rank>.metadata`` that ``dcp.save(use_collectives=False)``
writes -- both with ``pickle.load``. A folder ckptshim did not recognise went straight to that
reader. DeepSpeed's ``load_state_dir`` loads every ``layer_<ii>-*model_states.pt`` with
``torch.load(weights_only=False)`` (see test_fallback_exec.py for a name ckptshim did not know).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import ckptshim  # noqa: E402
from ckptshim.cli import main  # noqa: E402
from ckptshim.errors import UnsafeCheckpointError  # noqa: E402
from ckptshim.formats import detect  # noqa: E402
from hostile import Mkdir, read_dcp_metadata, refusal, write_dcp_metadata  # noqa: E402
from support.native import natively, raised, same_error  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True)
def _hooks_on():
    ckptshim.install()
    yield


STATE = {"w": torch.arange(8.0).reshape(2, 4), "b": torch.ones(3, dtype=torch.float64)}


def _rank_local(folder: Path, state: dict = STATE) -> Path:
    """What ``dcp.save(use_collectives=False)`` writes: ``__0.metadata`` and ``__0_0.distcp``."""
    dcp.save(state, checkpoint_id=folder, no_dist=True, use_collectives=False)
    assert sorted(p.name for p in folder.iterdir()) == ["__0.metadata", "__0_0.distcp"]
    return folder


def _load(folder: Path) -> dict:
    out = {"w": torch.zeros(2, 4), "b": torch.zeros(3, dtype=torch.float64)}
    dcp.load(out, checkpoint_id=folder, no_dist=True)
    return out


def test_rank_local_checkpoint_is_recognised_and_loads(tmp_path, capsys):
    """The control: a clean rank-local save inspects as DCP and loads bit-exactly through the hook."""
    folder = _rank_local(tmp_path / "ckpt")
    assert detect.detect(folder, backend="torch").NAME == "torch-dcp"
    assert main(["inspect", str(folder)]) == 0
    assert "torch-dcp" in capsys.readouterr().out
    out = _load(folder)
    assert all(torch.equal(out[k], STATE[k]) for k in STATE)


def test_rank_local_metadata_that_runs_code_is_refused(tmp_path):
    """Before: ckptshim did not recognise the folder, so ``dcp.load`` handed it to DCP's reader,
    which unpickled ``__0.metadata``; ``ckptshim inspect`` said only 'not a format ckptshim knows'."""
    folder, marker = _rank_local(tmp_path / "ckpt"), tmp_path / "PWNED"
    metadata = read_dcp_metadata(folder, "__0.metadata")
    metadata.planner_data = Mkdir(marker)
    write_dcp_metadata(folder, metadata, "__0.metadata")
    with pytest.raises(BaseException) as info:
        _load(folder)
    assert refusal(info.value) is not None, f"not a ckptshim refusal: {info.value!r}"
    assert not marker.exists(), "DCP's own reader unpickled the metadata"
    assert "posix.mkdir" in str(refusal(info.value)) and "__0.metadata" in str(refusal(info.value))
    with pytest.raises(UnsafeCheckpointError, match="__0.metadata needs posix.mkdir"):
        detect.open_checkpoint(folder)


def test_metadata_that_is_no_file_does_not_reach_the_rank_local_fallback(tmp_path):
    """A ``.metadata`` folder beside a hostile ``__0.metadata``: DCP's reader fails on the first
    and unpickles the second. ckptshim refuses the folder instead of passing it on."""
    folder, marker = _rank_local(tmp_path / "ckpt"), tmp_path / "PWNED"
    metadata = read_dcp_metadata(folder, "__0.metadata")
    metadata.planner_data = Mkdir(marker)
    write_dcp_metadata(folder, metadata, "__0.metadata")
    (folder / ".metadata").mkdir()
    with pytest.raises(BaseException) as info:
        _load(folder)
    assert refusal(info.value) is not None and ".metadata is not a file" in str(refusal(info.value))
    assert not marker.exists()


def test_ranks_metadata_files_read_as_their_union(tmp_path):
    """Two ranks' rank-local saves in one folder (rank 1's files renamed as a second process
    writes them): inspect lists both ranks' tensors, a replicated one once, every rank file's
    metadata read safely. A load reads what DCP's own reader reads for its rank -- rank 0's
    ``__0.metadata``, through ckptshim's unpickler -- so what only rank 1 saved is DCP's own
    "missing key", as without ckptshim."""
    folder = _rank_local(tmp_path / "ckpt", {"w": STATE["w"], "shared": torch.ones(2)})
    other = _rank_local(tmp_path / "rank1", {"b": STATE["b"], "shared": torch.ones(2)})
    metadata = read_dcp_metadata(other, "__0.metadata")
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = type(info)("__1_0.distcp", info.offset, info.length)
    write_dcp_metadata(folder, metadata, "__1.metadata")
    shutil.copy(other / "__0_0.distcp", folder / "__1_0.distcp")
    checkpoint = detect.open_checkpoint(folder)
    assert checkpoint.complete, checkpoint.all_problems()
    assert sorted(".".join(k) for k in checkpoint.inventory) == ["b", "shared", "w"]
    out = {"w": torch.zeros(2, 4), "shared": torch.zeros(2)}
    dcp.load(out, checkpoint_id=folder, no_dist=True)
    assert torch.equal(out["w"], STATE["w"]) and torch.equal(out["shared"], torch.ones(2))

    def load_b() -> None:
        dcp.load({"b": torch.zeros(3, dtype=torch.float64)}, checkpoint_id=folder, no_dist=True)
    error = same_error(raised(load_b), raised(lambda: natively(load_b)))
    assert "Missing key in checkpoint state_dict: b" in str(error)


def test_remote_url_checkpoint_id_is_dcps_own_call():
    """DCP reads any other scheme with its FsspecReader; ckptshim does not read object storage
    yet, so the load is DCP's own call, as without ckptshim (its error, here: no s3fs)."""
    out = {"w": torch.zeros(2, 4)}
    load = lambda: dcp.load(out, checkpoint_id="s3://bucket/ckpt", no_dist=True)  # noqa: E731
    same_error(raised(load), raised(lambda: natively(load)))
    assert not out["w"].any()


def test_file_url_checkpoint_id_is_not_handed_to_dcps_reader(tmp_path):
    pytest.importorskip("fsspec")
    folder, marker = _rank_local(tmp_path / "ckpt"), tmp_path / "PWNED"
    metadata = read_dcp_metadata(folder, "__0.metadata")
    metadata.planner_data = Mkdir(marker)
    write_dcp_metadata(folder, metadata, "__0.metadata")
    out = {"w": torch.zeros(2, 4), "b": torch.zeros(3, dtype=torch.float64)}
    with pytest.raises(BaseException):
        dcp.load(out, checkpoint_id=f"file://{folder}", no_dist=True)
    assert not marker.exists()
