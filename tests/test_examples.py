"""Every script in examples/ runs to completion and prints what it claims, so the examples never rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))

#: Lines (stdout and stderr together) an example must print beyond running to completion.
MUST_PRINT = {
    "legacy_launch_script.py": ["without ckptshim: exit 1", "with ckptshim run: exit 0: resumed",
                                "ckptshim: load_state_dict(OptimizedModule): 4 renamed"],
    "maxtext_scan_orbax.py": ["ckptshim: orbax StandardCheckpointer.restore(", "unscanned -> scanned, bit-exact",
                              "scanned -> unscanned, bit-exact", "8 stacked (axis 1)"],
    "paxml_to_maxtext.py": ["without ckptshim: Metadata file (named _METADATA) does not exist",
                            "9 split (axes 1; perm 1,0,2,3)", "combined_qkv[:, 1], 0, 1), bit-exact"],
    "pythia_neox_buffers.py": ["legacy buffers dropped, every weight loaded",
                               "missing inv_freq kept at the module's own computed value"],
    "t5x_legacy_orbax.py": ["without ckptshim: Metadata file (named _METADATA) does not exist",
                            "read by ckptshim as t5x (legacy msgpack v3)", "bit-exact with the Orbax-era step",
                            "today's Orbax alone restores the converted step, bit-exact"],
    "torch_compile_dcp.py": ["ckptshim: torch.distributed.checkpoint.load: 4 renamed",
                             "with ckptshim: 4 tensors loaded into the compiled model"],
}


def check_demo(out: str) -> None:
    """The showcase: for every story the native error without the shim, its summary with it."""
    stories = out.count("\n[")
    assert stories >= 8 and out.count("without ckptshim: ") == stories
    assert "without ckptshim: loads" not in out  # each story shows a real native failure
    assert out.count("with ckptshim:    ") == stories
    assert "loaded, nothing to change" not in out  # each story's summary says what the shim did
    assert f"{stories} of {stories} stories load with ckptshim." in out


@pytest.mark.timeout(900)  # the run itself is bounded at 600 s
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path) -> None:
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=600, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "FAILED" not in out
    if script.name == "demo.py":
        check_demo(result.stdout)
    for line in MUST_PRINT.get(script.name, ()):
        assert line in out, (line, out)


def _installs(distribution: str, extras: frozenset[str] = frozenset(), seen: set[str] | None = None) -> set[str]:
    """``distribution`` with ``extras`` and everything that pulls in, by installed metadata."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen = set() if seen is None else seen
    name = canonicalize_name(distribution)
    if (name, extras) in seen:
        return set()
    seen.add((name, extras))
    found = {name}
    try:
        requirements = [Requirement(text) for text in requires(distribution) or []]
    except PackageNotFoundError:  # an optional dependency of a dependency, not installed here
        return found
    for requirement in requirements:
        wanted = requirement.marker is None or any(
            requirement.marker.evaluate({"extra": extra}) for extra in extras or {""})
        if wanted:
            found |= _installs(requirement.name, frozenset(requirement.extras), seen)
    return found


def test_the_demo_extra_holds_what_the_demo_imports():
    """`make demo` installs ckptshim[demo] alone into its own venv: every framework the demo (and
    the example modules and legacy script it runs) imports must come with that extra."""
    import ast
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    here = Path(__file__).parent.parent / "examples"
    scripts = [here / "demo.py", here / "paxml_to_maxtext.py", here / "legacy_scripts" / "train_legacy.py"]
    local = {path.stem for path in here.glob("*.py")} | {"ckptshim"}
    imported = set()
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported.add(node.module.partition(".")[0])
    third_party = sorted(imported - set(sys.stdlib_module_names) - local - {"__future__"})
    providers = packages_distributions()
    installed = _installs("ckptshim", frozenset({"demo"}))
    assert {"torch", "jax", "orbax-checkpoint", "transformers"} <= installed
    assert "torchao" not in installed and "deepspeed" not in installed  # what made the demo noisy
    missing = [module for module in third_party
               if not {canonicalize_name(d) for d in providers.get(module, [])} & installed]
    assert third_party and not missing, missing
