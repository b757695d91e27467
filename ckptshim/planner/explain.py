"""Plans in words: a few lines per plan, layer ranges compressed, and a one-line summary.

``decoder/layers_{0..95}/mlp/wi/kernel -> stack(axis=1) -> decoder/layers/mlp/wi/kernel`` says
in one line what 96 ops do: each op describes itself (:mod:`ckptshim.ops`), and lines that
differ only in one number are merged into a range.
"""

from __future__ import annotations

from collections import Counter

from ckptshim.inventory import join_key
from ckptshim.keytext import compress
from ckptshim.planner.plan import Plan


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
        if by_example[word]:
            text = shown[0] + (", ..." if len(shown) > 1 else "")
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
