"""Property tests: a plan is either refused or, executed, gives every target exactly its value.

Random trees are laid out twice -- as a checkpoint ("source") and as what a model wants
("target") -- with wrapper components inserted at random depths on either side, layer lists
written per layer (``layers.{i}`` or ``layers_{i}``) or stacked along one axis, lossless dtype
widenings, a derivable buffer only the checkpoint has and a buffer only the target has. A tiny
numpy executor written here gives the plan's ops their meaning; the result must equal the
intended target bit for bit, and the inverse plan must give back the checkpoint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckptshim.errors import ShimError
from ckptshim.inventory import Entry, Inventory, KeyPath
from ckptshim.execute import blocks
from ckptshim.ops import (Cast, Chunk, Concat, Drop, DropIfDerived, Join, Rename, Reorder, Reshape, Split, Stack,
                          Synthesize, Transpose, Unstack)
from ckptshim.planner import Plan, explain, plan, summary
from ckptshim.rules import DEFAULT_RULES, Rules, ScanAxis
from support.plans import inverse

NAMES = ("a", "b", "c", "w", "kernel", "scale")
LIST_NAMES = ("layers", "h", "blocks")
WRAPPERS = ("_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
#: dtype -> dtypes it widens to without losing a bit (so the inverse can cast back exactly).
WIDENINGS = {
    "float16": ("float32", "float64"),
    "float32": ("float64",),
    "float64": (),
    "int8": ("int16", "int32", "int64", "float32"),
    "int16": ("int32", "int64", "float32"),
    "int32": ("int64", "float64"),
    "int64": (),
    "uint8": ("uint16", "int16", "float16"),
}
STYLES = ("torch", "maxtext", "stacked")


# -- the executor under test's contract ---------------------------------------------------------


def execute(p: Plan, arrays: dict[KeyPath, np.ndarray]) -> dict[KeyPath, np.ndarray]:
    """What any executor must do with a plan, in a few lines of numpy, in op order.

    Each Cast must come after the op that produces its key, and no key is cast twice.
    """
    out: dict[KeyPath, np.ndarray] = {}
    cast: set[KeyPath] = set()
    for op in p.ops:
        if isinstance(op, Rename):
            out[op.target] = arrays[op.source].copy()
        elif isinstance(op, Stack):
            out[op.target] = np.stack([arrays[k] for k in op.sources], axis=op.axis)
        elif isinstance(op, Unstack):
            for i, key in enumerate(op.targets):
                out[key] = np.take(arrays[op.source], i, axis=op.axis)
        elif isinstance(op, Transpose):
            out[op.target] = np.transpose(arrays[op.source], op.perm).copy()
        elif isinstance(op, Split):
            whole = arrays[op.source]
            for key, index in zip(op.targets, _indices(whole.shape, op.axes)):
                out[key] = np.transpose(whole[index], op.perm).copy()
        elif isinstance(op, Join):
            shape = p.target[op.target].shape
            whole = np.empty(shape, arrays[op.sources[0]].dtype)
            for key, index in zip(op.sources, _indices(shape, op.axes)):
                whole[index] = np.transpose(arrays[key], op.perm)
            out[op.target] = whole
        elif isinstance(op, Concat):
            parts = np.split(np.array(op.sources, dtype=object), len(op.sizes))
            fused = [np.stack([arrays[tuple(k)] for k in part], axis=op.stack_axis) if op.stack_axis is not None
                     else arrays[tuple(part[0])] for part in parts]
            out[op.target] = np.concatenate(fused, axis=op.axis)
        elif isinstance(op, Chunk):
            whole = arrays[op.source]
            parts = np.split(whole, np.cumsum(op.sizes)[:-1], axis=op.axis)
            per_part = len(op.targets) // len(op.sizes)
            for index, key in enumerate(op.targets):
                part = parts[index // per_part]
                out[key] = (part if op.stack_axis is None else np.take(part, index % per_part, axis=op.stack_axis)).copy()
        elif isinstance(op, Reorder):
            whole = arrays[op.source]
            shape = whole.shape
            factored = whole.reshape(shape[:op.axis] + op.factors + shape[op.axis + 1:])
            axes = list(range(factored.ndim))
            axes[op.axis:op.axis + len(op.order)] = [op.axis + o for o in op.order]
            out[op.target] = np.transpose(factored, axes).reshape(shape).copy()
        elif isinstance(op, Reshape):
            stacked = np.stack([arrays[k] for k in op.sources]) if len(op.sources) > 1 else arrays[op.sources[0]]
            whole = stacked.reshape(op.factors).transpose(op.perm).reshape(op.shape)
            for index, key in enumerate(op.targets):
                out[key] = (whole[index] if len(op.targets) > 1 else whole).copy()
        elif isinstance(op, Cast):
            assert op.target in out and op.target not in cast, op
            assert out[op.target].dtype.name == op.source_dtype, op
            cast.add(op.target)
            out[op.target] = out[op.target].astype(op.target_dtype)
        elif not isinstance(op, (Synthesize, Drop, DropIfDerived)):  # pragma: no cover - a new kind of op
            raise AssertionError(f"unknown op {op!r}")
    return out


def _indices(shape: tuple[int, ...], axes: tuple[int, ...]) -> list[tuple]:
    """Numpy indices fixing ``axes`` at every value, in row-major order (Split/Join's order)."""
    out = []
    for at in np.ndindex(*(shape[a] for a in axes)):
        index = [slice(None)] * len(shape)
        for axis, i in zip(axes, at):
            index[axis] = i
        out.append(tuple(index))
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).reshape(-1).view(np.uint8),
        np.ascontiguousarray(b).reshape(-1).view(np.uint8)))


