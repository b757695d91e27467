"""``ckptshim doctor``: what this environment has (ckptshim's own version first), and what each
hook will do in it and why.

Nothing here imports a framework: versions come from the installed distributions' metadata
(``importlib.metadata``), and each hook's fate is worked out the way the registry decides it
(environment switches first, then the framework's version against the hook's supported range).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ckptshim import config
from ckptshim.hooks import registry

#: Distributions worth reporting besides the hooks' own frameworks.
DISTRIBUTIONS = ("numpy", "torch", "safetensors", "transformers", "jax", "jaxlib", "flax",
                 "orbax-checkpoint", "tensorstore", "t5x", "paxml", "deepspeed", "tqdm")


@dataclass(frozen=True)
class HookReport:
    name: str
    trigger: str
    distribution: str
    supported: str
    found: str | None
    status: str  # "active", "ready", "gated", "disabled", "absent", "failed"
    why: str


def versions() -> dict[str, str | None]:
    """Distribution name -> installed version (``None`` when not installed)."""
    names = dict.fromkeys([*DISTRIBUTIONS, *(spec.distribution for spec in registry.HOOKS)])
    return {name: registry.installed_version(name) for name in names}


def hook_reports() -> list[HookReport]:
    """One report per :data:`registry.HOOKS` entry, in attach order."""
    states = registry.states()
    reports = []
    for spec in registry.HOOKS:
        found = registry.installed_version(spec.distribution)
        low, high = spec.supported
        state = states.get(spec.name, "")
        if config.disabled():
            status, why = "disabled", "CKPTSHIM_DISABLE is set"
        elif spec.name in config.disabled_hooks():
            status, why = "disabled", "named in CKPTSHIM_DISABLE_HOOKS"
        elif found is None:
            status, why = "absent", f"{spec.distribution} is not installed"
        elif not registry.supports_version(found, spec.supported):
            status, why = "gated", f"{spec.distribution} {found} is outside >={low},<{high}"
        elif state.startswith("active"):
            status, why = "active", "attached in this process"
        elif state.startswith("failed"):
            status, why = "failed", state
        else:
            status, why = "ready", f"attaches on `import {spec.trigger}`"
        reports.append(HookReport(spec.name, spec.trigger, spec.distribution, f">={low},<{high}",
                                  found, status, why))
    return reports


def switches() -> dict[str, str]:
    """The CKPTSHIM_* variables set in this environment."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("CKPTSHIM_")}


def report() -> dict:
    """Everything ``doctor`` prints, JSON-ready."""
    from ckptshim.venv import pth_file

    import ckptshim

    pth = pth_file()
    return {
        "ckptshim": {"version": ckptshim.__version__, "location": str(Path(ckptshim.__file__).parent)},
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "versions": versions(),
        "hooks": [asdict(r) for r in hook_reports()],
        "environment": switches(),
        "venv_pth": {"path": str(pth) if pth else None, "present": bool(pth and pth.exists())},
    }
