"""The planner's bulk paths: runs of keys, per-parent names, bulk-built ops and entries.

The planner matches run by run (keys that share a parent path) where runs are long and key by
key otherwise; both must give the same plan and the same error, which these tests check on
random layouts by forcing one way and then the other.
"""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from ckptshim.errors import CorruptCheckpointError, ShimError
from ckptshim.keytext import keys_text, runs_text
from ckptshim.inventory import Entry, Inventory
from ckptshim.ops import Rename, Stack, renames
from ckptshim.planner import plan, runs
from ckptshim.planner.names import Names
from ckptshim.rules import DEFAULT_RULES, Alias, Rules, ScanAxis
from ckptshim.rules.layers import layer_splits, parent_splits

# -- building blocks -----------------------------------------------------------------------------


def test_bulk_renames_are_the_renames_rename_makes():
    sources = [("_orig_mod", "layers", str(i), "w") for i in range(5)]
    targets = [key[1:] for key in sources]
    ops = renames(sources, targets)
    assert ops == [Rename(s, t) for s, t in zip(sources, targets)]
    assert [hash(op) for op in ops] == [hash(Rename(s, t)) for s, t in zip(sources, targets)]
    assert all(type(op) is Rename for op in ops)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ops[0].source = ("x",)  # type: ignore[misc]
    assert renames([], []) == []


