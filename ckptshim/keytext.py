"""Key paths in words: many keys that differ in one number shown once, as a ``{range}``.

``decoder/layers_{0..95}/mlp/wi/kernel`` says in one line what 96 keys are. Plans, error
messages and log lines all speak of keys this way, so it lives here, below everything that does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ckptshim.inventory import KeyPath, join_key

_NUMBER = re.compile(r"\d+")


def ranges(values: Sequence[int]) -> str:
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
            shown[slot] = "{" + ranges([n[slot] for n in numbers]) + "}"
            out.append(_interleave(pieces, shown))
        else:
            out.extend(_interleave(pieces, [str(x) for x in n]) for n in numbers)
    return out


def _interleave(pieces: tuple[str, ...], numbers: list[str]) -> str:
    return "".join(p + (numbers[i] if i < len(numbers) else "") for i, p in enumerate(pieces))


def keys_text(keys: Sequence[KeyPath], sep: str = ".") -> str:
    """Several keys that differ in one number -> one key with a ``{range}``; others listed
    (a split's ``query``, ``key``, ``value``)."""
    return ", ".join(compress([join_key(key, sep) for key in keys]))
