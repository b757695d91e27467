"""Generated modules loaded from their own ``state_dict()`` through random wrappers, with and
without ckptshim (see ``compare_loads``): never a silent wrong value.

Hypothesis draws a module tree -- random nesting, submodules named like wrapper components
(``module``, ``_orig_mod``, ``_checkpoint_wrapped_module``) or DCP's ``model``, parameters and
buffers (persistent or not) named like derivable buffers (``attention.bias``, ``inv_freq``,
``position_ids``, ``masked_bias``) holding either what those rules derive or trained-looking
values -- builds it twice with different seeds, wraps each copy at the top or inside (DDP,
``torch.compile``, activation checkpointing), sometimes changes the target a little (a leaf
gone, a buffer's persistence flipped), and loads the source's state dict into the target with
``load_state_dict`` and ``set_model_state_dict``, strict and not. Which source value belongs in which target tensor is known from the tree itself
(each tensor's path in it), never from ckptshim's names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint import state_dict as setters

from compare_loads import Load, compare, module_tensors, prints

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")

MODULE_NAMES = ("module", "_orig_mod", "_checkpoint_wrapped_module", "model", "attention", "layers", "0", "1", "mlp")
LEAF_NAMES = ("weight", "bias", "inv_freq", "position_ids", "masked_bias", "scale")
WRAPPERS = (None, "ddp", "compile", "checkpoint")
#: How a leaf is filled: trained-looking values that differ between the two builds, or what a
#: derivable-buffer rule derives (the same in both).
FILLS = ("random", "random", "causal mask", "positions", "masked_bias")
SHAPES = ((3,), (2, 3), (1, 1, 4, 4), ())


@dataclass(frozen=True)
class Leaf:
    kind: str          # "parameter" or "buffer"
    shape: tuple[int, ...]
    fill: str
    persistent: bool = True


@dataclass(frozen=True)
class Node:
    leaves: Mapping[str, Leaf] = field(default_factory=dict)
    children: Mapping[str, Node] = field(default_factory=dict)


@st.composite
def leaves(draw) -> Leaf:
    fill = draw(st.sampled_from(FILLS))
    shape = {"causal mask": (1, 1, 4, 4), "positions": (1, 5), "masked_bias": ()}.get(fill) \
        or draw(st.sampled_from(SHAPES))
    kind = "buffer" if fill == "positions" else draw(st.sampled_from(["parameter", "buffer"]))
    return Leaf(kind, shape, fill, persistent=kind == "parameter" or draw(st.booleans()))


@st.composite
def nodes(draw, depth: int = 0) -> Node:
    names = draw(st.lists(st.sampled_from(LEAF_NAMES), max_size=3, unique=True))
    children = draw(st.lists(st.sampled_from(MODULE_NAMES), max_size=0 if depth >= 3 else 2, unique=True))
    return Node({name: draw(leaves()) for name in names},
                {name: draw(nodes(depth + 1)) for name in children})


@dataclass(frozen=True)
class Case:
    tree: Node
    source_wrapper: str | None
    target_wrapper: str | None
    source_inner: str | None   # a wrapper around the first child, if any
    target_inner: str | None
    change: str | None          # "drop a leaf", "flip a buffer's persistence"
    changed_at: int


@st.composite
def cases(draw) -> Case:
    return Case(draw(nodes()), draw(st.sampled_from(WRAPPERS)), draw(st.sampled_from(WRAPPERS)),
                draw(st.sampled_from((None, "compile", "checkpoint"))),
                draw(st.sampled_from((None, "compile", "checkpoint"))),
                draw(st.sampled_from((None, None, "drop a leaf", "flip a buffer's persistence"))),
                draw(st.integers(0, 20)))


# -- building a tree into a module --------------------------------------------------------------------


def _fill(leaf: Leaf, generator: torch.Generator) -> torch.Tensor:
    """A derived value (the same in every build), or a trained-looking one (``generator``'s)."""
    if leaf.fill == "causal mask":
        return torch.ones(leaf.shape[-2:], dtype=torch.bool).tril().expand(leaf.shape).float()
    if leaf.fill == "positions":
        return torch.arange(leaf.shape[-1]).expand(leaf.shape).contiguous()
    if leaf.fill == "masked_bias":
        return torch.tensor(-1e9)
    return torch.randn(leaf.shape, generator=generator)


def build(node: Node, generator: torch.Generator, paths: dict[int, str], at: str = "") -> nn.Module:
    """The module for ``node``; ``paths`` records each tensor's path in the tree (by identity)."""
    module = nn.Module()
    for name, leaf in node.leaves.items():
        value = _fill(leaf, generator)
        if leaf.kind == "parameter":
            module.register_parameter(name, nn.Parameter(value))
        else:
            module.register_buffer(name, value, persistent=leaf.persistent)
        paths[id(getattr(module, name))] = f"{at}{name}"
    for name, child in node.children.items():
        module.add_module(name, build(child, generator, paths, f"{at}{name}."))
    return module


def changed(node: Node, change: str | None, at: int) -> Node:
    """``node`` with one leaf dropped, or one buffer's persistence flipped (the ``at``-th candidate)."""
    found: list[tuple[tuple[str, ...], str]] = []

    def walk(n: Node, path: tuple[str, ...]) -> None:
        found.extend((path, name) for name, leaf in n.leaves.items()
                     if change == "drop a leaf" or leaf.kind == "buffer")
        for name, child in n.children.items():
            walk(child, path + (name,))

    walk(node, ())
    if change is None or not found:
        return node
    path, name = found[at % len(found)]

    def rebuild(n: Node, rest: tuple[str, ...]) -> Node:
        if rest:
            return Node(n.leaves, {**n.children, rest[0]: rebuild(n.children[rest[0]], rest[1:])})
        leaves = dict(n.leaves)
        leaf = leaves.pop(name)
        if change != "drop a leaf":
            leaves[name] = Leaf(leaf.kind, leaf.shape, leaf.fill, not leaf.persistent)
        return Node(leaves, n.children)
    return rebuild(node, path)


def wrapped(module: nn.Module, outer: str | None, inner: str | None) -> nn.Module:
    """``module`` with its first child wrapped ``inner``, and itself wrapped ``outer``."""
    if inner is not None and module._modules:
        name, child = next(iter(module._modules.items()))
        module._modules[name] = _wrap(child, inner)
    return _wrap(module, outer)


def _wrap(module: nn.Module, how: str | None) -> nn.Module:
    """DDP (over a module with parameters to train), ``torch.compile``, activation checkpointing."""
    if how == "ddp" and any(p.requires_grad for p in module.parameters()):
        return nn.parallel.DistributedDataParallel(module)
    if how == "compile":
        return torch.compile(module)
    if how == "checkpoint":
        return checkpoint_wrapper(module)
    return module


def instance(tree: Node, seed: int, outer: str | None, inner: str | None) -> tuple[nn.Module, dict[int, str]]:
    """``tree`` built with ``seed`` and wrapped; and each tensor's path in the tree, by identity."""
    generator = torch.Generator().manual_seed(seed)
    paths: dict[int, str] = {}
    return wrapped(build(tree, generator, paths), outer, inner), paths


def _leaf(tree: Node, path: str) -> Leaf | None:
    *parents, name = path.split(".")
    node: Node | None = tree
    for part in parents:
        node = node.children.get(part) if node is not None else None
    return None if node is None else node.leaves.get(name)


def _is_trained(source: Node, target: Node, path: str) -> bool:
    """Whether the source leaf at ``path`` holds a trained-looking value that the target does not
    keep as a buffer of its own (non-persistent): no strict load may leave it out unannounced."""
    kept = _leaf(target, path)
    return _leaf(source, path).fill == "random" and not (kept is not None and not kept.persistent)


def tree_paths(module: nn.Module, paths: Mapping[int, str]) -> dict[str, str]:
    """Each state-dict key of ``module`` -> the path of its tensor in the tree."""
    return {key: paths[id(tensor)] for key, tensor in module.state_dict(keep_vars=True).items()}


# -- the property -----------------------------------------------------------------------------------------



@settings(max_examples=300, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_generated_modules_load_their_own_state_dict_through_wrappers(process_group, case):
    source, source_paths = instance(case.tree, 1, case.source_wrapper, case.source_inner)
    saved = source.state_dict()

    def state_dict() -> OrderedDict:
        """What the caller passes, anew for each call: set_model_state_dict rewrites it in place."""
        given = OrderedDict(saved)
        given._metadata = saved._metadata  # type: ignore[attr-defined]
        return given
    by_path = {source_paths[id(tensor)]: tensor for tensor in source.state_dict(keep_vars=True).values()}
    target_tree = changed(case.tree, case.change, case.changed_at)

    def fresh() -> nn.Module:
        return instance(target_tree, 2, case.target_wrapper, case.target_inner)[0]

    target, target_paths = instance(target_tree, 2, case.target_wrapper, case.target_inner)
    placed = tree_paths(target, target_paths)
    truth = prints({key: by_path[path] for key, path in placed.items() if path in by_path})
    trained = frozenset(key for key, path in tree_paths(source, source_paths).items()
                        if path not in placed.values() and _is_trained(case.tree, target_tree, path))
    for strict in (True, False):
        compare(Load(f"{case}: load_state_dict(strict={strict})", fresh,
                     lambda model, strict=strict: model.load_state_dict(state_dict(), strict=strict),
                     module_tensors, lambda model, _: module_tensors(model), truth, complete=strict,
                     trained=trained))
        compare(Load(f"{case}: set_model_state_dict(strict={strict})", fresh,
                     lambda model, strict=strict: setters.set_model_state_dict(
                         model, state_dict(), options=setters.StateDictOptions(strict=strict)),
                     module_tensors, lambda model, _: module_tensors(model), truth, complete=strict,
                     trained=trained))
