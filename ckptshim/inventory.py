"""What a checkpoint holds, or what a load target wants, without any tensor bytes.

An :class:`Inventory` is a flat, immutable mapping from key paths (tuples of strings) to
:class:`Entry` records ``(key, shape, dtype, location)``. Formats build one from metadata, hooks
build one from the caller's model or abstract tree, and the planner compares two of them. Keys
are tuples so that the separators frameworks use (``.`` in torch, ``/`` and tuple paths in JAX,
dotted zarr folder names in Orbax/T5X/PaxML) never leak into matching.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType
from typing import Any

from ckptshim.errors import CorruptCheckpointError

KeyPath = tuple[str, ...]

#: Bytes per element of every dtype name an inventory may carry (numpy spelling, plus bfloat16
#: and the float8 family that numpy lacks).
DTYPE_SIZES: Mapping[str, int] = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}

_DTYPE_ALIASES = {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
    "short": "int16", "cfloat": "complex64", "cdouble": "complex128",
    # safetensors spellings
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "i8": "int8",
    "u8": "uint8", "i16": "int16", "u16": "uint16", "i32": "int32", "u32": "uint32",
    "i64": "int64", "u64": "uint64", "f8_e4m3": "float8_e4m3fn", "f8_e5m2": "float8_e5m2",
}
# Python's own scalar types mean what numpy makes of them (``np.dtype(float)`` is float64), not
# what torch's ``torch.float`` alias means.
_PYTHON_SCALARS = {float: "float64", int: "int64", bool: "bool", complex: "complex128"}


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name for a torch, numpy, JAX or string dtype, without importing any of them.

    ``torch.float32``, ``np.dtype('float32')``, ``jnp.float32`` and ``"F32"`` all become
    ``"float32"``. Raises ``ValueError`` for a dtype ckptshim does not know.
    """
    if isinstance(dtype, type) and dtype in _PYTHON_SCALARS:  # classes compare by identity
        return _PYTHON_SCALARS[dtype]
    name = getattr(dtype, "name", None)  # numpy dtypes and scalar types
    if not isinstance(name, str) and isinstance(dtype, type):
        name = getattr(dtype, "__name__", None)
    text = (name if isinstance(name, str) else str(dtype)).lower()
    text = text.removeprefix("torch.").removeprefix("dtype(").strip("'\")")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {dtype!r}; ckptshim knows {', '.join(sorted(DTYPE_SIZES))}")
    return text


@dataclass(frozen=True, slots=True, init=False)
class Entry:
    """One array: where it sits in the tree, its shape and dtype, and where its bytes live.

    ``location`` is opaque to everything but the format that made it (a file and byte range, a
    zarr folder, a DCP storage index, a live tensor's identity); it never holds tensor data.
    """

    key: KeyPath
    shape: tuple[int, ...]
    dtype: str
    location: Hashable = None

    def __init__(self, key: KeyPath, shape: tuple[int, ...], dtype: str,
                 location: Hashable = None) -> None:
        # What the generated __init__ does, at half the cost: a frozen dataclass assigns each
        # field with object.__setattr__, which looks the slot up by name every time; these are
        # the slots' own descriptors. Inventories hold millions of entries, so it shows.
        _set_key(self, key)
        _set_shape(self, shape)
        _set_dtype(self, dtype)
        _set_location(self, location)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


_set_key, _set_shape, _set_dtype, _set_location = (
    Entry.key.__set__, Entry.shape.__set__, Entry.dtype.__set__, Entry.location.__set__)
