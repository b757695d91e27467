"""The documentation site: it builds with every link resolved (``mkdocs build --strict``), and each
page renders cleanly in a real browser -- Debian's Chromium, headless, driven by playwright.

"Cleanly" is read from the page's own layout (element and text boxes), at a desktop and a phone
width: no text runs past its column (a long error-string heading into the body beside it, as
under mkdocs' default theme), the sidebars and the body do not overlap, the page does not scroll
sideways, consecutive blocks of the body do not overlap, and every asset the page asks for loads.
The test skips where chromium is not installed, saying so; CI installs it (``.ci/run``) and there
a missing chromium fails the test instead.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: The flags every headless Chromium here starts with (a fresh profile comes from playwright's
#: persistent context in a new temporary folder).
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORTS = {"desktop": (1280, 900), "phone": (390, 844)}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    built = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(built)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    return built


def pages(site: Path) -> list[str]:
    """Every page of the built site, as its address relative to the site's root."""
    return sorted("" if p.parent == site else p.parent.relative_to(site).as_posix() + "/"
                  for p in site.rglob("index.html"))


def test_docs_build_strictly(site):
    built = pages(site)
    expected = {"" if p.stem == "index" else f"{p.stem}/" for p in (ROOT / "docs").glob("*.md")}
    assert set(built) == expected


def test_api_page_documents_the_public_functions_from_their_docstrings(site):
    html = (site / "api" / "index.html").read_text()
    for name in ("install", "uninstall", "inspect", "plan", "convert"):
        assert f'id="ckptshim.{name}"' in html, name
    assert "Open a checkpoint and describe it from its metadata alone" in html  # api.inspect's docstring
    assert 'id="ckptshim.extras.MissingExtraError"' in html


def test_no_page_shows_sphinx_roles(site):
    """Docstrings the API page renders use Markdown; a ``:func:`x``` would be printed as it is."""
    shown = {page: re.findall(r":(?:func|class|meth|mod|data|attr|exc):(?:`|<code>)[^<`]*",
                              (site / page / "index.html").read_text()) for page in pages(site)}
    assert not {page: roles for page, roles in shown.items() if roles}


def test_the_changelog_page_is_the_repository_changelog(site):
    html = (site / "changelog" / "index.html").read_text()
    first_entry = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert first_entry.removeprefix("## ") in html


def test_every_environment_variable_the_code_reads_is_documented():
    read = {name for path in (ROOT / "ckptshim").rglob("*.py")
            for name in re.findall(r"CKPTSHIM_[A-Z_]+[A-Z]", path.read_text())}
    documented = set(re.findall(r"CKPTSHIM_[A-Z_]+[A-Z]", (ROOT / "docs" / "environment.md").read_text()))
    assert read and read <= documented, sorted(read - documented)


# -- rendering, in headless Chromium ------------------------------------------------------------

