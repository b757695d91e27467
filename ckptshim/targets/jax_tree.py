"""The caller's JAX pytree as a restore target: key names, shapes, dtypes, shardings.

Keys are spelled the way Orbax spells them on disk (dict keys, attribute names of dataclasses
and named tuples, sequence positions), so that a target and the checkpoint it was saved as
match exactly. Each array-like leaf becomes a :class:`TargetLeaf` that says what to build:

- a ``jax.Array`` or ``jax.ShapeDtypeStruct`` -> a ``jax.Array`` in its sharding (a
  ``ShapeDtypeStruct`` without one lands on the default device, as Orbax does);
- a numpy array or scalar -> a numpy value; a Python number -> a Python number;
- a typed PRNG key array -> its key data is read (``uint32[..., n]``, how Orbax stores keys)
  and wrapped again with the target's key implementation.

Orbax ``RestoreArgs``/``ArrayRestoreArgs`` given alongside the target override dtype, sharding
(or mesh and mesh axes) and restore type, as they do for Orbax; restore args that ask for more
(``global_shape`` padding or truncating, ``strict=False``, another type handler, sharding
metadata) are listed in :attr:`TargetTree.unsupported`. Other leaves (strings,
``ocp.PLACEHOLDER``, objects) are no targets (:attr:`TargetTree.others`) and come back
unchanged. The loading layer leaves a caller's tree with either to the framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptshim.inventory import Entry, Inventory, KeyPath, dtype_name


@dataclass(frozen=True)
class TargetLeaf:
    """What one target leaf wants: the stored array's shape and dtype, and what to return."""

    key: KeyPath
    shape: tuple[int, ...]     # of the stored array (a typed key array's key data)
    dtype: np.dtype
    kind: str                  # "jax", "numpy" or "python"
    sharding: Any = None       # for "jax"
    key_impl: Any = None       # for typed PRNG key arrays
    value: Any = None          # the caller's own leaf

    @property
    def concrete(self) -> bool:
        """Whether the caller passed a value (not just a shape) that could be kept as is."""
        import jax

        return not isinstance(self.value, jax.ShapeDtypeStruct)


def key_name(entry: Any) -> str:
    """One component of a JAX key path, spelled as Orbax writes it in ``_METADATA``."""
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


class TargetTree:
    """A pytree split into target leaves (by key) and everything else, and put back together."""

    def __init__(self, tree: Any, restore_args: Any = None) -> None:
        import jax

        paths, self._treedef = jax.tree_util.tree_flatten_with_path(tree)
        overrides = _overrides(restore_args)
        self._keys = [tuple(key_name(p) for p in path) for path, _ in paths]
        self._leaves = [leaf for _, leaf in paths]
        self.targets: dict[KeyPath, TargetLeaf] = {}
        #: Leaves that are no array or number, put back as they are (:meth:`rebuild`).
        self.others: dict[KeyPath, Any] = {}
        #: Restore args ckptshim cannot honour, one line per leaf.
        self.unsupported: list[str] = []
        for key, leaf in zip(self._keys, self._leaves):
            override = overrides.get(key)
            target = _target_leaf(key, leaf, override)
            if target is None:
                self.others[key] = leaf
                continue
            why = None if override is None else _unsupported_args(override, leaf)
            if why is not None:
                self.unsupported.append(f"{'/'.join(key)}: restore args {why}")
            self.targets[key] = target

    def inventory(self, source: str) -> Inventory:
        return Inventory((Entry(t.key, t.shape, dtype_name(t.dtype)) for t in self.targets.values()), source)

    def rebuild(self, values: Mapping[KeyPath, Any]) -> Any:
        """The caller's tree with every target leaf replaced by its restored value."""
        import jax

        leaves = [values[key] if key in self.targets else leaf for key, leaf in zip(self._keys, self._leaves)]
        return jax.tree_util.tree_unflatten(self._treedef, leaves)


def _overrides(restore_args: Any) -> dict[KeyPath, Any]:
    """Per-key RestoreArgs (Orbax matches them to the target by key path, and so do we)."""
    if restore_args is None:
        return {}
    import jax

    return {tuple(key_name(p) for p in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(restore_args)[0]}


def _unsupported_args(override: Any, leaf: Any) -> str | None:
    """Why ckptshim cannot do what one leaf's ``RestoreArgs`` ask for; ``None`` where it can:
    a dtype, a restore type of ``np.ndarray``, ``jax.Array`` or the leaf's own type, a
    ``jax.sharding.Sharding`` (or mesh and mesh axes), a ``global_shape`` that is the leaf's --
    what ``ocp.checkpoint_utils.construct_restore_args`` writes for a target."""
    import jax
    from orbax.checkpoint import type_handlers

    if type(override) not in (type_handlers.RestoreArgs, type_handlers.ArrayRestoreArgs):
        return f"of type {type(override).__name__}"
    restore_type = override.restore_type
    if not (restore_type in (None, np.ndarray, type(leaf))
            or isinstance(restore_type, type) and issubclass(restore_type, jax.Array)):
        return f"restore_type={getattr(restore_type, '__name__', restore_type)}"
    if isinstance(override, type_handlers.ArrayRestoreArgs):
        if override.global_shape is not None and tuple(override.global_shape) != tuple(np.shape(leaf)):
            return f"global_shape={tuple(override.global_shape)} (the target's is {tuple(np.shape(leaf))})"
        if not override.strict:
            return "strict=False"
        if override.sharding is not None and not isinstance(override.sharding, jax.sharding.Sharding):
            return f"sharding {type(override.sharding).__name__}"
    return None


def _target_leaf(key: KeyPath, leaf: Any, override: Any) -> TargetLeaf | None:
    import jax

    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        shape, dtype, kind = tuple(leaf.shape), leaf.dtype, "jax"
        sharding = getattr(leaf, "sharding", None)
    elif isinstance(leaf, (np.ndarray, np.generic)):
        shape, dtype, kind, sharding = tuple(leaf.shape), leaf.dtype, "numpy", None
    elif isinstance(leaf, (bool, int, float)):
        shape, dtype, kind, sharding = (), np.asarray(leaf).dtype, "python", None
    else:
        return None
    if override is not None:
        dtype = getattr(override, "dtype", None) or dtype
        restore_type = getattr(override, "restore_type", None)
        if restore_type is np.ndarray:
            kind = "numpy"
        elif restore_type is not None and isinstance(restore_type, type) and issubclass(restore_type, jax.Array):
            kind = "jax"
        explicit = getattr(override, "sharding", None)
        if isinstance(explicit, jax.sharding.Sharding):
            sharding = explicit
        elif getattr(override, "mesh", None) is not None and getattr(override, "mesh_axes", None) is not None:
            sharding = jax.sharding.NamedSharding(override.mesh, override.mesh_axes)
    key_impl = None
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        # a ShapeDtypeStruct has no public accessor for its key implementation; its dtype does
        key_impl = jax.random.key_impl(leaf) if isinstance(leaf, jax.Array) else dtype._impl
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        shape, dtype = tuple(data.shape), data.dtype
    if kind == "jax" and sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return TargetLeaf(key, shape, np.dtype(dtype), kind, sharding, key_impl, leaf)
