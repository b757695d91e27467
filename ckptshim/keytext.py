"""Key paths in words: many keys that differ in one number shown once, as a ``{range}``; and
every string from a checkpoint made safe for a terminal (:func:`shown`).

``decoder/layers_{0..95}/mlp/wi/kernel`` says in one line what 96 keys are. Plans, error
messages and log lines all speak of keys this way, so it lives here, below everything that does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ckptshim.inventory import KeyPath, join_key

_NUMBER = re.compile(r"\d+")


def shown(text: str) -> str:
    """``text`` as a terminal may show it: each character ``repr`` would escape (control
    characters, ANSI/OSC escape sequences, carriage returns, newlines, unpaired surrogates) as
    ``repr`` escapes it (``\\x1b``, ``\\n``, ``\\u200b``); every other character, and a text
    that needs no escaping, as it is.

    Key names, file names and metadata strings come from the checkpoint: raw, one could set the
    terminal's title, move the cursor over a line, or print a fake "complete". Every surface
    (``inspect``, ``plan``, the load's log lines, error messages) shows such text through this one
    function, applied to each line it prints (:func:`shown_lines`) or to a name where it is put
    into a message."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def shown_lines(text: str) -> str:
    """A message of several lines with each line :func:`shown`: its own line breaks kept, any
    other character a terminal would act on escaped."""
    return "\n".join(map(shown, text.split("\n")))


def shown_error(error: BaseException) -> BaseException:
    """``error`` (ckptshim's own, whose message names what a checkpoint holds) with its message
    :func:`shown_lines`, as it is about to leave ckptshim: through a hook, or inside DCP's
    ``CheckpointException``. Returned, for ``raise shown_error(error)``."""
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (shown_lines(error.args[0]),)
    return error


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
    """Merge lines that differ only in the numbers at some places into ``{a..b}`` ranges.

    Lines whose numbers run over a full grid are one line: ``layers.{0..63}.experts.{0..7}.w``;
    numbers that move in step on every line (a rename's layer on both sides of the arrow, equal or
    a constant apart) are one place, so ``layers.{0..63}.w -> _orig_mod.layers.{0..63}.w`` and
    ``sequential.{2..65}.w -> layers.{0..63}.w`` are one line too -- unless the
    lines hold ranges already (an op over many keys, one per layer): ``layers.{0..1}.experts.{0..3}
    -> concat -> layers.{0..1}.gate_up`` would read as one op over all of them. Lines that fit no
    grid are listed as they are. Lines keep the order of the first of each group.
    """
    return [text for text, _ in group(lines)]


def group(lines: Iterable[str]) -> list[tuple[str, list[str]]]:
    """:func:`compress`'s lines, each with the lines it stands for (in their order): what a caller
    needs that says something about each group (its first key's nearest names, its count)."""
    groups: dict[tuple[str, ...], list[tuple[str, tuple[int, ...]]]] = {}
    for line in lines:
        pieces = tuple(_NUMBER.split(line))
        groups.setdefault(pieces, []).append((line, tuple(int(n) for n in _NUMBER.findall(line))))
    out: list[tuple[str, list[str]]] = []
    for pieces, members in groups.items():
        in_step = "{" not in "".join(pieces)
        for part in _by_one_place(members, in_step):
            shown = _grid([n for _, n in part], in_step)
            if shown is None:
                out.extend((line, [line]) for line, _ in part)
            else:  # a number alike on every line as written (``07`` stays ``07``)
                written = _NUMBER.findall(part[0][0])
                shown = [text if text.startswith("{") else written[i] for i, text in enumerate(shown)]
                out.append((_interleave(pieces, shown), [line for line, _ in part]))
    return out


def _by_one_place(members: list[tuple[str, tuple[int, ...]]],
                  in_step: bool) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``members`` (lines of one shape and their numbers) as one part where they form a grid;
    else cut into the fewest parts that differ in one place only (with the places in step with
    it), each in the order of its first line: ``linear_fc1`` and ``linear_fc2`` rows of every
    layer, whose shapes differ, are a part per ``fc`` over the layers."""
    numbers = [n for _, n in members]
    if len(members) < 3 or _grid(numbers, in_step) is not None:
        return [members]
    first = numbers[0]
    varying = [i for i in range(len(first)) if any(n[i] != first[i] for n in numbers)]
    best: list[list[tuple[str, tuple[int, ...]]]] | None = None
    for place in varying:
        along = {i for i in varying if all(n[i] - n[place] == first[i] - first[place] for n in numbers)}
        parts: dict[tuple[int, ...], list[tuple[str, tuple[int, ...]]]] = {}
        for line, n in members:
            parts.setdefault(tuple(v for i, v in enumerate(n) if i not in along), []).append((line, n))
        if len(parts) < len(members) and (best is None or len(parts) < len(best)):
            best = list(parts.values())
    return [members] if best is None else best


#: Between a row's cells while rows are grouped: no digit, and nothing a printed key holds.
_CELL = "\x1f"


def group_rows(rows: Iterable[Sequence[str]]) -> list[tuple[tuple[str, ...], int]]:
    """Table rows (cells of text) grouped as :func:`group` groups lines, with how many rows each
    stands for: rows that differ only in a layer number, in any cells, are one row. Each cell
    is :func:`shown` first (a table is printed; and no cell then holds the separator)."""
    return [(tuple(text.split(_CELL)), len(members))
            for text, members in group(_CELL.join(map(shown, row)) for row in rows)]


def _grid(numbers: list[tuple[int, ...]], in_step: bool) -> list[str] | None:
    """The numbers of one line standing for all of ``numbers`` (ranges where they vary), or
    ``None`` when they are not every combination of the values at each place exactly once.
    Places whose numbers move in step on every line -- equal, or a constant apart, as a layer
    and the pipeline stage it was saved as (``layers.{0..1}`` from ``sequential.{2..3}``) --
    count as one only ``in_step``; each then shows its own range."""
    first = numbers[0]
    varying = [i for i in range(len(first)) if any(n[i] != first[i] for n in numbers)]
    places: list[list[int]] = []  # varying places a constant apart on every line are one place
    for i in varying:
        for place in places:
            if all(n[i] - n[place[0]] == first[i] - first[place[0]] for n in numbers):
                place.append(i)
                break
        else:
            places.append([i])
    values = [{n[place[0]] for n in numbers} for place in places]
    combinations = {tuple(n[place[0]] for place in places) for n in numbers}
    size = 1
    for seen in values:
        size *= len(seen)
    if (len(combinations) != len(numbers) or size != len(numbers)
            or (not in_step and any(len(place) > 1 for place in places))):
        return None
    shown = [str(n) for n in first]
    for place, seen in zip(places, values):
        for i in place:
            offset = first[i] - first[place[0]]
            shown[i] = "{" + ranges([value + offset for value in seen]) + "}"
    return shown


def _interleave(pieces: tuple[str, ...], numbers: list[str]) -> str:
    return "".join(p + (numbers[i] if i < len(numbers) else "") for i, p in enumerate(pieces))


def keys_text(keys: Sequence[KeyPath], sep: str = ".") -> str:
    """Several keys that differ in one number -> one key with a ``{range}``; keys that differ
    in one name only -> one key with the names in braces, in order (a split's
    ``self_attention/{query,key,value}/kernel``), and so runs of layers that differ in one span
    of one name (``model.layers.{0..1}.self_attn.{q,k,v}_proj.weight``); others listed."""
    shown = compress([join_key(key, sep) for key in keys])
    if 1 < len(shown) < len(keys):  # runs of layers, one per part: q, k and v of every layer
        return _folded(shown, sep) or ", ".join(shown)
    if len(shown) == len(keys) > 1:
        place = _one_differing_name(keys)
        if place is not None:
            names = ",".join(key[place] for key in keys)
            return join_key((*keys[0][:place], f"{{{names}}}", *keys[0][place + 1:]), sep)
    return ", ".join(shown)


def runs_text(runs: Sequence[Sequence[KeyPath]], sep: str = ".") -> str:
    """Runs of keys, one per part of a fused array (each run's keys differ in a layer number),
    as :func:`keys_text` says them: one key where the runs differ in one span of one name."""
    texts = [keys_text(run, sep) for run in runs]
    return _folded(texts, sep) or ", ".join(texts)


def _folded(texts: Sequence[str], sep: str) -> str | None:
    """Texts that differ in one span of one name only, as one text with the spans in braces, in
    order (``model.layers.{0..1}.self_attn.{q,k,v}_proj.weight``), else ``None``. Spans of
    digits alone are not folded: ``experts.{0..3}.w{1,3}`` would read as a range."""
    if len(texts) < 2 or len(set(texts)) < len(texts):
        return None
    start = len(_common_prefix(texts))
    end = len(_common_prefix([text[start:][::-1] for text in texts]))
    spans = [text[start:len(text) - end] for text in texts]
    prefix = texts[0][:start]
    if (any(not span or span.isdigit() or set(span) & {sep, "{", "}", ",", " "} for span in spans)
            or prefix.count("{") != prefix.count("}")):
        return None
    return f"{prefix}{{{','.join(spans)}}}{texts[0][len(texts[0]) - end:]}"


def _common_prefix(texts: Sequence[str]) -> str:
    shortest = min(texts, key=len)
    for index, char in enumerate(shortest):
        if any(text[index] != char for text in texts):
            return shortest[:index]
    return shortest


def _one_differing_name(keys: Sequence[KeyPath]) -> int | None:
    """The one place at which keys of two or more names each differ, if there is exactly one."""
    if len({len(key) for key in keys}) != 1 or len(keys[0]) < 2:
        return None
    places = [i for i in range(len(keys[0])) if len({key[i] for key in keys}) > 1]
    return places[0] if len(places) == 1 and len({key[places[0]] for key in keys}) == len(keys) else None