# -- random cases -------------------------------------------------------------------------------


@dataclass
class Side:
    entries: list[Entry] = field(default_factory=list)
    arrays: dict[KeyPath, np.ndarray] = field(default_factory=dict)

    def add(self, key: KeyPath, array: np.ndarray) -> None:
        assert key not in self.arrays, key
        self.entries.append(Entry(key, array.shape, array.dtype.name))
        self.arrays[key] = array


class Case:
    """Both layouts of one random tree (a plain class, so hypothesis prints our short repr)."""

    def __init__(self, source: Side, target: Side, rules: Rules,
                 synthesized: frozenset[KeyPath], dropped: frozenset[KeyPath]) -> None:
        self.source, self.target, self.rules = source, target, rules
        self.synthesized, self.dropped = synthesized, dropped

    def __repr__(self) -> str:
        def side(entries):
            return "\n".join(f"    {'.'.join(e.key)} {e.shape} {e.dtype}" for e in entries)
        return (f"Case(\n  source:\n{side(self.source.entries)}\n  target:\n{side(self.target.entries)}"
                f"\n  scan_axes={self.rules.scan_axes})")

    def inventories(self) -> tuple[Inventory, Inventory]:
        return Inventory(self.source.entries, "source"), Inventory(self.target.entries, "target")


def _values(rnd: random.Random, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(rnd.getrandbits(32))
    if dtype.startswith("float"):
        array = rng.standard_normal(shape).astype(dtype)
        flat = array.reshape(-1)
        for special in (np.nan, np.inf, -0.0):  # odd bit patterns must survive too
            if flat.size and rnd.random() < 0.2:
                flat[rnd.randrange(flat.size)] = special
        return array
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)


def _wrap(rnd: random.Random, key: KeyPath, top: tuple[str, ...]) -> KeyPath:
    """The key with a side's top-level wrappers and, sometimes, wrappers at random depths."""
    key = top + key
    for _ in range(2):
        if rnd.random() < 0.25:
            pos = rnd.randrange(len(key))  # never after the leaf name
            key = key[:pos] + (rnd.choice(WRAPPERS),) + key[pos:]
    return key


