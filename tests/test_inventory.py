"""Entry, Inventory, dtype names, key splitting and tree flattening."""

from __future__ import annotations

import numpy as np
import pytest

from ckptshim.errors import CorruptCheckpointError, ShimError
from ckptshim.inventory import (
    DTYPE_SIZES,
    Entry,
    Inventory,
    dtype_name,
    flatten,
    join_key,
    split_key,
    unflatten,
)


# -- Entry and Inventory ---------------------------------------------------------------------


def test_entry_nbytes():
    assert Entry(("w",), (3, 4), "float32").nbytes == 48
    assert Entry(("w",), (3, 4), "bfloat16").nbytes == 24
    assert Entry(("w",), (2, 5), "complex128").nbytes == 160
    assert Entry(("w",), (7,), "float8_e4m3fn").nbytes == 7
    assert Entry(("step",), (), "int64").nbytes == 8  # a scalar is one element
    assert Entry(("empty",), (0, 5), "float32").nbytes == 0


def test_entry_is_frozen_and_hashable():
    entry = Entry(("a", "b"), (2,), "float32", location=("file.bin", 0, 8))
    with pytest.raises(AttributeError):
        entry.shape = (3,)  # type: ignore[misc]
    assert {entry: 1}[Entry(("a", "b"), (2,), "float32", ("file.bin", 0, 8))] == 1


def test_inventory_mapping_behaviour():
    entries = [Entry(("b",), (2,), "float32"), Entry(("a", "x"), (3, 3), "int8"),
               Entry(("c",), (), "float64")]
    inv = Inventory(entries, source="ckpt.safetensors")
    assert len(inv) == 3
    assert list(inv) == [("b",), ("a", "x"), ("c",)]  # insertion order, not sorted
    assert inv[("a", "x")] is entries[1]
    assert ("a", "x") in inv and ("a",) not in inv and "a.x" not in inv
    assert inv.get(("missing",)) is None
    assert inv.source == "ckpt.safetensors"
    assert repr(inv) == "Inventory(3 entries, ckpt.safetensors)"
    assert repr(Inventory([])) == "Inventory(0 entries)"
    with pytest.raises(KeyError):
        inv[("nope",)]


def test_inventory_total_bytes():
    inv = Inventory([Entry(("a",), (10, 10), "float32"), Entry(("b",), (10,), "bfloat16"),
                     Entry(("c",), (), "int64")])
    assert inv.total_bytes == 400 + 20 + 8
    assert Inventory([]).total_bytes == 0


def test_inventory_duplicate_key_is_corrupt_and_named():
    entries = [Entry(("layers", "0", "w"), (2,), "float32"),
               Entry(("layers", "1", "w"), (2,), "float32"),
               Entry(("layers", "0", "w"), (3,), "float16")]
    with pytest.raises(CorruptCheckpointError) as info:
        Inventory(entries, source="model.bin")
    message = str(info.value)
    assert "'layers.0.w'" in message
    assert message.startswith("model.bin:")
    assert "layers.1.w" not in message
    assert isinstance(info.value, ShimError)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def test_inventory_duplicate_key_without_source_says_inventory():
    with pytest.raises(CorruptCheckpointError, match=r"^inventory: key 'x' appears twice"):
        Inventory([Entry(("x",), (), "float32"), Entry(("x",), (), "float32")])


# -- dtype names ------------------------------------------------------------------------------