#: Run in the page: what is wrong with its layout, as sentences (an empty list when nothing is).
LAYOUT_PROBLEMS = r"""
() => {
  const problems = new Set();
  const onScreen = (el) => {
    const r = el.getBoundingClientRect(), s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && s.display !== "none" && s.visibility !== "hidden"
        && r.right > 0 && r.left < window.innerWidth;
  };
  const name = (node) => JSON.stringify((node.textContent || "").trim().slice(0, 70));
  const clipsSideways = (el) => ["auto", "scroll", "hidden", "clip"].includes(getComputedStyle(el).overflowX);

  const page = document.documentElement;
  if (page.scrollWidth > window.innerWidth + 1)
    problems.add(`the page scrolls sideways: ${page.scrollWidth}px of content in a ${window.innerWidth}px window`);

  // The columns: the navigation, the table of contents, the body.
  const columns = [...document.querySelectorAll(".md-sidebar .md-sidebar__scrollwrap"),
                   ...document.querySelectorAll(".md-content")].filter(onScreen);
  const body = document.querySelector(".md-content");
  if (!body || !onScreen(body)) problems.add("no page body is shown");
  for (let i = 0; i < columns.length; i++)
    for (let j = i + 1; j < columns.length; j++) {
      const a = columns[i].getBoundingClientRect(), b = columns[j].getBoundingClientRect();
      if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1)
        problems.add(`columns overlap: ${columns[i].className} and ${columns[j].className}`);
    }

  // Every piece of text stays inside its column, unless a box between them scrolls it (a code
  // block, a wide table's scroll wrapper): then that box must stay inside instead. Text is never
  // cut off (overflow hidden, an ellipsis): an error string is only useful whole.
  for (const column of columns) {
    const box = column.getBoundingClientRect();
    const walker = document.createTreeWalker(column, NodeFilter.SHOW_TEXT);
    for (let text = walker.nextNode(); text; text = walker.nextNode()) {
      if (!text.textContent.trim() || !onScreen(text.parentElement)) continue;
      let clip = null;
      for (let el = text.parentElement; el && el !== column; el = el.parentElement)
        if (clipsSideways(el)) {
          clip = el;
          if (["hidden", "clip"].includes(getComputedStyle(el).overflowX) && el.scrollWidth > el.clientWidth + 1)
            problems.add(`${name(el)} is cut off: ${el.scrollWidth - el.clientWidth}px of it are hidden (${column.className})`);
        }
      const range = document.createRange();
      range.selectNodeContents(text);
      const rects = clip ? [clip.getBoundingClientRect()] : [...range.getClientRects()];
      for (const r of rects)
        if (r.width > 0 && (r.right > box.right + 1 || r.left < box.left - 1)) {
          problems.add(`${name(clip || text)} runs ${Math.round(Math.max(r.right - box.right, box.left - r.left))}px `
                        + `out of its column (${column.className})`);
          break;
        }
    }
  }

  // Consecutive blocks of the body (headings, paragraphs, lists, tables, code) do not overlap.
  const blocks = body ? [...body.querySelectorAll(".md-typeset > *")].filter(onScreen) : [];
  for (let i = 1; i < blocks.length; i++) {
    const above = blocks[i - 1].getBoundingClientRect(), below = blocks[i].getBoundingClientRect();
    if (below.top < above.bottom - 1)
      problems.add(`${name(blocks[i])} overlaps ${name(blocks[i - 1])} by ${Math.round(above.bottom - below.top)}px`);
  }
  return [...problems];
}
"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def served(site) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 (as a docs host serves it), stopped afterwards."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=site))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[object]:
    if not Path(CHROMIUM).is_file():
        if os.environ.get("CI"):
            pytest.fail(f"no chromium at {CHROMIUM}: .ci/run installs Debian's chromium before the tests")
        pytest.skip("Debian's chromium is not installed here (apt-get install chromium); "
                    "the rendering checks need it (CI installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path_factory.mktemp("chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_FLAGS)
        try:
            yield context
        finally:
            context.close()


@pytest.mark.parametrize("viewport", VIEWPORTS)
def test_every_page_renders_without_overlap(site, served, browser, viewport, tmp_path):
    width, height = VIEWPORTS[viewport]
    found = {}
    for address in pages(site):
        page = browser.new_page()  # one per address: what a page asks for is counted against it alone
        failed: list[str] = []
        # (a request the browser itself cancels, net::ERR_ABORTED, is no failure of the page)
        page.on("requestfailed", lambda request: "ERR_ABORTED" not in (request.failure or "")
                and failed.append(f"{request.url}: {request.failure}"))
        page.on("response", lambda response: response.status >= 400 and failed.append(f"{response.url}: {response.status}"))
        page.on("pageerror", lambda error: failed.append(f"script error: {error}"))
        try:
            page.set_viewport_size({"width": width, "height": height})
            page.goto(served + address, wait_until="networkidle")
            problems = page.evaluate(LAYOUT_PROBLEMS) + failed
            if problems:
                shot = tmp_path / f"{address.strip('/') or 'index'}-{viewport}.png"
                page.screenshot(path=str(shot), full_page=True)
                found[address or "index"] = [*problems[:8], f"(screenshot: {shot})"]
        finally:
            page.close()
    assert not found, "\n".join(f"{address}:\n  " + "\n  ".join(problems) for address, problems in found.items())


#: The failure the check exists for, as mkdocs' default theme showed it: a table of contents
#: whose long error-string entry runs out of its column over the body text beside it.
OVERFLOWING = """<!doctype html><html><body style="margin:0; display:flex">
<div class="md-sidebar"><div class="md-sidebar__scrollwrap" style="width:200px; white-space:nowrap">
  <a class="md-nav__link">Missing key in checkpoint state_dict: model._orig_mod.layers.0.attn.weight</a></div></div>