_path = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map(tuple)
_shape = st.lists(st.integers(1, 4), max_size=3).map(tuple)
_dtype_pair = st.sampled_from(sorted(WIDENINGS)).flatmap(
    lambda d: st.tuples(st.just(d), st.sampled_from((d, d, d) + WIDENINGS[d])))


@st.composite
def cases(draw) -> Case:
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))  # values, wrapper depths, order
    plain = draw(st.lists(st.tuples(_path, _shape, _dtype_pair), max_size=4,
                          unique_by=lambda t: t[0]))
    lists = draw(st.lists(
        st.tuples(
            st.lists(st.sampled_from(NAMES), max_size=2).map(tuple),       # where the list sits
            st.sampled_from(LIST_NAMES),                                     # its name
            st.integers(1, 4),                                               # how many layers
            st.lists(st.tuples(st.lists(st.sampled_from(NAMES), min_size=1, max_size=2).map(tuple),
                               _shape, _dtype_pair),
                     min_size=1, max_size=3, unique_by=lambda t: t[0]),      # per-layer leaves
            st.sampled_from(STYLES), st.sampled_from(STYLES),                # source, target style
            st.integers(0, 3),                                               # stacking axis
        ),
        min_size=1, max_size=2, unique_by=lambda t: (t[0], t[1])))
    tops = (draw(st.lists(st.sampled_from(WRAPPERS), max_size=2).map(tuple)),
            draw(st.lists(st.sampled_from(WRAPPERS), max_size=2).map(tuple)))
    with_buffer, with_synth, with_rule = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())

    source, target = Side(), Side()
    for path, shape, (src_dtype, tgt_dtype) in plain:
        value = _values(rnd, shape, src_dtype)
        source.add(_wrap(rnd, path, tops[0]), value)
        target.add(_wrap(rnd, path, tops[1]), value.astype(tgt_dtype))

    scan_axes = []
    for prefix, name, count, leaves, src_style, tgt_style, axis in lists:
        if src_style != "stacked" and tgt_style != "stacked":
            tgt_style = src_style  # layers.{i} <-> layers_{i} is not a promised mapping
        axis = min(axis, min(len(shape) for _, shape, _ in leaves))  # one axis per list
        if with_rule and len(lists) == 1:
            scan_axes.append(ScanAxis(name, axis))
        for rel, shape, (src_dtype, tgt_dtype) in leaves:
            layers = [_values(rnd, shape, src_dtype) for _ in range(count)]
            for side, style, dtype, top in ((source, src_style, src_dtype, tops[0]),
                                            (target, tgt_style, tgt_dtype, tops[1])):
                if style == "stacked":
                    side.add(_wrap(rnd, prefix + (name,) + rel, top),
                             np.stack(layers, axis=axis).astype(dtype))
                    continue
                for i, value in enumerate(layers):
                    index = (name, str(i)) if style == "torch" else (f"{name}_{i}",)
                    side.add(_wrap(rnd, prefix + index + rel, top), value.astype(dtype))

    dropped: set[KeyPath] = set()
    if with_buffer:
        key = _wrap(rnd, ("rotary_emb", "inv_freq"), tops[0])
        source.add(key, _values(rnd, (2,), "float32"))
        dropped.add(key)
    synthesized: set[KeyPath] = set()
    if with_synth:
        key = _wrap(rnd, ("counter",), tops[1])
        target.add(key, _values(rnd, (), "int64"))
        synthesized.add(key)

    for side in (source, target):  # checkpoints and models list keys in any order
        rnd.shuffle(side.entries)
    rules = DEFAULT_RULES.extend(scan_axes=scan_axes, synthesize=synthesized)
    return Case(source, target, rules, frozenset(synthesized), frozenset(dropped))


# -- the properties -----------------------------------------------------------------------------