class _TorchLikeDtype:
    """What ``torch.float32`` looks like to dtype_name: no ``name``, ``str`` is ``torch.float32``."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text


@pytest.mark.parametrize("given, expected", [
    ("torch.float32", "float32"),
    ("torch.bfloat16", "bfloat16"),
    ("torch.float", "float32"),
    ("torch.half", "float16"),
    ("torch.long", "int64"),
    ("torch.float8_e4m3fn", "float8_e4m3fn"),
    (_TorchLikeDtype("torch.float16"), "float16"),
    (_TorchLikeDtype("torch.int8"), "int8"),
    ("BF16", "bfloat16"),
    ("F32", "float32"),
    ("F16", "float16"),
    ("I64", "int64"),
    ("U8", "uint8"),
    ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("float64", "float64"),
    ("dtype('float32')", "float32"),
])
def test_dtype_name_strings_and_torch_like(given, expected):
    assert dtype_name(given) == expected


@pytest.mark.parametrize("given, expected", [
    (np.dtype("float32"), "float32"),
    (np.dtype("<f4"), "float32"),
    (np.dtype(">f8"), "float64"),
    (np.dtype("int16"), "int16"),
    (np.dtype("bool"), "bool"),
    (np.dtype("complex64"), "complex64"),
    (np.float16, "float16"),
    (np.uint32, "uint32"),
    (np.int64, "int64"),
])
def test_dtype_name_numpy(given, expected):
    assert dtype_name(given) == expected


@pytest.mark.parametrize("scalar", [float, int, bool, complex])
def test_dtype_name_python_scalar_types_mean_what_numpy_makes_of_them(scalar):
    assert dtype_name(scalar) == np.dtype(scalar).name


def test_dtype_name_ml_dtypes_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert dtype_name(np.dtype(ml_dtypes.bfloat16)) == "bfloat16"
    assert dtype_name(ml_dtypes.bfloat16) == "bfloat16"
    assert dtype_name(np.dtype(ml_dtypes.float8_e4m3fn)) == "float8_e4m3fn"


def test_dtype_name_real_torch():
    torch = pytest.importorskip("torch")
    assert dtype_name(torch.float32) == "float32"
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.int64) == "int64"
    assert dtype_name(torch.float8_e5m2) == "float8_e5m2"


@pytest.mark.parametrize("given", ["float7", "torch.quint8", "string", "", "V2", np.dtype("V2"),
                                   np.dtype("U3"), object()])
def test_dtype_name_unknown_raises_value_error(given):
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_name(given)


def test_every_known_dtype_is_its_own_canonical_name():
    for name in DTYPE_SIZES:
        assert dtype_name(name) == name
        assert dtype_name(name.upper()) == name


# -- keys --------------------------------------------------------------------------------------


def test_split_and_join_key():
    assert split_key("layers.0.w") == ("layers", "0", "w")
    assert split_key("decoder/layers_3/mlp", sep="/") == ("decoder", "layers_3", "mlp")
    assert split_key("w") == ("w",)
    assert split_key("") == ()
    assert join_key(("layers", "0", "w")) == "layers.0.w"
    assert join_key(("a", "b"), "/") == "a/b"
    assert join_key(()) == ""
    for text in ["a", "a.b.c", "_orig_mod.layers.10.attention.bias"]:
        assert join_key(split_key(text)) == text


# -- flatten / unflatten ---------------------------------------------------------------------


def test_flatten_nested_dicts_lists_tuples_in_order():
    tree = {"params": {"dense": {"kernel": "K", "bias": "B"}, "blocks": ["b0", ("t0", "t1")]},
            "step": 7, 3: "int-key"}
    flat = flatten(tree)
    assert list(flat.items()) == [
        (("params", "dense", "kernel"), "K"),
        (("params", "dense", "bias"), "B"),
        (("params", "blocks", "0"), "b0"),
        (("params", "blocks", "1", "0"), "t0"),
        (("params", "blocks", "1", "1"), "t1"),
        (("step",), 7),
        (("3",), "int-key"),
    ]


def test_flatten_drops_empty_containers():
    assert flatten({"a": {}, "b": [], "c": (), "d": {"e": {}}, "f": 1}) == {("f",): 1}
    assert flatten({}) == {}


def test_flatten_refuses_two_keys_spelling_one_path():
    with pytest.raises(ValueError, match=r"\[1, '1'\] under 'a' all spell .* '1'"):
        flatten({"a": {1: "int key", "1": "str key"}})


def test_flatten_is_leaf_stops_descent():
    tree = {"a": {"keep": [1, 2]}, "b": [3, 4]}
    flat = flatten(tree, is_leaf=lambda node: isinstance(node, dict) and "keep" in node)
    assert flat == {("a",): {"keep": [1, 2]}, ("b", "0"): 3, ("b", "1"): 4}


def test_flatten_keeps_array_leaves_whole():
    array = np.arange(6).reshape(2, 3)
    flat = flatten({"w": array, "layers": [array, array]})
    assert list(flat) == [("w",), ("layers", "0"), ("layers", "1")]
    assert flat[("w",)] is array


def test_unflatten_round_trip_nested_dicts():
    tree = {"a": {"b": {"c": 1, "d": 2}, "e": 3}, "f": 4}
    assert unflatten(flatten(tree)) == tree


def test_unflatten_lists_and_tuples_come_back_as_string_keyed_dicts():
    tree = {"layers": [{"w": 1}, {"w": 2}], "pair": (5, 6)}
    back = unflatten(flatten(tree))
    assert back == {"layers": {"0": {"w": 1}, "1": {"w": 2}}, "pair": {"0": 5, "1": 6}}
    assert flatten(back) == flatten(tree)


def test_unflatten_leaf_then_subtree_conflict():
    with pytest.raises(ValueError, match=r"'a\.b' runs through the leaf 'a'"):
        unflatten({("a",): 1, ("a", "b"): 2})


def test_unflatten_subtree_then_leaf_conflict():
    with pytest.raises(ValueError, match=r"'a' is both a leaf and a subtree"):
        unflatten({("a", "b"): 2, ("a",): 1})


def test_unflatten_empty_key_path():
    with pytest.raises(ValueError, match="empty key path"):
        unflatten({(): 1})
    assert unflatten({}) == {}
