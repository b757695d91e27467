"""``ckptshim run``: legacy scripts that never import ckptshim get the hooks in every process.

The scripts are written into ``tmp_path`` and run through ``python -m ckptshim run -- ...``: a
two-rank torchrun launch loading a plain DCP checkpoint into compiled models (the one slow test),
an Orbax restore of an unscanned checkpoint into a scanned target, an environment whose own
``sitecustomize`` must still run, the switches reaching the child, and the child's exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.fixtures import FIXTURES, copy_fixture

REPO = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without CKPTSHIM_* switches, ckptshim importable, JAX on the CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSHIM_")}
    env.pop("PYTHONPATH", None)
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def shim_run(*command: str, env: dict[str, str] | None = None, cwd: Path | None = None,
             options: tuple[str, ...] = (), timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptshim", "run", *options, "--", *command],
                          capture_output=True, text=True, env=env or clean_env(), cwd=cwd,
                          timeout=timeout, check=False)


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


TORCHRUN_SCRIPT = """
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from dcp_tiny_model import TinyLM   # the model's code, beside the script

    assert "ckptshim" in sys.modules, "the bootstrap sitecustomize did not run in this worker"
    dist.init_process_group("gloo")
    model = torch.compile(TinyLM())           # keys are now "_orig_mod.layers.0..."
    state_dict = model.state_dict()
    dcp.load({{"model": state_dict}}, checkpoint_id={checkpoint!r})
    reference = torch.load({reference!r}, weights_only=True)
    for key, value in reference.items():
        assert torch.equal(state_dict["_orig_mod." + key], value), key
    print(f"rank {{dist.get_rank()}} loaded {{len(reference)}} tensors", flush=True)
    dist.destroy_process_group()
"""


def test_torchrun_workers_load_dcp_into_compiled_models(tmp_path):
    pytest.importorskip("torch")
    fixture = FIXTURES / "torch_dcp_single"
    copy_fixture("torch_dcp_single/dcp_tiny_model.py", tmp_path)
    path = script(tmp_path, "train.py", TORCHRUN_SCRIPT.format(
        checkpoint=str(fixture / "dcp_plain"),
        reference=str(fixture / "torch_save" / "model.pt")))
    result = shim_run(sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node=2", str(path), options=("--log", "info"), cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 loaded" in result.stdout and "rank 1 loaded" in result.stdout
    for rank in (0, 1):  # --log info: every rank says what it did, prefixed with its rank
        assert f"ckptshim: rank {rank}: torch.distributed.checkpoint.load: 26 renamed" in result.stderr


ORBAX_SCRIPT = """
    import jax, numpy as np
    import orbax.checkpoint as ocp

    layers = 4
    rng = np.random.default_rng(0)
    unscanned = {{"params": {{"decoder": {{f"layers_{{i}}": {{"mlp": {{"wi": {{"kernel": rng.standard_normal((8, 16), np.float32)}}}}}}
                                        for i in range(layers)}}}}}}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save({path!r}, unscanned)
    scanned = {{"params": {{"decoder": {{"layers": {{"mlp": {{"wi": {{"kernel": jax.ShapeDtypeStruct((8, layers, 16), np.float32)}}}}}}}}}}}}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore({path!r}, scanned)
    got = np.asarray(restored["params"]["decoder"]["layers"]["mlp"]["wi"]["kernel"])
    want = np.stack([unscanned["params"]["decoder"][f"layers_{{i}}"]["mlp"]["wi"]["kernel"] for i in range(layers)], axis=1)
    assert got.tobytes() == want.tobytes()
    print("restored scanned", got.shape)