def check_case(case: Case) -> Plan | None:
    """Plan ``case``; return None when refused, else check the plan and return it."""
    source, target = case.inventories()
    try:
        p = plan(source, target, case.rules)
    except ShimError as error:
        event(f"refused: {str(error).split(':')[0][:40]}")
        return None
    event("planned")
    assert p.complete, "\n".join(explain(p))
    explain(p), summary(p)  # must not raise

    # Every target key has exactly one producer; only the synthesized ones are synthesized.
    for key in target:
        producer = p.producer(key)
        assert producer is not None, key
        assert isinstance(producer, Synthesize) == (key in case.synthesized), (key, producer)
    assert {op.source for op in p.ops if isinstance(op, (Drop, DropIfDerived))} == case.dropped

    # Never mis-maps: executed, the plan gives each target key exactly its intended value.
    out = execute(p, case.source.arrays)
    wanted = {k: v for k, v in case.target.arrays.items() if k not in case.synthesized}
    assert set(out) == set(wanted)
    for key, value in wanted.items():
        assert same_bits(out[key], value), (key, "\n".join(explain(p)))

    # The inverse plan maps the target back onto the checkpoint.
    q = inverse(p)
    assert q.complete
    assert q.source is target and q.target is source
    back = execute(q, case.target.arrays)
    original = {k: v for k, v in case.source.arrays.items() if k not in case.dropped}
    assert set(back) == set(original)
    for key, value in original.items():
        assert same_bits(back[key], value), (key, "\n".join(explain(q)))
    assert {op.target for op in q.ops if isinstance(op, Synthesize)} == case.dropped
    return p


def test_plan_never_mis_maps_and_inverts():
    outcomes: list[str] = []

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(cases())
    def run(case):
        p = check_case(case)
        if p is None:
            outcomes.append("refused")
        elif any(isinstance(op, (Stack, Unstack)) for op in p.ops):
            outcomes.append("stacked")
        else:
            outcomes.append("planned")

    run()
    # Guard against a vacuous property: most cases must plan, and many of them must stack.
    assert outcomes.count("refused") < len(outcomes) // 2, outcomes.count("refused")
    assert outcomes.count("stacked") > len(outcomes) // 5, outcomes.count("stacked")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_is_deterministic_and_order_of_source_does_not_matter(case):
    source, target = case.inventories()
    try:
        first = plan(source, target, case.rules)
    except ShimError:
        return
    again = plan(Inventory(reversed(list(source.values()))), target, case.rules)
    assert [op for op in again.ops if not isinstance(op, (Drop, DropIfDerived))] == \
        [op for op in first.ops if not isinstance(op, (Drop, DropIfDerived))]
    assert set(again.ops) == set(first.ops)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_swapping_source_and_target_plans_the_same_mapping(case):
    """plan(target, source) exists whenever plan(source, target) does (up to buffers) and
    moves every value back to where the inverse does."""
    source, target = case.inventories()
    rules = DEFAULT_RULES.extend(scan_axes=case.rules.scan_axes)
    try:
        plan(source, target, rules)
    except ShimError:
        return
    try:
        backward = plan(target, source, rules)
    except ShimError:
        pytest.fail("forward plan exists but the swapped one is refused")
    back = execute(backward, case.target.arrays)
    for key, value in case.source.arrays.items():
        if key in case.dropped:
            assert key in backward.missing
            continue
        assert same_bits(back[key], value), key
    assert set(backward.unexpected) == set(case.synthesized)
    assert not backward.mismatched


# -- layout ops: transposes, splits and joins ---------------------------------------------------


class NumpySource:
    """A checkpoint held as numpy arrays, read the way the JAX executor reads a real one."""

    path = "numpy"

    def __init__(self, arrays: dict[KeyPath, np.ndarray]) -> None:
        self.arrays = arrays

    def read_into(self, entry: Entry, index: tuple, out: np.ndarray) -> None:
        np.copyto(out, self.arrays[entry.key][index], casting="unsafe")


