"""The ``Reshape`` and ``Scale`` op kinds: their algebra, their block reads, the torch executor's
writes of a ``Reshape`` through views, and the executors that refuse them by name.

A ``Reshape`` is checked against numpy's own ``reshape(factors).transpose(perm).reshape(shape)``
on every random block of a real safetensors file -- the Llama query of MaxText's converter
(transpose, head split, rotary halves interleaved, three layers stacked on axis 1) and its
inverse (one stacked array back into per-layer tensors), read both from a format that reads
factored shapes itself and from one that cannot (the range of unsplit axes, then the box).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import torch

from ckptshim.errors import PlanError
from ckptshim.execute import blocks
from ckptshim.inventory import Entry, Inventory
from ckptshim.ops import Rename, Reshape, Scale, axis_groups, float32, require_kinds, rsqrt_float32
from ckptshim.planner import Plan, explain, summary

L, H, D, E = 3, 4, 12, 8
LAYERS = tuple((f"q{layer}",) for layer in range(L))
#: [L, H*D, E] as [L, H, 2, D/2, E] -> [E, L, H, D/2, 2] = [E, L, H, D]
QUERY = Reshape(LAYERS, (("query",),), (L, H * D, E), (L, H, 2, D // 2, E), (4, 0, 1, 3, 2), (E, L, H, D))


def test_the_inverse_undoes_it_and_both_explain_themselves():
    assert QUERY.inverse().inverse() == QUERY
    assert QUERY.inverse().target_factors == QUERY.factors
    assert QUERY.describe("/") == "q{0..2} -> reshape(3x48x8 as 3x4x2x6x8, perm 4,0,1,3,2, to 8x3x4x12) -> query"
    plan = Plan(Inventory([], "a"), Inventory([], "b"), (QUERY,))
    assert summary(plan) == "1 reshaped (3x48x8 as 3x4x2x6x8, perm 4,0,1,3,2, to 8x3x4x12)"
    assert explain(plan) == [QUERY.describe(".")]


def test_factors_must_split_both_sides_row_major():
    assert axis_groups((2, 3, 4), (6, 4)) == [range(0, 2), range(2, 3)]
    assert axis_groups((2, 3, 4), (4, 6)) is None
    with pytest.raises(ValueError, match="do not split the source shape"):
        Reshape((("a",),), (("b",),), (6, 4), (4, 6), (1, 0), (6, 4))
    with pytest.raises(ValueError, match="3 sources must be the leading axis"):
        Reshape(LAYERS, (("b",),), (48, 3, 8), (48, 3, 8), (0, 1, 2), (48, 3, 8))


def test_scale_factors_are_the_converters_float32_numbers():
    assert rsqrt_float32(12) == float(np.float32(1 / np.sqrt(12)))
    assert float32(np.sqrt(12)) == float(np.float32(np.sqrt(12)))
    scale = Scale((("q",),), (("k",),), rsqrt_float32(12), float32(np.sqrt(12)), "bfloat16", "why")
    assert scale.inverse() == Scale((("k",),), (("q",),), float32(np.sqrt(12)), rsqrt_float32(12), "bfloat16", "why")


def test_scale_multiplies_in_float32_and_rounds_to_its_dtype():
    values = np.random.default_rng(1).standard_normal(64).astype(ml_dtypes.bfloat16)
    out = values.astype(np.float32)  # a float32 target of bfloat16 weights
    blocks.apply_scale(Scale((("q",),), (("q",),), rsqrt_float32(12), 0.0, "bfloat16"), out)
    converter = (values.astype(np.float32) * np.float32(1 / np.sqrt(12))).astype(ml_dtypes.bfloat16)
    assert np.array_equal(out, converter.astype(np.float32))


class _NotRowMajor:
    """A checkpoint that reads only its arrays' own shapes (as a chunked format does)."""

    def __init__(self, checkpoint) -> None:
        self.path, self._checkpoint = checkpoint.path, checkpoint

    def read_into(self, entry, index, out):
        assert entry.shape == self._checkpoint.inventory[entry.key].shape, "asked for a factored shape"
        return self._checkpoint.read_into(entry, index, out)


def _blocks(shape, rng, count=60):
    for _ in range(count):
        index = []
        for n in shape:
            start = int(rng.integers(0, n))
            index.append(slice(start, int(rng.integers(start + 1, n + 1))))
        yield tuple(index)