_key_of = attrgetter("key")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a burst of allocations that builds no cycles.

    Building an inventory or planning over a million keys allocates millions of small objects
    that all stay alive; the collector's passes over them (triggered by the allocation count
    alone) free nothing and would take a third to a half of the time. A caller that disabled the
    collector itself finds it still disabled afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Inventory(Mapping[KeyPath, Entry]):
    """An immutable, insertion-ordered collection of entries keyed by path.

    Duplicate keys are refused: two arrays claiming one name is a corrupt checkpoint, not
    something to resolve by picking one. ``model_type`` is the model the arrays are, where a
    ``config.json`` (or the live model) names it: a refusal says first when two sides differ.
    """

    __slots__ = ("_entries", "model_type", "source")

    def __init__(self, entries: Iterable[Entry], source: str = "", model_type: str | None = None) -> None:
        with gc_paused():  # entries often come from a generator that allocates them right here
            entries = entries if isinstance(entries, list | tuple) else list(entries)
            table = dict(zip(map(_key_of, entries), entries))
        if len(table) != len(entries):
            _refuse_duplicate(entries, source)
        self._entries = table
        self.source = source
        self.model_type = model_type

    def __getitem__(self, key: KeyPath) -> Entry:
        return self._entries[key]

    def __iter__(self) -> Iterator[KeyPath]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        return f"Inventory({len(self)} entries{', ' + self.source if self.source else ''})"

    @property
    def table(self) -> Mapping[KeyPath, Entry]:
        """The entries by key as a read-only dict view, for loops over millions of keys.

        Looking a key up through the view (``table.get``, ``key in table``, ``map(table.get,
        keys)``) runs in C; through the inventory itself each lookup is a Python-level call.
        """
        return MappingProxyType(self._entries)

    @property
    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())


def size_text(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: a byte count as people read it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _refuse_duplicate(entries: Iterable[Entry], source: str) -> None:
    """Raise for the first key that ``entries`` name twice."""
    seen: set[KeyPath] = set()
    for entry in entries:
        if entry.key in seen:
            raise CorruptCheckpointError(
                f"{source or 'inventory'}: key {join_key(entry.key)!r} appears twice; a "
                "checkpoint must name each array once. Re-save it, or inspect it with "
                "`ckptshim inspect` to see both entries."
            )
        seen.add(entry.key)


def split_key(text: str, sep: str = ".") -> KeyPath:
    """``"layers.0.w"`` -> ``("layers", "0", "w")``; ``sep="/"`` for JAX-style paths."""
    return tuple(text.split(sep)) if text else ()


def join_key(key: KeyPath, sep: str = ".") -> str:
    return sep.join(key)


_Leaf = Any


def flatten(tree: Any, is_leaf=None) -> dict[KeyPath, _Leaf]:
    """Flatten nested dicts, lists and tuples into ``{key path: leaf}`` in a stable order.

    Dict keys become path components via ``str``; list and tuple positions become ``"0"``,
    ``"1"``, ... Empty containers vanish (they hold no arrays). ``is_leaf`` can stop the descent
    early (e.g. at a NamedTuple that a framework treats as one value). Two keys that spell the
    same path (``{1: a, "1": b}``) raise ``ValueError`` rather than one silently hiding the other.
    """
    out: dict[KeyPath, _Leaf] = {}
    stack: list[tuple[KeyPath, Any]] = [((), tree)]
    while stack:
        prefix, node = stack.pop()
        if is_leaf is not None and is_leaf(node):
            out[prefix] = node
        elif isinstance(node, Mapping):
            names = [str(k) for k in node]
            if len(set(names)) != len(names):
                clash = next(n for n in names if names.count(n) > 1)
                raise ValueError(f"keys {[k for k in node if str(k) == clash]!r} under "
                                 f"{'/'.join(prefix) or 'the root'!r} all spell the path "
                                 f"component {clash!r}; rename one of them")
            stack.extend((prefix + (name,), v) for name, v in zip(reversed(names), reversed(list(node.values()))))
        elif isinstance(node, (list, tuple)):
            stack.extend((prefix + (str(i),), v) for i, v in reversed(list(enumerate(node))))
        else:
            out[prefix] = node
    return out


def unflatten(flat: Mapping[KeyPath, _Leaf]) -> dict[str, Any]:
    """Inverse of :func:`flatten` into nested dicts (list positions come back as ``"0"``... keys).

    Raises ``ValueError`` when one path is a prefix of another (a leaf cannot also be a subtree).
    """
    root: dict[str, Any] = {}
    for key, leaf in flat.items():
        if not key:
            raise ValueError("cannot unflatten an empty key path")
        node = root
        for part in key[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{join_key(key)!r} runs through the leaf {part!r}")
            node = child
        if key[-1] in node:
            raise ValueError(f"{join_key(key)!r} is both a leaf and a subtree")
        node[key[-1]] = leaf
    return root