@st.composite
def layout_plans(draw) -> tuple[Plan, dict[KeyPath, np.ndarray]]:
    """One random Transpose, Split, Chunk, Reorder or Reshape (or their inverses: Transpose, Join,
    Concat, Reorder, Reshape), maybe with a widening cast of every target (the parts of one array
    share a dtype), and the source arrays."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    dtype = draw(st.sampled_from(["float32", "int16", "uint8"]))
    whole = _values(random.Random(draw(st.integers(0, 2**32 - 1))), shape, dtype)
    kind = draw(st.sampled_from(["transpose", "split", "chunk", "reorder", "reshape"]))
    if kind == "split" and len(shape) > 1:
        axes = tuple(sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape) - 1))))
        perm = tuple(draw(st.permutations(range(len(shape) - len(axes)))))
        count = int(np.prod([shape[a] for a in axes]))
        op = Split(("w",), tuple((f"part_{i}",) for i in range(count)), axes, perm)
        parts = {key: np.transpose(whole[index], perm) for key, index in zip(op.targets, _indices(shape, axes))}
    elif kind == "chunk" and len(shape) > 1:
        op = draw(chunks(shape))
        parts = execute(Plan(Inventory([Entry(("w",), shape, dtype)], "s"), Inventory([], "t"), (op,)),
                        {("w",): whole})
    elif kind == "reorder":
        axis = draw(st.integers(0, len(shape) - 1))
        factors = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
        shape = shape[:axis] + (int(np.prod(factors)),) + shape[axis + 1:]
        whole = _values(random.Random(draw(st.integers(0, 2**32 - 1))), shape, dtype)
        op = Reorder(("w",), ("t",), axis, factors, tuple(draw(st.permutations(range(len(factors))))))
        parts = execute(Plan(Inventory([Entry(("w",), shape, dtype)], "s"), Inventory([], "t"), (op,)),
                        {("w",): whole})
    elif kind == "reshape":
        op = draw(reshapes())
        shape = op.source_shape
        whole = _values(random.Random(draw(st.integers(0, 2**32 - 1))), shape, dtype)
        parts = execute(Plan(Inventory([Entry(("w",), shape, dtype)], "s"), Inventory([], "t"), (op,)),
                        {("w",): whole})
    else:
        op = Transpose(("w",), ("t",), tuple(draw(st.permutations(range(len(shape))))))
        parts = {("t",): np.transpose(whole, op.perm)}
    widen = draw(st.sampled_from(WIDENINGS[dtype] or (dtype,)))
    casts = tuple(Cast(key, dtype, widen) for key in parts) if widen != dtype and draw(st.booleans()) else ()
    cast = {c.target for c in casts}
    target = Inventory([Entry(k, v.shape, widen if k in cast else dtype) for k, v in parts.items()], "target")
    p = Plan(Inventory([Entry(("w",), shape, dtype)], "source"), target, (op,) + casts)
    if draw(st.booleans()):  # the other direction: a Join (or Transpose) of the parts
        arrays = {k: v.astype(widen) if k in cast else v for k, v in parts.items()}
        return inverse(p), arrays
    return p, {("w",): whole}


@st.composite
def reshapes(draw) -> Reshape:
    """A Reshape of one array: its axes split into random factors, the factors permuted and
    grouped into the target's axes -- maybe the leading factor on its own, several targets."""
    factors = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=5)))
    perm = tuple(draw(st.permutations(range(len(factors)))))
    several = len(factors) > 1 and factors[perm[0]] > 1 and draw(st.booleans())
    source_shape = _grouped(factors, draw(st.lists(st.booleans(), min_size=len(factors), max_size=len(factors))))
    moved = tuple(factors[p] for p in perm)
    cuts = draw(st.lists(st.booleans(), min_size=len(factors), max_size=len(factors)))
    if several:  # target k is [k] of the permuted factors: the leading one an axis of its own
        cuts[1] = True
    shape = _grouped(moved, cuts)
    targets = tuple((f"part_{k}",) for k in range(shape[0])) if several else (("t",),)
    return Reshape((("w",),), targets, source_shape, factors, perm, shape)