def test_rename_and_entry_keep_their_dataclass_behaviour():
    op = Rename(source=("a",), target=("b",))
    assert op == Rename(("a",), ("b",)) and op.inverse() == Rename(("b",), ("a",))
    assert dataclasses.replace(op, target=("c",)) == Rename(("a",), ("c",))
    assert pickle.loads(pickle.dumps(op)) == op
    entry = Entry(key=("w",), shape=(2,), dtype="float32")
    assert entry.location is None
    assert dataclasses.replace(entry, shape=(3,)) == Entry(("w",), (3,), "float32")
    assert pickle.loads(pickle.dumps(entry)) == entry
    assert [f.name for f in dataclasses.fields(Entry)] == ["key", "shape", "dtype", "location"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.location = 1  # type: ignore[misc]


def test_inventory_from_a_generator_and_its_table():
    inv = Inventory(Entry(("l", str(i)), (i,), "float32") for i in range(3))
    assert list(inv) == [("l", "0"), ("l", "1"), ("l", "2")]
    assert inv.table[("l", "1")] is inv[("l", "1")]
    assert inv.table.get(("nope",)) is None
    with pytest.raises(TypeError):
        inv.table[("x",)] = Entry(("x",), (), "float32")  # type: ignore[index]
    with pytest.raises(CorruptCheckpointError, match=r"^g: key 'l\.0' appears twice"):
        Inventory((Entry(("l", str(i % 2)), (), "float32") for i in range(4)), "g")


def test_parent_splits_are_layer_splits_without_the_leaf():
    names = DEFAULT_RULES.layer_lists
    for key in [("decoder", "layers_3", "mlp", "w"), ("layers", "0", "experts", "1", "w"),
                ("layers", "w"), ("w",), (), ("layers", "3")]:
        assert [(s + key[-1:], i) for s, i in parent_splits(key[:-1], names)] == list(layer_splits(key, names))


ALIASES = (Alias(("attn",), ("self_attention",)), Alias((), ("params", "params"), "prefix"),
           Alias(("lm_head",), ("embed_out",), "prefix"),
           Alias((), ("value",), "suffix"),
           Alias(("kernel",), ("w",), "anywhere"), Alias(("a",), ("x", "b"), "anywhere"),
           Alias(("z",), (), "prefix"))
WORDS = ("layers", "layers_0", "0", "1", "w", "b", "x", "a", "value", "params", "embed_out",
         "self_attention", "kernel", "_orig_mod", "module")


def test_canonical_names_through_parents_are_the_per_key_ones():
    rnd = random.Random(0)
    keys = [tuple(rnd.choice(WORDS) for _ in range(rnd.randint(0, 5))) for _ in range(3000)]
    for count in range(len(ALIASES) + 1):
        names = Names(Rules(aliases=ALIASES[:count]))
        assert names.canonical_keys(keys) == [names.canonical_key(key) for key in keys]


# -- run by run and key by key agree -------------------------------------------------------------

LEAVES = ("w", "b", "kernel", "scale", "q", "value", "inv_freq", "extra")


def _layout(rnd: random.Random, layers: int, leaves: tuple[str, ...], name: str, shape, dtype,
            style: str):
    """One side: per-layer (in ``style``'s spelling) or stacked, maybe wrapped."""
    wrap = rnd.choice([(), (), ("_orig_mod",), ("module",), ("params", "params")])
    pre = ("decoder",)
    mid = rnd.choice([(), ("mlp",), ("self_attention",), ("attn",)])
    if rnd.random() < 0.4:
        axis = rnd.randint(0, len(shape))
        stacked = shape[:axis] + (layers,) + shape[axis:]
        entries = [Entry(wrap + pre + (name,) + mid + (leaf,), stacked, dtype) for leaf in leaves]
    else:
        entries = [Entry(wrap + pre + ((name, str(i)) if style == "torch" else (f"{name}_{i}",))
                         + mid + (leaf,), shape, dtype)
                   for i in range(layers) for leaf in leaves]
    return entries


def _perturb(rnd: random.Random, entries: list[Entry], name: str) -> None:
    for _ in range(rnd.choice([0, 0, 0, 1, 2, 3])):
        roll = rnd.random()
        if roll < 0.2 and entries:
            entries.pop(rnd.randrange(len(entries)))
        elif roll < 0.4 and entries:
            index = rnd.randrange(len(entries))
            entries[index] = dataclasses.replace(entries[index], shape=rnd.choice([(3,), (2, 2), ()]),
                                                 dtype=rnd.choice(["float32", "bfloat16", "int32"]))
        elif roll < 0.55 and entries:  # the same layer in the other spelling
            key = list(rnd.choice(entries).key)
            for at, part in enumerate(key):
                if part.startswith(name + "_"):
                    key[at:at + 1] = [name, part.rpartition("_")[2]]
                    break
                if part == name and at + 1 < len(key) and key[at + 1].isdigit():
                    key[at:at + 2] = [f"{name}_{key[at + 1]}"]
                    break
            entries.append(Entry(tuple(key), (2,), "float32"))
        elif roll < 0.8:
            entries.append(Entry(tuple(rnd.choice(WORDS) for _ in range(rnd.randint(1, 4))), (2,), "float32"))
        else:
            rnd.shuffle(entries)


def _experts(rnd: random.Random, shape) -> list[Entry]:
    """Experts inside layers: per expert, stacked per layer, stacked whole, or a mix."""
    entries = []
    for i in range(2):
        if rnd.random() < 0.5:
            entries += [Entry(("layers", str(i), "experts", str(j), "w"), shape, "float32") for j in range(2)]
        else:
            entries.append(Entry(("layers", str(i), "experts", "w"), (2,) + shape, "float32"))
    if rnd.random() < 0.5:
        entries.append(Entry(("layers", "experts", "w"), (2, 2) + shape, "float32"))
    return entries


def _case(rnd: random.Random):
    layers, name = rnd.randint(1, 4), rnd.choice(["layers", "h", "blocks", "stages"])
    leaves = tuple(rnd.sample(LEAVES, rnd.randint(1, 5)))
    shape, dtype = rnd.choice([(2,), (2, 3), (3, 3), ()]), rnd.choice(["float32", "bfloat16"])
    style = rnd.choice(["torch", "maxtext"])  # layers.{i} <-> layers_{i} is no promised mapping
    nested = rnd.choice([(), (), (), (), (2,), (2, 2)])
    sides = []
    for _ in range(2):
        entries = _layout(rnd, layers, leaves, name, shape, dtype, style)
        _perturb(rnd, entries, name)
        if nested:
            entries += _experts(rnd, nested)
        seen: set = set()
        sides.append(Inventory([e for e in entries if not (e.key in seen or seen.add(e.key))]))
    rules = DEFAULT_RULES.extend(
        aliases=ALIASES[:2] + tuple(rnd.sample(ALIASES[2:], rnd.choice([0, 0, 1, 2]))),
        scan_axes=[ScanAxis(name, rnd.randint(0, 2))] if rnd.random() < 0.3 else [],
        layer_lists=["stages"] if rnd.random() < 0.8 else [],
        synthesize=[rnd.choice(list(sides[1]))] if sides[1] and rnd.random() < 0.3 else [],
        strict=rnd.random() < 0.15, allow_cast=rnd.random() > 0.15)
    return sides[0], sides[1], rules


def _outcome(source, target, rules):
    try:
        p = plan(source, target, rules)
    except ShimError as error:
        return type(error).__name__, str(error)
    return p.ops, p.missing, p.unexpected, p.mismatched


def test_run_by_run_and_key_by_key_plan_alike(monkeypatch):
    rnd = random.Random(20261121)
    kinds = {"complete": 0, "partial": 0, "refused": 0}
    for _ in range(800):
        source, target, rules = _case(rnd)
        monkeypatch.setattr(runs, "MIN_RUN", 1)  # runs wherever names allow
        by_run = _outcome(source, target, rules)
        monkeypatch.setattr(runs, "MIN_RUN", 10**9)  # never runs
        by_key = _outcome(source, target, rules)
        assert by_run == by_key, (list(source.values()), list(target.values()), rules)
        kinds["refused" if isinstance(by_key[0], str) else
              "complete" if not any(by_key[1:]) else "partial"] += 1
    assert min(kinds.values()) > 50, kinds  # not vacuous: all three outcomes are common


# -- the bench's shapes, small ---------------------------------------------------------------------


def _per_layer(layers: int, leaves: int, prefix=()):
    return Inventory(Entry(prefix + ("decoder", f"layers_{i}", "block", f"w{j}"), (2, 5), "float32")
                     for i in range(layers) for j in range(leaves))


def _stacked(layers: int, leaves: int):
    return Inventory(Entry(("decoder", "layers", "block", f"w{j}"), (2, layers, 5), "float32")
                     for j in range(leaves))


def test_wide_layers_stack_and_unstack_run_by_run(monkeypatch):
    calls = []
    monkeypatch.setattr(runs, "layer_groups", lambda *a, _f=runs.layer_groups: calls.append(1) or _f(*a))
    per_layer, stacked = _per_layer(3, 12), _stacked(3, 12)
    p = plan(per_layer, stacked)
    assert p.complete and calls
    assert p.ops == tuple(Stack(tuple(("decoder", f"layers_{i}", "block", f"w{j}") for i in range(3)),
                                ("decoder", "layers", "block", f"w{j}"), 1) for j in range(12))
    q = plan(stacked, per_layer)
    assert q.complete and q.ops == tuple(op.inverse() for op in p.ops)
    assert q.producer(("decoder", "layers_2", "block", "w5")) is q.ops[5]


def test_wide_renames_run_by_run_keep_target_order():
    source = _per_layer(3, 10, prefix=("_orig_mod",))
    target = Inventory(reversed(list(_per_layer(3, 10).values())))
    p = plan(source, target)
    assert p.complete
    assert p.ops == tuple(Rename(("_orig_mod",) + key, key) for key in target)


def test_wide_layers_with_a_missing_layer_are_refused_alike(monkeypatch):
    source = Inventory(e for e in _per_layer(4, 10).values() if e.key[1] != "layers_2")
    for min_run in (1, 10**9):
        monkeypatch.setattr(runs, "MIN_RUN", min_run)
        with pytest.raises(ShimError, match=r"checkpoint has layers \{0\.\.1,3\} of "
                                            r"'decoder\.layers\.block\.w0' but not \{2\}"):
            plan(source, _stacked(4, 10))


def test_runs_of_layers_that_differ_in_one_span_of_one_name_are_one_key():
    """A fused array's parts over every layer read as one key; a span of digits stays listed
    (``w{1,3}`` would read as a range), and so do runs that differ in more than one place."""
    qkv = [("model", "layers", str(i), "self_attn", f"{p}_proj", "weight") for i in range(3) for p in "qkv"]
    assert keys_text(qkv) == "model.layers.{0..2}.self_attn.{q,k,v}_proj.weight"
    experts = [[("experts", str(e), w, "weight") for e in range(4)] for w in ("w1", "w3")]
    assert runs_text(experts) == "experts.{0..3}.w1.weight, experts.{0..3}.w3.weight"
    assert runs_text([[("m", "0", f"{p}_proj")] for p in ("gate", "up")]) == "m.0.{gate,up}_proj"
    apart = [("a", str(i), p, "x" if p == "q" else "y") for i in range(2) for p in ("q", "k")]
    assert keys_text(apart) == "a.{0..1}.q.x, a.{0..1}.k.y"
