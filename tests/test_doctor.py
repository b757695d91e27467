"""``ckptshim doctor``: versions from metadata, each hook's state and the reason, never a framework import."""

from __future__ import annotations

import json
import subprocess
import sys

from ckptshim import doctor
from ckptshim.cli import main
from ckptshim.hooks import registry


def test_doctor_json_lists_versions_and_every_hook(capsys, monkeypatch):
    monkeypatch.delenv("CKPTSHIM_DISABLE", raising=False)
    monkeypatch.setenv("CKPTSHIM_DISABLE_HOOKS", "flax")
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["torch"].startswith("2.") and "jax" in info["versions"]
    hooks = {h["name"]: h for h in info["hooks"]}
    assert set(hooks) == {spec.name for spec in registry.HOOKS}
    assert hooks["flax"]["status"] == "disabled" and "CKPTSHIM_DISABLE_HOOKS" in hooks["flax"]["why"]
    assert hooks["torch"]["supported"] == ">=2.4,<3"
    assert hooks["torch"]["status"] in {"ready", "active"}
    assert info["environment"] == {"CKPTSHIM_DISABLE_HOOKS": "flax"}


def test_gated_and_absent_hooks_say_why(monkeypatch):
    monkeypatch.delenv("CKPTSHIM_DISABLE_HOOKS", raising=False)
    monkeypatch.delenv("CKPTSHIM_DISABLE", raising=False)
    monkeypatch.setattr(registry, "HOOKS", (
        registry.HookSpec("old-torch", "torch", "x", "torch", ("1.0", "1.5")),
        registry.HookSpec("nothing", "nothing_here", "x", "no-such-distribution-ckptshim", ("0", "1"))))
    gated, absent = doctor.hook_reports()
    assert gated.status == "gated" and "outside >=1.0,<1.5" in gated.why and gated.found
    assert absent.status == "absent" and absent.found is None and "not installed" in absent.why


def test_disable_everything_is_reported(monkeypatch):
    monkeypatch.setenv("CKPTSHIM_DISABLE", "1")
    assert {r.status for r in doctor.hook_reports()} == {"disabled"}


def test_doctor_imports_no_framework():
    code = ("import sys; from ckptshim.cli import main; main(['doctor']); "
            "heavy = [m for m in ('torch', 'jax', 'orbax', 'flax', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "hooks:" in result.stdout and "torch" in result.stdout
