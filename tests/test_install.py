"""What a user gets from ``pip install``: the ``ckptshim`` command as the shell runs it, from the
user's own folder, in the project's venv and in a venv holding ckptshim alone (a wheel of this
tree and its required dependencies: no torch, no jax), where every command that needs a
framework says which extra installs it."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

from ckptshim.errors import DOCS_URL
from support.fixtures import FIXTURES, copy_fixture
from support.venvs import REPO, Venv, build_plain_venv

#: The first test to use ``plain`` waits for pip to build and install the wheel (bounded at 600 s).
pytestmark = pytest.mark.timeout(900)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SAFETENSORS = FIXTURES / "hf_gptneox_tf4.30.2/safetensors/model.safetensors"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Venv:
    return build_plain_venv(tmp_path_factory.mktemp("plain"))


def first_line(result) -> str:
    return result.stderr.strip().splitlines()[0]


# -- the project's own venv: its console script, run from the user's folder ----------------------

MY_MODELS = '''
def compiled():
    import torch
    from dcp_tiny_model import TinyLM
    return torch.compile(TinyLM())
'''


def test_plan_like_a_module_in_the_current_folder_with_the_console_script(tmp_path):
    """The docs' journey: beside mymod.py, `ckptshim plan CKPT --like mymod:build`. The console
    script's sys.path starts with its bin/ folder, not the current one (unlike `python -m`)."""
    (tmp_path / "my_models.py").write_text(MY_MODELS)
    copy_fixture("torch_dcp_single/dcp_tiny_model.py", tmp_path)
    checkpoint = FIXTURES / "torch_dcp_single/torch_save/model.pt"
    here = Venv(Path(sys.executable).parent.parent)
    result = here.run([here.script(), "plan", checkpoint, "--like", "my_models:compiled", "--json"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["complete"] and info["summary"].startswith("26 renamed"), info["summary"]
    absent = here.run([here.script(), "plan", checkpoint, "--like", "not_here:build"], cwd=tmp_path)
    assert absent.returncode == 1
    assert first_line(absent) == (f"ckptshim: --like not_here:build: no module 'not_here' in the current "
                                  f"folder ({tmp_path}) or on PYTHONPATH; run from the folder that holds "
                                  "it or add that folder to PYTHONPATH")
    (tmp_path / "broken_models.py").write_text("from os import no_such_name\n")
    broken = here.run([here.script(), "plan", checkpoint, "--like", "broken_models:build"], cwd=tmp_path)
    assert broken.returncode == 1  # the module is there: what it imports is not
    assert first_line(broken).startswith("ckptshim: --like broken_models:build: importing broken_models "
                                         "failed: cannot import name 'no_such_name' from 'os'"), broken.stderr


# -- a venv with ckptshim alone ------------------------------------------------------------------


def test_the_installed_package_carries_its_license_types_and_version(plain, tmp_path):
    site = plain.site_packages()
    version = PYPROJECT["project"]["version"]
    assert (site / "ckptshim" / "py.typed").is_file()
    assert (site / f"ckptshim-{version}.dist-info" / "licenses" / "LICENSE").read_text() == \
        (REPO / "LICENSE").read_text()
    shown = plain.run([plain.script(), "--version"], cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout.startswith(f"ckptshim {version} (Python "), shown
    imported = plain.run([plain.python, "-c", "import ckptshim, sys; print(ckptshim.__version__, "
                          "'importlib.metadata' in sys.modules)"], cwd=tmp_path)
    assert imported.stdout.split() == [version, "True"], imported.stderr
    doctor = plain.run([plain.script(), "doctor"], cwd=tmp_path)
    assert doctor.returncode == 0 and doctor.stdout.startswith(f"ckptshim {version} ({site / 'ckptshim'})")
    page = plain.run([plain.script(), "docs", "maxtext"], cwd=tmp_path)  # the pages ship in the package
    assert page.returncode == 0 and page.stdout == (REPO / "docs" / "maxtext.md").read_text(), page.stderr
    assert "torch             -" in doctor.stdout and "absent" in doctor.stdout


def test_run_reaches_child_pythons_from_the_installed_package(plain, tmp_path):
    """`ckptshim run`'s bootstrap folder (no __init__.py) is in the wheel."""
    result = plain.run([plain.script(), "run", "--", "python", "-c",
                        "import sys; print('ckptshim' in sys.modules)"], cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr


@pytest.mark.parametrize(("to", "module", "distribution", "extra"),
                         [("dcp", "torch", "torch", "torch"), ("orbax", "jax", "jax", "jax")])
def test_convert_names_the_extra_it_needs(plain, tmp_path, to, module, distribution, extra):
    result = plain.run([plain.script(), "convert", SAFETENSORS, tmp_path / "out", "--to", to], cwd=tmp_path)
    assert result.returncode == 1
    assert first_line(result) == (f"ckptshim: convert --to {to} needs {distribution}, which is not installed "
                                  f"here (no module named {module!r}); install it with: "
                                  f"pip install 'ckptshim[{extra}]'")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_what_needs_no_framework_works_without_one(plain, tmp_path):
    """safetensors in and out: numpy only (bfloat16 included, as its bits)."""
    out = tmp_path / "copy.safetensors"
    converted = plain.run([plain.script(), "convert", SAFETENSORS, out, "--to", "safetensors"], cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr
    inspected = plain.run([plain.script(), "inspect", out, "--json"], cwd=tmp_path)
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["complete"], inspected.stderr


def test_reading_an_orbax_checkpoint_names_the_extra_it_needs(plain, tmp_path):
    """Not "the checkpoint is corrupt": the checkpoint is fine, tensorstore is missing."""
    item = FIXTURES / "orbax_0.12.8_scanned/standard_checkpointer_scanned"
    result = plain.run([plain.script(), "inspect", item], cwd=tmp_path)
    assert result.returncode == 1
    assert first_line(result) == (f"ckptshim: {item}: opening it needs tensorstore, which is not installed "
                                  "here (no module named 'tensorstore'); install it with: "
                                  "pip install 'ckptshim[jax]'")


def test_a_like_module_that_needs_a_missing_framework_says_which(plain, tmp_path):
    (tmp_path / "torch_model.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(2, 2)\n")
    result = plain.run([plain.script(), "plan", SAFETENSORS, "--like", "torch_model:build"], cwd=tmp_path)
    assert result.returncode == 1
    assert first_line(result) == ("ckptshim: --like torch_model:build needs torch, which is not installed "
                                  "here (no module named 'torch'); install it with: pip install 'ckptshim[torch]'")


# -- what the installed command and its errors point at ----------------------------------------


def _parsers():
    from ckptshim.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")  # argparse keeps no public list
    return [("ckptshim", parser), *((f"ckptshim {name}", sub) for name, sub in commands.choices.items())]


@pytest.mark.parametrize(("name", "parser"), _parsers(), ids=lambda value: value if isinstance(value, str) else "")
def test_help_explains_every_argument_and_option(name, parser):
    unexplained = [action.dest for action in parser._actions if not (action.help or "").strip()]
    assert not unexplained, f"{name}: no help for {unexplained}"
    assert parser.description and parser.epilog and ("ckptshim docs" if DOCS_URL is None else DOCS_URL) in parser.epilog


def printed_strings():
    """Every string constant of the package's code that is not a docstring (what it may print),
    as ``(path:line, text)``; docstrings speak to the code's readers."""
    import ast

    for path in sorted((REPO / "ckptshim").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                yield f"{path.relative_to(REPO)}:{node.lineno}", node.value


def test_no_message_points_at_the_repository_docs_folder():
    """A pip install has no docs/ folder: strings the code prints point at `ckptshim docs PAGE`
    (errors.docs_page) or at `--help`. Docstrings may cite docs/ for the code's readers."""
    cited = [where for where, text in printed_strings() if re.search(r"\bdocs/[\w.-]+\.md", text)]
    assert not cited, cited


def test_the_docs_site_is_the_one_the_package_metadata_names():
    """One switch: until ``DOCS_URL`` names a site, no metadata names one and every pointer is
    ``ckptshim docs PAGE``; once it does, the metadata's Documentation URL is that site."""
    from ckptshim.errors import docs_page

    urls = PYPROJECT["project"].get("urls", {})
    if DOCS_URL is None:
        assert not urls, urls
        assert docs_page("maxtext") == "`ckptshim docs maxtext`"
    else:
        assert urls["Documentation"] == DOCS_URL and docs_page("maxtext") == DOCS_URL + "maxtext/"
    assert (REPO / "docs" / "maxtext.md").is_file()


#: Hosts known to serve what a message sends the user to (none yet: see errors.DOCS_URL).
SERVING_HOSTS: frozenset[str] = frozenset()


def test_no_message_points_at_a_host_that_does_not_serve_it():
    """Every URL in a string the package prints (docstrings aside) or in its metadata is on a
    host that serves it: today none, so there is none; a pointer names `ckptshim docs PAGE`."""
    from urllib.parse import urlsplit

    found = [(f"pyproject.toml [project.urls] {name}", url) for name, url in PYPROJECT["project"].get("urls", {}).items()]
    found += [(where, url) for where, text in printed_strings() for url in re.findall(r"https?://[^\s\"'`)]+", text)]
    unserved = [(where, url) for where, url in found
                if urlsplit(url).hostname not in SERVING_HOSTS | {"127.0.0.1", "localhost", None}]
    assert not unserved, unserved


def test_ckptshim_docs_prints_each_page_the_messages_name(capsys):
    """`ckptshim docs PAGE` prints every page a message points at (errors.docs_page), from the
    copy in the package; without PAGE it lists them."""
    from ckptshim import cli
    from ckptshim.errors import docs_page

    named = set()
    for path in sorted((REPO / "ckptshim").rglob("*.py")):
        named |= set(re.findall(r"docs_page\(['\"]([\w-]+)['\"]", path.read_text()))
    assert named >= {"maxtext", "paxml-gpt3"}
    for page in sorted(named):
        assert docs_page(page) == f"`ckptshim docs {page}`"
        assert cli.main(["docs", page]) == 0
        assert capsys.readouterr().out == (REPO / "docs" / f"{page}.md").read_text()
    assert cli.main(["docs"]) == 0 and "maxtext" in capsys.readouterr().out
    assert cli.main(["docs", "nowhere"]) == 1 and "no documentation page 'nowhere'" in capsys.readouterr().err
