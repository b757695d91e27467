"""JAX trees as the tests build and compare them: Orbax's key paths, layers stacked with numpy.

The expected values of a restore are built independently of ckptshim, from the saved arrays with
numpy (``np.stack``/``np.take`` on the axis the layout says), and compared bit for bit.
"""

from __future__ import annotations

import numpy as np

from ckptshim.inventory import split_key, unflatten


def nest(flat: dict[str, object]) -> dict:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``: the nested tree Orbax saves and restores."""
    return unflatten({split_key(key, "/"): value for key, value in flat.items()})


def flat(tree) -> dict[str, object]:
    """``{"a/b/0/c": leaf}`` with Orbax's spelling of JAX key paths."""
    import jax

    from ckptshim.targets.jax_tree import key_name

    return {"/".join(key_name(p) for p in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def scanned_expected(unscanned: dict[str, object], layers: int, axis_of) -> dict[str, np.ndarray]:
    """Stack ``.../layers_{i}/...`` of a flat tree with numpy: ``axis_of(key)`` names the axis."""
    out: dict[str, np.ndarray] = {}
    for key, value in unscanned.items():
        if "/layers_0/" in key:
            whole = key.replace("/layers_0/", "/layers/")
            out[whole] = np.stack([np.asarray(unscanned[key.replace("/layers_0/", f"/layers_{i}/")])
                                   for i in range(layers)], axis=axis_of(whole))
        elif "/layers_" not in key:
            out[key] = np.asarray(value)
    return out


def unscanned_expected(scanned: dict[str, object], layers: int, axis_of) -> dict[str, np.ndarray]:
    """Take ``.../layers/...`` of a flat tree apart with numpy into ``.../layers_{i}/...``."""
    out: dict[str, np.ndarray] = {}
    for key, value in scanned.items():
        if "/layers/" in key:
            for i in range(layers):
                out[key.replace("/layers/", f"/layers_{i}/")] = np.take(np.asarray(value), i, axis=axis_of(key))
        else:
            out[key] = np.asarray(value)
    return out


def assert_same(actual: dict[str, object], expected: dict[str, np.ndarray]) -> None:
    """Same keys, dtypes, shapes and bits."""
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        got = np.asarray(actual[key])
        assert got.dtype == value.dtype and got.shape == value.shape, (key, got.dtype, got.shape, value.dtype, value.shape)
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(value).tobytes(), key
