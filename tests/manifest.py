"""Reading the fixtures' ``manifest.json``: expected keys, shapes, dtypes and value hashes.

The hash is the fixtures README's: sha256 over the array's raw little-endian C-order bytes
(bfloat16 over its 2-byte storage).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"


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