def _grouped(factors: tuple[int, ...], cuts: list[bool]) -> tuple[int, ...]:
    """``factors`` multiplied into axes, a new axis starting wherever ``cuts`` says (and at 0)."""
    shape: list[int] = []
    for factor, cut in zip(factors, cuts):
        if cut or not shape:
            shape.append(factor)
        else:
            shape[-1] *= factor
    return tuple(shape)


@st.composite
def chunks(draw, shape: tuple[int, ...]) -> Chunk:
    """A Chunk of an array of ``shape``: cut along one axis into parts, maybe each part then
    unstacked along another axis (fused experts back into per-expert arrays)."""
    axis, stack_axis = draw(st.permutations(range(len(shape))))[:2]
    stacked = draw(st.booleans())
    cuts = sorted(draw(st.sets(st.integers(1, shape[axis] - 1), max_size=3))) if shape[axis] > 1 else []
    sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, shape[axis]]))
    per_part = shape[stack_axis] if stacked else 1
    return Chunk(("w",), tuple((f"part_{i}",) for i in range(len(sizes) * per_part)), axis, sizes,
                 stack_axis if stacked else None)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_plans(), st.data())
def test_layout_ops_execute_invert_and_read_by_block(drawn, data):
    """Every layout op, executed by numpy and inverted, gives back its source bit for bit; the JAX
    executor's block reads (one device's index range) give exactly that block of numpy's result;
    and the torch executor writes exactly numpy's result, through views of each destination."""
    p, arrays = drawn
    out = execute(p, arrays)
    assert set(out) == set(p.target)
    back = execute(inverse(p), out)
    assert set(back) == set(arrays) and all(same_bits(back[k], v) for k, v in arrays.items())
    assert inverse(inverse(p)).ops == p.ops
    explain(p), summary(p)  # must not raise
    for key, value in out.items():
        bounds = [sorted(data.draw(st.tuples(st.integers(0, n), st.integers(0, n)))) for n in value.shape]
        block = tuple(slice(a, b) for a, b in bounds)
        read = blocks.filler(NumpySource(arrays), p, p.producer(key), key, value.shape, value.dtype)(block)
        assert same_bits(read, value[block]), (key, block, p.producer(key))
    written = torch_execute(p, arrays)
    assert all(same_bits(written[key], value) for key, value in out.items())


def torch_execute(p: Plan, arrays: dict[KeyPath, np.ndarray]) -> dict[KeyPath, np.ndarray]:
    """``p`` run by the torch executor into zeroed destinations."""
    import torch

    from ckptshim.execute.torch import prepare

    destinations = {key: torch.zeros(entry.shape, dtype=getattr(torch, entry.dtype)) for key, entry in p.target.items()}
    prepare(p, lambda key: torch.from_numpy(arrays[key]), destinations).write()
    return {key: tensor.numpy() for key, tensor in destinations.items()}


def test_layout_ops_in_words():
    """Transposes, splits and joins read compactly in the plan summary and explanation."""
    source = Inventory([Entry(("w",), (2, 3, 4), "float32"), Entry(("qkv",), (2, 3, 4), "float32")], "s")
    split = Split(("qkv",), (("q",), ("k",), ("v",)), (1,), (1, 0))
    target = Inventory([Entry(("t",), (3, 2, 4), "float32")] + [Entry(k, (4, 2), "float32") for k in split.targets], "t")
    p = Plan(source, target, (Transpose(("w",), ("t",), (1, 0, 2)), split))
    assert summary(p) == "1 transposed (perm 1,0,2), 3 split (axes 1; perm 1,0)"
    assert explain(p, "/") == ["w -> transpose(perm 1,0,2) -> t", "qkv -> split(axes 1; perm 1,0) -> q, k, v"]
    assert summary(inverse(p)) == "1 transposed (perm 1,0,2), 3 joined (axes 1; perm 1,0)"
    with pytest.raises(ValueError, match="not a permutation"):
        Transpose(("w",), ("t",), (0, 0, 1))
    with pytest.raises(ValueError, match="ascending"):
        Split(("w",), (), (1, 0), (0,))