<div class="md-content" style="width:600px"><article class="md-typeset"><h1>PyTorch</h1><p>Body text.</p>
</article></div></body></html>"""


def test_the_layout_check_sees_text_running_into_the_next_column(browser):
    page = browser.new_page()
    try:
        page.set_viewport_size({"width": 1000, "height": 600})
        page.set_content(OVERFLOWING)
        problems = page.evaluate(LAYOUT_PROBLEMS)
    finally:
        page.close()
    assert any(p.startswith('"Missing key in checkpoint state_dict') and "out of its column (md-sidebar__scrollwrap)" in p
               for p in problems), problems


#: Headings quoting a framework's own error -> the case of tests/workers/native_errors_worker.py
#: that raises it ("..." stands for what differs from run to run: paths, the rest of a list).
QUOTED_ERRORS = {
    ("paxml.md", "FileNotFoundError: Metadata file (named _METADATA) does not exist at .../checkpoint_00000001/state."): "paxml standard",
    ("paxml.md", "FileNotFoundError: No structure could be identified for the checkpoint at .../checkpoint_00000001/state."): "paxml pytree",
    ("paxml.md", "FileNotFoundError: Checkpoint at .../checkpoints/1 not found."): "paxml manager",
    ("gpt-neox.md", 'Error(s) in loading state_dict for GPTNeoXForCausalLM: Missing key(s) in state_dict: "gpt_neox.embed_in.weight", ...'): "neox into hf",
    ("deepspeed.md", "AssertionError: metadata is None; global metadata read failed: [Errno 2] No such file or directory: '.../.metadata'"): "zero dcp",
    ("deepspeed.md", "size mismatch for ...: copying a param with shape torch.Size([0]) from checkpoint, ..."): "zero3 module",
    ("deepspeed.md", "Unsupported global: GLOBAL deepspeed.runtime.zero.config.ZeroStageEnum was not an allowed global by default"): "zero torch.load",
    ("megatron-core.md", "RuntimeError: Missing key in checkpoint state_dict: decoder.layers.0.input_layernorm.bias."): "megatron dcp",
    ("jax.md", "InvalidLayoutError: Failed to interpret path .../pytree_checkpointer as a V0 Orbax PyTree."): "orbax v1 old layout",
    ("jax.md", "ValueError: Structure mismatch: Target path ('linear', 'bias', 'value') not found in metadata_tree."): "flax 0.8 nnx",
    ("megatron-core.md", "RuntimeError: Missing key in checkpoint state_dict: lm_head.weight."): "megatron into llama",
    ("megatron-core.md", "AssertionError: metadata is None; global metadata read failed: [Errno 2] No such file or directory: '.../iter_0000000/.metadata'"): "megatron zarr into llama",
    ("meta-llama.md", "AssertionError: metadata is None; global metadata read failed: [Errno 2] No such file or directory: '.../mp2/.metadata'"): "meta dcp",
    ("meta-llama.md", 'Error(s) in loading state_dict for LlamaForCausalLM: Missing key(s) in state_dict: "model.embed_tokens.weight", ...'): "meta state dict",
    ("torchtune.md", "AssertionError: metadata is None; global metadata read failed: [Errno 2] No such file or directory: '.../epoch_0/.metadata'"): "torchtune dcp",
    ("torchtune.md", 'Error(s) in loading state_dict for LlamaForCausalLM: Missing key(s) in state_dict: "model.embed_tokens.weight", ...'): "torchtune state dict",
    ("litgpt.md", "AssertionError: metadata is None; global metadata read failed: [Errno 20] Not a directory: '.../lit_model.pth/.metadata'"): "litgpt dcp",
    ("litgpt.md", 'Error(s) in loading state_dict for LlamaForCausalLM: Missing key(s) in state_dict: "model.embed_tokens.weight", ...'): "litgpt state dict",
}


def test_the_errors_the_docs_quote_are_the_frameworks_own(tmp_path):
    """Run without ckptshim on the fixtures, the frameworks say what the headings say."""
    from support.processes import environment, worker

    result = subprocess.run([sys.executable, worker("native_errors_worker.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=300,
                            env=environment({"CKPTSHIM_DISABLE": "1", "JAX_PLATFORMS": "cpu"}))
    assert result.returncode == 0, result.stderr[-3000:]
    raised = json.loads(result.stdout.strip().splitlines()[-1])
    for (page, quoted), case in QUOTED_ERRORS.items():
        assert f"## `{quoted}`" in (ROOT / "docs" / page).read_text(), (page, quoted)
        pattern = ".*?".join(re.escape(part).replace(r"\ ", r"\s+") for part in quoted.split("..."))
        assert re.search(pattern, raised[case], re.DOTALL), (quoted, raised[case][:300])
