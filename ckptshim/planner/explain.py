"""Plans in words: a few lines per plan, layer ranges compressed, and a one-line summary.

``decoder/layers_{0..95}/mlp/wi/kernel -> stack(axis=1) -> decoder/layers/mlp/wi/kernel`` says
in one line what 96 ops do: each op describes itself (:mod:`ckptshim.ops`), and lines that
differ only in one number are merged into a range.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from ckptshim.inventory import KeyPath, join_key
from ckptshim.keytext import compress, group_rows, keys_text
from ckptshim.planner.plan import Plan

#: The columns of :func:`table`.
HEADERS = ("Key", "Status", "Details")


def explain(plan: Plan, sep: str = ".") -> list[str]:
    """The whole plan, one line per op (ops that change nothing left out), ranges compressed."""
    lines = [f"({note})" for note in plan.notes]
    lines += compress(op.describe(sep) for op in plan.ops if op.tally() is not None)
    lines += compress(f"(not in checkpoint) -> missing -> {join_key(k, sep)}" for k in plan.missing)
    lines += compress(f"{join_key(k, sep)} -> unexpected" for k in plan.unexpected)
    lines += [f"mismatch: {m.describe(sep)}" for m in plan.mismatched]
    return lines


def summary(plan: Plan, sep: str = ".") -> str:
    """One line: what the shim changed, with the rules, axes or an example for each kind.

    ``4 renamed (0.weight -> _orig_mod.0.weight, ...), 6 dropped (attention.bias, inv_freq)``
    """
    counts: Counter[str] = Counter()
    notes: dict[str, list[str]] = {}
    by_example: dict[str, bool] = {}
    for op in plan.ops:
        tally = op.tally()
        if tally is None:
            continue
        word, touched = tally
        counts[word] += touched
        notes.setdefault(word, []).append(op.note(sep))
        by_example[word] = op.summary_by_example
    words = []
    for word, shown in notes.items():
        if by_example[word]:  # the first example, per-layer keys grouped (layers.{0..63}.w -> ...)
            examples = compress(shown)
            text = examples[0] + (", ..." if len(examples) > 1 else "")
        else:  # notes holding commas of their own (layouts) are set apart by semicolons
            distinct = sorted(set(shown))
            text = ("; " if any("," in n or ";" in n for n in distinct) else ", ").join(distinct)
        words.append(f"{counts[word]} {word} ({text})")
    words += plan.notes
    for kind, keys in (("missing", plan.missing), ("unexpected", plan.unexpected),
                       ("mismatched", plan.mismatched)):
        if keys:
            words.append(f"{len(keys)} {kind}")
    return ", ".join(words) if words else "nothing to change"


def table(plan: Plan, sep: str = ".", limit: int | None = None) -> list[str]:
    """What the load changed and what does not fit, as a table of grouped keys (as transformers
    prints its load report): one row per op that changes something (its kind, and where the
    value comes from), per missing and unexpected key, and per mismatch (with both shapes or
    dtypes); keys that differ only in a layer number are one row. Empty for a plan that changes
    nothing. With ``limit``, at most that many rows, and a line that says how many are left out.
    """
    rows: list[tuple[str, str, str]] = []
    for op in plan.ops:
        tally = op.tally()
        if tally is None:
            continue
        keys = op.targets if op.produces or not op.sources else op.sources  # a cast names its target
        origin = f"from {keys_text(op.sources, sep)}" if op.produces and op.sources and op.sources != keys else ""
        detail = "" if op.summary_by_example else op.note(sep)
        rows.append((keys_text(keys, sep), tally[0], f"{origin} ({detail})" if origin and detail else origin or detail))
    rows += _subtree_rows(plan.missing, plan.target, "missing", sep)
    rows += _subtree_rows(plan.unexpected, plan.source, "unexpected", sep)
    for m in plan.mismatched:
        rows.append((join_key(m.target, sep), "mismatched",
                     f"{m.why}: checkpoint {_shown(m.source_shape, m.of_dtype)}, target {_shown(m.target_shape, m.of_dtype)}"))
    if not rows:
        return []
    grouped = [cells for cells, _ in group_rows(rows)]
    left_out = 0 if limit is None else max(len(grouped) - limit, 0)
    grouped = grouped[:len(grouped) - left_out]
    widths = [max(len(row[i]) for row in [HEADERS, *grouped]) for i in range(2)]
    lines = [_row(HEADERS, widths), f"{'-' * widths[0]}-+-{'-' * widths[1]}-+-{'-' * len(HEADERS[2])}"]
    lines += [_row(row, widths) for row in grouped]
    if left_out:
        lines.append(f"({left_out} more rows; `ckptshim plan` or CKPTSHIM_LOG=debug shows every one)")
    return lines


def _subtree_rows(keys: Sequence[KeyPath], side: Iterable[KeyPath], status: str,
                  sep: str) -> list[tuple[str, str, str]]:
    """One row per key of ``keys`` (the missing target keys, or the unexpected checkpoint keys),
    except where several lie in a subtree that holds nothing else of their side: that subtree is
    one row with its count. A parameters-only restore leaves a whole optimizer state on disk;
    the table says so in one line, and keeps every key that sits beside a loaded one."""
    if len(keys) < 2:
        return [(join_key(key, sep), status, "") for key in keys]
    alone = set(keys)
    depth = max(map(len, keys))
    shared = {key[:i] for key in side if key not in alone for i in range(1, min(len(key), depth + 1))}
    groups: dict[KeyPath, list[KeyPath]] = {}
    for key in keys:
        top = next((key[:i] for i in range(1, len(key)) if key[:i] not in shared), key)
        groups.setdefault(top, []).append(key)
    return [(join_key(members[0], sep), status, "") if len(members) == 1
            else (f"{join_key(top, sep)}{sep}*", status, f"{len(members)} keys")
            for top, members in groups.items()]


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    return f"{cells[0]:<{widths[0]}} | {cells[1]:<{widths[1]}} | {cells[2]}".rstrip()


def _shown(value: tuple, of_dtype: bool) -> str:
    return str(value[0]) if of_dtype else str(value)
