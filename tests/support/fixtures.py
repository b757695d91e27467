"""The real fixtures in ``tests/fixtures``: writable copies, their manifests, their own modules.

A manifest lists every array a fixture holds with its hash, the fixtures README's: sha256 over
the array's raw little-endian C-order bytes (bfloat16 over its 2-byte storage). Fixtures are
copied before a test could write next to them (Orbax managers may; bad-input tests delete and
damage files), so ``tests/fixtures`` itself is never touched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import stat
from pathlib import Path
from types import ModuleType

import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def copy_fixture(name: str, into: Path, as_name: str | None = None) -> Path:
    """A writable copy of ``tests/fixtures/<name>`` (a folder or a file, ``name`` may hold ``/``)
    at ``into/<as_name>`` (default: the last part of ``name``); an existing copy is reused."""
    destination = into / (as_name or Path(name).name)
    return destination if destination.exists() else writable_copy(FIXTURES / name, destination)


def writable_copy(source: Path, destination: Path) -> Path:
    """``source`` (a folder or a file) copied to ``destination``, every copy writable by its owner
    (the shared fixtures are read-only); symlinks are copied as links, never followed."""
    if source.is_dir():
        shutil.copytree(source, destination, symlinks=True)
    else:
        shutil.copy2(source, destination, follow_symlinks=False)
    for path in [destination, *destination.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return destination


def fixture_module(path: str) -> ModuleType:
    """A Python module that ships with a fixture (its producer's model code), imported from its
    file (``"torch_dcp_single/dcp_tiny_model.py"``)."""
    file = FIXTURES / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_manifest(folder: str) -> dict:
    return json.loads((FIXTURES / folder / "manifest.json").read_text())


def expected_arrays(folder: str) -> dict[str, dict]:
    """``{key: {"shape", "dtype", "sha256"}}`` as the manifest lists them."""
    return {item["key"]: item for item in load_manifest(folder)["keys"]}


def array_sha256(array: np.ndarray) -> str:
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def tiny_decoder_values(layers: int = 3) -> dict[str, dict[str, "np.ndarray"]]:
    """The values every tiny-decoder fixture holds (``_shared/tiny_decoder_values.npz``), as flat
    ``params/...`` keys: ``unscanned`` as stored, ``scanned`` stacked on axis 1 with numpy."""
    import numpy as np

    from support.trees import scanned_expected

    with np.load(FIXTURES / "_shared" / "tiny_decoder_values.npz") as npz:
        unscanned = {"params/" + key: npz[key] for key in npz.files}
    return {"unscanned": unscanned, "scanned": scanned_expected(unscanned, layers, lambda key: 1)}
