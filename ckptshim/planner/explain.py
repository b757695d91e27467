"""Plans in words: a few lines per plan, layer ranges compressed.

``decoder/layers_{0..95}/mlp/wi/kernel -> stack(axis=1) -> decoder/layers/mlp/wi/kernel`` says
in one line what 96 ops do. Lines that differ only in one number are merged into a range.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

from ckptshim.inventory import KeyPath, join_key
from ckptshim.planner.ops import Cast, Drop, Join, Op, Rename, Split, Stack, Synthesize, Transpose, Unstack
from ckptshim.planner.plan import Plan

_NUMBER = re.compile(r"\d+")
_MAX_CANDIDATES = 5000


def _ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0..2,5,7..8"``."""
    values = sorted(set(values))
    parts: list[str] = []
    start = prev = values[0]
    for value in values[1:] + [None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if value is not None:
            start = prev = value
    return ",".join(parts)


def _keys(keys: Sequence[KeyPath], sep: str) -> str:
    """Several keys that differ in one number -> one key with a ``{range}``; others listed
    (a split's ``query``, ``key``, ``value``)."""
    return ", ".join(compress([join_key(key, sep) for key in keys]))


def compress(lines: Iterable[str]) -> list[str]:
    """Merge lines that differ only in the value of one number into ``{a..b}`` ranges."""
    groups: dict[tuple[str, ...], list[tuple[int, ...]]] = {}
    for line in lines:
        pieces = tuple(_NUMBER.split(line))
        groups.setdefault(pieces, []).append(tuple(int(n) for n in _NUMBER.findall(line)))
    out: list[str] = []
    for pieces, numbers in groups.items():
        varying = [i for i in range(len(numbers[0])) if len({n[i] for n in numbers}) > 1]
        if len(varying) == 1:
            slot = varying[0]
            shown = [str(n) for n in numbers[0]]
            shown[slot] = "{" + _ranges([n[slot] for n in numbers]) + "}"
            out.append(_interleave(pieces, shown))
        else:
            out.extend(_interleave(pieces, [str(x) for x in n]) for n in numbers)
    return out


def _interleave(pieces: tuple[str, ...], numbers: list[str]) -> str:
    return "".join(p + (numbers[i] if i < len(numbers) else "") for i, p in enumerate(pieces))


def describe_op(op: Op, sep: str = ".") -> str:
    if isinstance(op, Rename):
        return f"{join_key(op.source, sep)} -> rename -> {join_key(op.target, sep)}"
    if isinstance(op, Stack):
        return f"{_keys(op.sources, sep)} -> stack(axis={op.axis}) -> {join_key(op.target, sep)}"
    if isinstance(op, Unstack):
        return f"{join_key(op.source, sep)} -> unstack(axis={op.axis}) -> {_keys(op.targets, sep)}"
    if isinstance(op, Transpose):
        return f"{join_key(op.source, sep)} -> transpose({layout(op)}) -> {join_key(op.target, sep)}"
    if isinstance(op, Split):
        return f"{join_key(op.source, sep)} -> split({layout(op)}) -> {_keys(op.targets, sep)}"
    if isinstance(op, Join):
        return f"{_keys(op.sources, sep)} -> join({layout(op)}) -> {join_key(op.target, sep)}"
    if isinstance(op, Synthesize):
        return f"(not in checkpoint) -> synthesize({op.rule}) -> {join_key(op.target, sep)}"
    if isinstance(op, Drop):
        return f"{join_key(op.source, sep)} -> drop({op.rule})"
    return f"{join_key(op.target, sep)}: cast {op.source_dtype} -> {op.target_dtype}"


def layout(op: Transpose | Split | Join) -> str:
    """``perm 1,0,2`` for a transpose, ``axes 0,1; perm 1,0`` for a split or join."""
    perm = "perm " + ",".join(map(str, op.perm))
    return perm if isinstance(op, Transpose) else f"axes {','.join(map(str, op.axes))}; {perm}"


def explain(plan: Plan, sep: str = ".") -> list[str]:
    """The whole plan, one line per op (identity renames left out), ranges compressed."""
    lines = compress(describe_op(op, sep) for op in plan.ops
                     if not (isinstance(op, Rename) and op.source == op.target))
    lines += compress(f"(not in checkpoint) -> missing -> {join_key(k, sep)}" for k in plan.missing)
    lines += compress(f"{join_key(k, sep)} -> unexpected" for k in plan.unexpected)
    lines += [f"mismatch: {m.describe(sep)}" for m in plan.mismatched]
    return lines


def summary(plan: Plan, sep: str = ".") -> str:
    """One line: what the shim changed, with the rules, axes or an example for each kind.

    ``4 renamed (0.weight -> _orig_mod.0.weight, ...), 6 dropped (attention.bias, inv_freq)``
    """
    details: dict[str, list[str]] = {}
    for op in plan.ops:
        if isinstance(op, Rename):
            if op.source != op.target:
                details.setdefault("renamed", []).append(
                    f"{join_key(op.source, sep)} -> {join_key(op.target, sep)}")
        elif isinstance(op, Stack | Unstack):
            details.setdefault("stacked" if isinstance(op, Stack) else "unstacked", []).append(f"axis {op.axis}")
        elif isinstance(op, Transpose | Split | Join):
            kind = "transposed" if isinstance(op, Transpose) else "split" if isinstance(op, Split) else "joined"
            details.setdefault(kind, []).append(layout(op))
        elif isinstance(op, Synthesize | Drop):
            details.setdefault("synthesized" if isinstance(op, Synthesize) else "dropped", []).append(op.rule)
        else:
            details.setdefault("cast", []).append(f"{op.source_dtype} -> {op.target_dtype}")
    counts = plan.counts()
    words = []
    for kind, examples in details.items():
        if kind == "renamed":
            shown = examples[0] + (", ..." if len(examples) > 1 else "")
        else:  # layouts hold commas of their own, so they are set apart by semicolons
            shown = ("; " if kind in ("transposed", "split", "joined") else ", ").join(sorted(set(examples)))
        words.append(f"{counts[kind]} {kind} ({shown})")
    for kind, keys in (("missing", plan.missing), ("unexpected", plan.unexpected),
                       ("mismatched", plan.mismatched)):
        if keys:
            words.append(f"{len(keys)} {kind}")
    return ", ".join(words) if words else "nothing to change"


def nearest(key: KeyPath, candidates: Sequence[KeyPath], n: int = 3) -> list[KeyPath]:
    """The candidate keys most like ``key``: same leaf name first, then by text similarity."""
    same_leaf = [c for c in candidates if c and c[-1] == key[-1]]
    pool = same_leaf if same_leaf else list(candidates[:_MAX_CANDIDATES])
    if len(pool) > _MAX_CANDIDATES:
        pool = pool[:_MAX_CANDIDATES]
    text = {join_key(c, "/"): c for c in pool}
    return [text[t] for t in difflib.get_close_matches(join_key(key, "/"), list(text), n=n, cutoff=0.4)]
