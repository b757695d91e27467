"""``ckptshim convert``: bit-exact round trips, SRC never touched, DST all or nothing.

A convert killed mid-way (SIGKILL after its first array) leaves no DST, and the next convert
to the same DST removes the dead one's temporary folder before writing its own.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ckptshim.cli import main
from ckptshim.formats.detect import open_checkpoint
from support.fixtures import FIXTURES, array_sha256
from support.processes import on_a_terminal

DCP = FIXTURES / "torch_dcp_single" / "dcp_plain"
ORBAX = FIXTURES / "orbax_0.12.8_scanned"


def hashes(path: Path) -> dict[tuple[str, ...], tuple[tuple[int, ...], str, str]]:
    """Key path -> (shape, dtype, sha256 of the bytes) for every array a checkpoint holds."""
    checkpoint = open_checkpoint(path)
    try:
        return {e.key: (e.shape, e.dtype, array_sha256(checkpoint.read(e)))
                for e in checkpoint.inventory.values()}
    finally:
        checkpoint.close()


def tree_state(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root`` with its size, mtime and content hash (to prove it is untouched)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(destination: Path) -> list[str]:
    return sorted(p.name for p in destination.parent.iterdir() if ".ckptshim-tmp-" in p.name)


def test_dcp_to_safetensors_to_dcp_is_bit_exact(tmp_path):
    before = tree_state(DCP)
    original = hashes(DCP)
    st = tmp_path / "model.safetensors"
    assert main(["convert", str(DCP), str(st), "--to", "safetensors"]) == 0
    assert hashes(st) == original
    safetensors_numpy = pytest.importorskip("safetensors.numpy")  # an independent reader agrees
    loaded = safetensors_numpy.load_file(str(st))
    assert {k: (tuple(v.shape), array_sha256(v)) for k, v in loaded.items()} == \
        {".".join(k): (shape, sha) for k, (shape, _, sha) in original.items()}
    back = tmp_path / "dcp_again"
    assert main(["convert", str(st), str(back), "--to", "dcp"]) == 0
    assert hashes(back) == original
    assert tree_state(DCP) == before and leftovers(st) == []


def test_dcp_output_loads_with_torch_own_reader(tmp_path):
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import ckptshim

    out = tmp_path / "dcp"
    assert main(["convert", str(DCP), str(out), "--to", "dcp"]) == 0
    reference = torch.load(FIXTURES / "torch_dcp_single" / "torch_save" / "model.pt", weights_only=True)
    state_dict = {"model": {k: torch.zeros_like(v) for k, v in reference.items()}}
    ckptshim.uninstall()
    try:
        dcp.load(state_dict, checkpoint_id=out, no_dist=True)
    finally:
        ckptshim.install()
    for key, value in reference.items():
        assert torch.equal(state_dict["model"][key], value), key


def test_unscanned_orbax_converts_into_the_scanned_layout(tmp_path):
    pytest.importorskip("tensorstore")
    like = ORBAX / "standard_checkpointer_scanned"
    out = tmp_path / "scanned.safetensors"
    source = ORBAX / "standard_checkpointer_unscanned"
    before = tree_state(source)
    assert main(["convert", str(source), str(out), "--to", "safetensors", "--like", str(like)]) == 0
    assert hashes(out) == hashes(like)
    assert tree_state(source) == before


def test_orbax_output_scanned_like_target_restores_natively(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    import ckptshim

    like = ORBAX / "standard_checkpointer_scanned"
    out = tmp_path / "scanned_orbax"
    assert main(["convert", str(ORBAX / "standard_checkpointer_unscanned"), str(out), "--to", "orbax",
                 "--like", str(like)]) == 0
    assert hashes(out) == hashes(like) and leftovers(out) == []
    ckptshim.uninstall()  # today's Orbax reads it with no help
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(out)
    finally:
        ckptshim.install()
    kernel = restored["params"]["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
    assert array_sha256(np.asarray(kernel)) == hashes(like)[("params", "decoder", "layers", "mlp", "wi_0", "kernel")][2]


def test_existing_destination_needs_force(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["convert", str(DCP), str(out), "--to", "dcp"]) == 1
    assert "--force" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(["convert", str(DCP), str(out), "--to", "dcp", "--force"]) == 0
    assert not (out / "keep.txt").exists() and hashes(out) == hashes(DCP)
    assert leftovers(out) == []


def test_refusals_write_nothing(tmp_path, capsys):
    assert main(["convert", str(DCP), str(tmp_path / "x"), "--to", "pickle"]) == 2  # usage
    assert main(["convert", str(DCP), str(tmp_path / "x")]) == 2                     # no --to
    assert main(["convert", str(DCP), str(DCP / "inside"), "--to", "dcp"]) == 1     # into SRC
    assert "overlaps the source" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "absent"), str(tmp_path / "y"), "--to", "dcp"]) == 1
    truncated = tmp_path / "bad.safetensors"
    data = (FIXTURES / "hf_gptneox_tf4.30.2/safetensors/model.safetensors").read_bytes()
    truncated.write_bytes(data[:-1000])
    assert main(["convert", str(truncated), str(tmp_path / "z"), "--to", "dcp"]) == 1
    assert "incomplete" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]


KILLER = """
import os, signal, sys
from ckptshim.conversion import convert
def die(key):
    print("wrote", key, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
convert(sys.argv[1], sys.argv[2], sys.argv[3], on_array=die)
"""


@pytest.mark.parametrize(("to", "name"), [("safetensors", "out.safetensors"), ("dcp", "out_dcp"),
                                          ("orbax", "out_orbax")])
def test_killed_convert_leaves_no_destination(tmp_path, to, name):
    out = tmp_path / name
    killed = subprocess.run([sys.executable, "-c", KILLER, str(DCP), str(out), to],
                            capture_output=True, text=True, check=False, timeout=120)
    assert killed.returncode == -signal.SIGKILL and "wrote" in killed.stdout, killed.stderr
    assert not out.exists()
    assert len(leftovers(out)) == 1  # the dead writer's folder, until the next run
    assert main(["convert", str(DCP), str(out), "--to", to]) == 0
    assert leftovers(out) == [] and hashes(out) == hashes(DCP)


def test_a_live_writers_folder_is_left_alone(tmp_path):
    from ckptshim.conversion.atomic import clean_stale, temp_name

    out = tmp_path / "out.safetensors"
    live = temp_name(out, os.getppid())  # the process running pytest's parent: alive
    live.mkdir()
    dead = temp_name(out, 2**22 + 12345)
    dead.mkdir()
    assert clean_stale(out) == [dead] and live.exists()


def test_python_api_is_lazy_and_returns_the_path(tmp_path):
    import ckptshim

    out = ckptshim.convert(DCP, tmp_path / "m.safetensors", "safetensors", progress=False)
    assert out == (tmp_path / "m.safetensors").resolve()
    assert np.isclose(sum(e.nbytes for e in open_checkpoint(out).inventory.values()),
                      open_checkpoint(DCP).inventory.total_bytes)


TARGETS = ("safetensors", "dcp", "orbax")


def test_no_progress_bar_when_stderr_is_no_terminal_and_every_array_reported(tmp_path, capsys):
    from ckptshim.conversion import convert

    expected = sorted(".".join(key) for key in hashes(DCP))
    for to in TARGETS:  # pytest's captured stderr is no terminal
        reported: list[str] = []
        convert(DCP, tmp_path / to, to, on_array=reported.append)
        assert "%|" not in capsys.readouterr().err, to
        assert sorted(reported) == expected, to  # each array once, as it is written
    import ckptshim

    ckptshim.convert(DCP, tmp_path / "asked", "safetensors", progress=True)
    assert "100%|" in capsys.readouterr().err


ON_A_TERMINAL = """
import os, sys
from ckptshim.cli import main
source, out = sys.argv[1], sys.argv[2]
for to in sys.argv[3:]:
    print("== " + to, file=sys.stderr, flush=True)
    assert main(["convert", source, os.path.join(out, to), "--to", to]) == 0
os.environ["CKPTSHIM_PROGRESS"] = "0"
print("== switched off", file=sys.stderr, flush=True)
assert main(["convert", source, os.path.join(out, "off"), "--to", "safetensors"]) == 0
"""


def test_progress_bar_on_a_terminal_for_every_target(tmp_path):
    """stderr on a pseudo-terminal: each target format shows a bar that reaches 100%, array by
    array (as many updates as arrays at most); CKPTSHIM_PROGRESS=0 hides it on a terminal too."""
    shown = on_a_terminal(["-c", ON_A_TERMINAL, str(DCP), str(tmp_path), *TARGETS],
                          {**os.environ, "JAX_PLATFORMS": "cpu"}, columns=80, timeout=120)
    sections = dict(part.split("\n", 1) for part in shown.split("== ")[1:])
    for to in TARGETS:
        assert "100%|" in sections[to] and sections[to].count("%|") >= 2, (to, sections[to])
    assert "%|" not in sections["switched off"]
    assert all(hashes(tmp_path / to) == hashes(DCP) for to in TARGETS)