@pytest.fixture
def layers(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    arrays = {f"q{layer}": rng.standard_normal((H * D, E)).astype(np.float32) for layer in range(L)}
    save_file(arrays, tmp_path / "q.safetensors")
    return arrays, tmp_path / "q.safetensors"


def test_every_block_reads_what_numpy_computes(layers, tmp_path):
    from safetensors.numpy import save_file

    from ckptshim.formats.detect import open_checkpoint

    arrays, path = layers
    stacked = np.stack([arrays[f"q{layer}"] for layer in range(L)])
    whole = stacked.reshape(QUERY.factors).transpose(QUERY.perm).reshape(QUERY.shape)
    halves = [a.T.reshape(E, H, D) for a in arrays.values()]  # the converter's reshape, then adjust_rope
    assert np.array_equal(whole, np.stack([np.stack([h[..., :D // 2], h[..., D // 2:]], -1).reshape(h.shape)
                                            for h in halves], axis=1))
    rng = np.random.default_rng(2)
    checkpoint = open_checkpoint(path)
    plan = Plan(checkpoint.inventory, Inventory([Entry(("query",), QUERY.shape, "float32")], "t"), (QUERY,))
    fill = blocks.filler(checkpoint, plan, QUERY, ("query",), QUERY.shape, np.dtype(np.float32))
    for index in _blocks(QUERY.shape, rng):
        assert np.array_equal(fill(index), whole[index]), index

    save_file({"query": whole}, tmp_path / "t.safetensors")
    stored = open_checkpoint(tmp_path / "t.safetensors")
    back = QUERY.inverse()
    plan = Plan(stored.inventory, Inventory([Entry(key, (H * D, E), "float32") for key in LAYERS], "q"), (back,))
    for source in (stored, _NotRowMajor(stored)):
        for layer, key in enumerate(LAYERS):
            fill = blocks.filler(source, plan, back, key, (H * D, E), np.dtype(np.float32))
            for index in _blocks((H * D, E), rng, 20):
                assert np.array_equal(fill(index), arrays[f"q{layer}"][index]), (key, index)


def test_the_torch_executor_runs_a_reshape_through_views_both_ways():
    """Per-layer sources into one stacked target, and back: each written through a view of its
    destination, equal to numpy's reshape/transpose."""
    from ckptshim.execute.torch import prepare

    rng = np.random.default_rng(4)
    layers = {key: torch.from_numpy(rng.standard_normal((H * D, E)).astype(np.float32)) for key in LAYERS}
    stacked = np.stack([layers[key].numpy() for key in LAYERS])
    want = stacked.reshape(QUERY.factors).transpose(QUERY.perm).reshape(QUERY.shape)
    plan = Plan(Inventory([Entry(k, (H * D, E), "float32") for k in LAYERS], "ckpt"),
                Inventory([Entry(("query",), QUERY.shape, "float32")], "model"), (QUERY,))
    destination = torch.zeros(QUERY.shape)
    prepare(plan, layers.__getitem__, {("query",): destination}).write()
    assert np.array_equal(destination.numpy(), want)

    back = QUERY.inverse()
    plan = Plan(plan.target, plan.source, (back,))
    destinations = {key: torch.zeros(H * D, E) for key in LAYERS}
    prepare(plan, {("query",): torch.from_numpy(want)}.__getitem__, destinations).write()
    assert all(np.array_equal(destinations[key].numpy(), layers[key].numpy()) for key in LAYERS)


def test_the_torch_executor_and_the_dcp_planner_refuse_what_they_do_not_run():
    """A ``Scale`` by the torch executor and by DCP's load planner (their writes are copies, not
    arithmetic): by name, before anything is read. A ``Reshape`` is a layout op, which both run
    through its geometry (DCP as the box maps of each stored chunk: ``test_dcp_layouts``)."""
    from ckptshim.execute.torch import prepare

    scale = Scale((("q0",),), (("query",),), 0.5, 2.0, "float32", "why")
    plan = Plan(Inventory([Entry(("q0",), (4,), "float32")], "ckpt"), Inventory([Entry(("query",), (4,), "float32")], "m"),
                (Rename(("q0",), ("query",)), scale))
    with pytest.raises(PlanError, match=re.escape(f"`{scale.describe('.')}` is a 'scale' op, which the torch executor")):
        prepare(plan, lambda key: torch.ones(4), {("query",): torch.zeros(4)})
    from ckptshim.execute.dcp_virtual import VIRTUAL

    with pytest.raises(PlanError, match=re.escape(f"`{scale.describe('.')}` is a 'scale' op, which the DCP load")):
        require_kinds([scale], VIRTUAL, "DCP load planner")
    require_kinds([QUERY, QUERY.inverse()], VIRTUAL, "DCP load planner")  # layout ops: no refusal


def test_a_safetensors_range_read_into_a_view_goes_through_bounded_buffers(tmp_path, monkeypatch):
    """A contiguous range read into a transposed view (or cast) is one range read per part of at
    most ``BUFFER_BYTES``, each copied into place: the values are the range's."""
    from safetensors.numpy import save_file

    import ckptshim.formats.safetensors as safetensors_format
    from ckptshim.formats.detect import open_checkpoint

    values = np.random.default_rng(3).standard_normal((300, 50)).astype(np.float32)
    save_file({"a": values}, tmp_path / "a.safetensors")
    checkpoint = open_checkpoint(tmp_path / "a.safetensors")
    entry = checkpoint.inventory[("a",)]
    monkeypatch.setattr(safetensors_format, "BUFFER_BYTES", 1000)
    reads = []
    monkeypatch.setattr(safetensors_format, "read_ranges", lambda ranges, buffers, original=safetensors_format.read_ranges:
                        reads.extend(where.length for where in ranges) or original(ranges, buffers))
    out = np.empty((50, 300), np.float32)
    checkpoint.read_into(entry, (slice(None), slice(None)), out.T)
    assert np.array_equal(out.T, values) and max(reads) <= 1000 and sum(reads) == values.nbytes
    cast = np.empty((50, 7), np.float64)
    checkpoint.read_into(entry, (slice(3, 10), slice(None)), cast.T)
    assert np.array_equal(cast.T, values[3:10])
