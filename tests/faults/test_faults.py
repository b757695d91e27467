"""The fault-injection matrix: every damage in the table, through every call that can see it.

Each case copies one checkpoint, builds the load (and its destination) from the intact copy,
damages the copy, and loads it. The assertion is the same for all: a ``ShimError`` (or DCP's
``CheckpointException`` carrying one from every rank) whose message names the damaged file and
the problem (for a shape the metadata declares, which makes it another checkpoint than the
target's rather than a corrupt one, it may be the framework's own error with ckptshim's note
saying it, where no plan fits); the destination's bytes unchanged; no file created, changed or removed anywhere
under the test's folder (the copy, a folder outside it, the working directory); and an answer
within ``BOUND`` seconds. ``test_intact_copy_loads`` runs every load on the undamaged copy, so a
case cannot pass because its load was broken to begin with.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fault_damage import KINDS, PWNED
from fault_loaders import LOADERS, Load, digest, refusal
from ckptshim.errors import ShimError
from support.fixtures import FIXTURES, writable_copy
from support.native import diagnosis
from fault_table import BY_NAME, COMPLETE, FORMATS, LISTING, OPEN

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")

#: Seconds a refusal may take: loads of these checkpoints take well under one.
BOUND = 20.0

#: What a refusal must say, besides the file's name.
PROBLEM = {
    "delete": r"missing|does not exist|no such",
    "truncate_0": r"truncated|bytes|too short|not a readable|does not|empty|failed",
    "truncate_64": r"truncated|bytes|too short|not a readable|does not|failed",
    "truncate_half": r"truncated|bytes|not a readable|does not|failed",
    "zero_chunk": r"damaged|corrupt|not a readable|does not|failed|trailing",
    "bad_compression": r"damaged|corrupt|does not|failed",
    "flip_metadata": r"not valid|not a valid|not a readable|does not|corrupt|damaged|byte 0x|not text|trailing bytes",
    "wrong_dtype": r"dtype|bytes|holds|float|size|corrupt",
    "wrong_shape": r"shape|bytes|holds|size|cover|corrupt",
    "duplicate_key": r"twice|duplicate",
    "escape_dotdot": r"outside|not a plain file name|not a folder inside",
    "escape_absolute": r"outside|not a plain file name|not a folder inside",
    "escape_symlink": r"outside|not a folder inside",
    "empty_directory": r"empty",
    "forbidden_global": r"mkdir|global|allow",
    "msgpack_bomb_count": r"needs \d+ more bytes|truncated|holds",
    "msgpack_bomb_bytes": r"needs \d+ more bytes|truncated|holds",
    "msgpack_bomb_shape": r"holds|bytes|shape",
}


@dataclass(frozen=True)
class Case:
    format: str
    damage: str
    path: str

    def __str__(self) -> str:
        return f"{self.format}-{self.damage}-{self.path}"


def _paths(fmt, stage: str) -> tuple[str, ...]:
    if stage == LISTING:
        return "inspect", "plan"
    return (("inspect",) if stage in (OPEN, COMPLETE) else ()) + (("plan",) if stage == OPEN else ()) + fmt.hooks


CASES = [Case(fmt.name, damage, path) for fmt in FORMATS for damage, stage in fmt.stages.items()
         for path in _paths(fmt, stage)]


CONTROLS = sorted({(fmt.name, path) for fmt in FORMATS for path in ("inspect", "plan", *fmt.hooks)})



def _snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder``: kind, size and modification time (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            out[str(path.relative_to(folder))] = (stat.S_IFMT(info.st_mode), info.st_size, info.st_mtime_ns)
    return out


def _setup(fmt_name: str, path_kind: str, tmp_path: Path, monkeypatch, request) -> tuple[Path, Load]:
    fmt = BY_NAME[fmt_name]
    if fmt.fixture.startswith("built:"):
        source = request.getfixturevalue("built")[fmt.fixture.removeprefix("built:")]
    else:
        source = FIXTURES / fmt.fixture
    if path_kind == "t5x":
        request.getfixturevalue("t5x_standin")
    root = writable_copy(source, tmp_path / "ckpt")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    path = root / fmt.load if fmt.load else root
    original = source / fmt.load if fmt.load else source
    return root, LOADERS[path_kind](fmt, path, original)


@pytest.mark.parametrize(("fmt", "path_kind"), CONTROLS, ids=[f"{f}-{p}" for f, p in CONTROLS])
def test_intact_copy_loads(fmt, path_kind, tmp_path, monkeypatch, request):
    _, load = _setup(fmt, path_kind, tmp_path, monkeypatch, request)
    load.call()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fault(case: Case, tmp_path, monkeypatch, request):
    fmt = BY_NAME[case.format]
    root, load = _setup(case.format, case.path, tmp_path, monkeypatch, request)
    named = KINDS[case.damage](root, fmt, tmp_path / "elsewhere")
    files = _snapshot(tmp_path)
    before = digest(load.destination())
    start = time.monotonic()
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is one
        load.call()
    elapsed = time.monotonic() - start
    error = refusal(info.value)
    if error is None and case.damage == "wrong_shape" and not isinstance(info.value, ShimError):
        # metadata that declares another shape describes a well-formed array of that shape: no
        # plan fits the target, so the framework's own call runs, and its error carries ckptshim's
        # reading as a note, which must say it as a refusal would
        message = diagnosis(info.value)
    else:
        assert error is not None, f"not a refusal: {type(info.value).__name__}: {info.value}"
        message = str(error)
    assert named in message, f"{named!r} is not named in: {message}"
    assert re.search(PROBLEM[case.damage], message, re.IGNORECASE), f"the problem is not said: {message}"
    assert elapsed < BOUND, f"took {elapsed:.1f} s"
    assert digest(load.destination()) == before, "the destination changed although the load failed"
    assert _snapshot(tmp_path) == files, "files were written, changed or removed"
    assert not (tmp_path / "elsewhere" / PWNED).exists(), "the checkpoint ran code"