"""


def test_orbax_scan_mismatch_in_unedited_script(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    path = script(tmp_path, "restore.py", ORBAX_SCRIPT.format(path=str(tmp_path / "ckpt")))
    result = shim_run(sys.executable, str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "restored scanned (8, 4, 16)" in result.stdout


PROBE = ("import sys, os; import ckptshim.hooks.registry as r; "
         "print('shim' if 'ckptshim' in sys.modules else 'noshim'); "
         "print('site', getattr(sys.modules.get('sitecustomize'), 'MARKER', None)); "
         "print('states', r.states()); print('path', os.environ['PYTHONPATH']); import builtins; "
         "print('their sitecustomize ran', getattr(builtins, 'their_site_runs', 0), 'time(s)')")


def test_existing_sitecustomize_still_runs_once(tmp_path):
    own = tmp_path / "own_site"
    own.mkdir()
    (own / "sitecustomize.py").write_text(
        "import builtins\nMARKER = 'theirs'\n"
        "builtins.their_site_runs = getattr(builtins, 'their_site_runs', 0) + 1\n")
    env = clean_env(PYTHONPATH=str(own))
    result = shim_run(sys.executable, "-c", PROBE, env=env)
    assert result.returncode == 0, result.stderr
    assert "their sitecustomize ran 1 time(s)" in result.stdout
    assert "shim\n" in result.stdout and "site theirs" in result.stdout
    # nested launches neither repeat the bootstrap folder on PYTHONPATH nor run anything twice
    nested = shim_run(sys.executable, "-m", "ckptshim", "run", "--", sys.executable, "-c", PROBE, env=env)
    assert nested.returncode == 0, nested.stderr
    assert "their sitecustomize ran 1 time(s)" in nested.stdout
    path_line = next(line for line in nested.stdout.splitlines() if line.startswith("path "))
    assert path_line.count("bootstrap") == 1 and str(own) in path_line


def test_switches_reach_the_child(tmp_path):
    result = shim_run(sys.executable, "-c", PROBE + "; print('strict', os.environ.get('CKPTSHIM_STRICT'), "
                      "os.environ.get('CKPTSHIM_LOG'))",
                      options=("--disable-hooks", "orbax,flax", "--strict", "--log", "debug"))
    assert result.returncode == 0, result.stderr
    assert "'orbax': 'disabled by CKPTSHIM_DISABLE_HOOKS'" in result.stdout
    assert "'flax': 'disabled by CKPTSHIM_DISABLE_HOOKS'" in result.stdout
    assert "'torch': 'waiting for `import torch`'" in result.stdout
    assert "strict 1 debug" in result.stdout


def test_exit_code_and_usage_errors(tmp_path):
    assert shim_run(sys.executable, "-c", "import sys; sys.exit(7)").returncode == 7
    missing = shim_run("no-such-command-ckptshim")
    assert missing.returncode == 2 and "not found" in missing.stderr
    bare = subprocess.run([sys.executable, "-m", "ckptshim", "run"], capture_output=True, text=True,
                          env=clean_env(), check=False)
    assert bare.returncode == 2 and "after `--`" in bare.stderr
    typo = shim_run(sys.executable, "-c", "pass", options=("--disable-hooks", "orbx"))
    assert typo.returncode == 2 and "no hook named orbx" in typo.stderr


def test_broken_bootstrap_import_never_stops_the_child(tmp_path):
    """A child Python that cannot import ckptshim still starts, with a warning."""
    env = clean_env(CKPTSHIM_BOOTSTRAP_HOME=str(tmp_path))
    env["PYTHONPATH"] = str(REPO / "ckptshim" / "launcher" / "bootstrap")
    result = subprocess.run([sys.executable, "-I", "-c", "print('started')"], capture_output=True,
                            text=True, env=env, check=False)  # -I: no PYTHONPATH, the plain case
    assert result.returncode == 0 and "started" in result.stdout


def test_enable_and_disable_venv(tmp_path, capsys):
    from ckptshim import venv
    from ckptshim.cli import main

    site = tmp_path / "site-packages"
    site.mkdir()
    assert main(["enable-venv", "--site-packages", str(site)]) == 0
    pth = site / "ckptshim.pth"
    assert pth.read_text() == venv.PTH_TEXT and [p.name for p in site.iterdir()] == ["ckptshim.pth"]
    assert main(["enable-venv", "--site-packages", str(site)]) == 0  # idempotent
    # the file does what it says: site executes it and the interpreter imports ckptshim
    probe = subprocess.run([sys.executable, "-c", f"import site, sys; site.addsitedir({str(site)!r}); "
                            "print('ckptshim' in sys.modules)"], capture_output=True, text=True,
                           env=clean_env(), check=False)
    assert probe.stdout.strip() == "True", probe.stderr
    assert main(["disable-venv", "--site-packages", str(site)]) == 0 and not pth.exists()
    assert main(["disable-venv", "--site-packages", str(site)]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_venv_file_written_by_someone_else_is_left_alone(tmp_path, capsys):
    from ckptshim.cli import main

    (tmp_path / "ckptshim.pth").write_text("import something_else\n")
    assert main(["disable-venv", "--site-packages", str(tmp_path)]) == 1
    assert main(["enable-venv", "--site-packages", str(tmp_path)]) == 1
    assert (tmp_path / "ckptshim.pth").read_text() == "import something_else\n"
    assert "not written by ckptshim" in capsys.readouterr().err


def test_enable_venv_refuses_a_system_python(monkeypatch, capsys):
    from ckptshim.cli import main

    monkeypatch.setattr(sys, "base_prefix", sys.prefix)  # as if this were not a venv
    assert main(["enable-venv"]) == 1
    assert "--force" in capsys.readouterr().err
