"""PaxML checkpoints of ``CheckpointType.FLAX``: one msgpack file of positional leaves.

PaxML (``paxml/checkpoints.py``, ``FlaxCheckpointHandler.async_save``) flattens the train state
with ``jax.tree_util.tree_flatten`` and stores ``{'flattened_state': [leaf, ...],
'str_pytree_state': str(treedef)}`` as the Orbax aggregate msgpack ``checkpoint`` of the step's
``state`` item: ``checkpoint_<step>/state/checkpoint`` (the step is not zero-padded for this
type, ``paxml/checkpoint_paths.py``). Older PaxML wrote the same payload with
``flax.training.checkpoints.save_checkpoint`` as a file ``checkpoint_<step>``, its list then
encoded as a ``{'0': ..., '1': ...}`` map. PaxML restores by flattening the caller's target and
uses ``str_pytree_state`` only as a check, so the file alone has no names; ckptshim gets them
by parsing ``str_pytree_state`` (a strict parser of what ``str(PyTreeDef)`` prints -- nothing
is evaluated) and spelling each leaf's path as PaxML's tensorstore layout spells it
(``_extract_nested_prefix_names``: mapping keys and named fields are components, a list or
tuple position ``i`` is appended to its parent as ``_i``). The keys are therefore the ones
:mod:`ckptshim.formats.paxml` lists for the same state, and the PaxML profiles apply unchanged.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

from ckptshim.errors import CorruptCheckpointError
from ckptshim.formats import flax_msgpack, located, msgpack_tree
from ckptshim.formats.base import reader, step_folders
from ckptshim.formats.located import Where
from ckptshim.inventory import Inventory, KeyPath
from ckptshim.storage import Location

NAME = "paxml-flax"
STATE = "state"
AGGREGATE = "checkpoint"
LEAVES, TREEDEF = "flattened_state", "str_pytree_state"
_STEP = re.compile(r"^checkpoint_(\d+)$")
#: msgpack's encoding of the payload's start: a map, then the key ``flattened_state``.
_HEADS = tuple(bytes([0x80 + n, 0xA0 + len(LEAVES)]) + LEAVES.encode() for n in (1, 2))
#: PaxML's ``TrainState`` (``paxml/train_states.py``) is a Flax struct: its treedef prints no
#: field names (``CustomNode(TrainState[()], [...])``), so they are known here, by arity.
_TRAIN_STATE_FIELDS = {3: ("step", "mdl_vars", "opt_states"),
                       4: ("step", "mdl_vars", "opt_states", "extra_state")}
#: Custom nodes whose auxiliary data is the tuple of their keys (praxis ``pytypes.NestedMap``,
#: Flax ``FrozenDict``): their children are named by those keys, like a dict's.
_MAPPING_NODES = frozenset({"NestedMap", "FrozenDict"})


def is_payload(path: Where) -> bool:
    """Cheap: a file whose msgpack map starts with PaxML's ``flattened_state`` key."""
    return located.head(path, len(_HEADS[0])) in _HEADS


def _payload_of(path: Where) -> Where | None:
    """The payload file of ``path`` (the file, its ``state`` item, or its step folder)."""
    for candidate in (path, path / AGGREGATE, path / STATE / AGGREGATE):
        if is_payload(candidate):
            return candidate
    return None


def steps(root: Where) -> dict[int, Where]:
    """Step number -> payload file, for ``checkpoint_<step>`` folders or files under ``root``."""
    return step_folders(root, _STEP, _payload_of)


def is_state_dir(path: Where) -> bool:
    """A ``state`` item (or a step folder) holding a PaxML FLAX payload."""
    return path.is_dir() and _payload_of(path) is not None


def sniff(path: Where) -> bool:
    return _payload_of(path) is not None or bool(steps(path))


#: An Orbax restore names the ``state`` item (or its step folder); its aggregate would otherwise
#: pass for an Orbax one.
READERS = {"jax": is_state_dir}


# -- str(PyTreeDef) ----------------------------------------------------------------------------


class TreeDefSyntaxError(ValueError):
    """``str_pytree_state`` is not in the syntax ``str(jax.tree_util.PyTreeDef)`` prints."""


@dataclass(frozen=True)
class Node:
    """One node of a printed treedef: ``leaf``, ``none``, ``dict``, ``list``, ``tuple`` or ``custom``."""

    kind: str
    children: tuple[Node, ...] = ()
    keys: tuple[str, ...] = ()          # dict keys, as strings
    type_name: str = ""                 # custom: the registered type's name (or ``namedtuple``)
    aux: tuple[str, ...] | str | None = None  # custom: a tuple of strings or one identifier


_STRING = re.compile(r"'(?:[^'\\\n]|\\.)*'" + r'|"(?:[^"\\\n]|\\.)*"')
_INT = re.compile(r"-?\d+")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Parser:
    """Recursive descent over exactly jax's printing: ``*``, ``None``, ``{k: n, ...}``,
    ``[n, ...]``, ``(n,)``/``(n, ...)``, ``CustomNode(Type[aux], [n, ...])``, inside ``PyTreeDef(...)``.
    """

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def fail(self, what: str) -> TreeDefSyntaxError:
        return TreeDefSyntaxError(f"{what} at character {self.pos}: {self.text[self.pos:self.pos + 40]!r}")

    def eat(self, literal: str) -> bool:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str) -> None:
        if not self.eat(literal):
            raise self.fail(f"expected {literal!r}")

    def match(self, pattern: re.Pattern, what: str) -> str:
        found = pattern.match(self.text, self.pos)
        if not found:
            raise self.fail(f"expected {what}")
        self.pos = found.end()
        return found.group()

    def string(self) -> str:
        # One quoted literal, checked by the pattern first: literal_eval only decodes its escapes.
        literal = self.match(_STRING, "a quoted string")
        try:
            return ast.literal_eval(literal)
        except (SyntaxError, ValueError):  # a NUL byte, an escape Python does not know
            raise self.fail(f"a string Python cannot read back ({literal!r:.40})") from None

    def items(self, close: str, item, depth: int) -> list:
        out = []
        if self.eat(close):
            return out
        while True:
            out.append(item(depth))
            if self.eat(close):
                return out
            self.expect(", ")

    def node(self, depth: int) -> Node:
        if depth > msgpack_tree.MAX_DEPTH:
            raise self.fail(f"nesting deeper than {msgpack_tree.MAX_DEPTH} levels")
        if self.eat("*"):
            return Node("leaf")
        if self.eat("None"):
            return Node("none")
        if self.eat("{"):
            pairs = self.items("}", self.pair, depth + 1)
            return Node("dict", tuple(c for _, c in pairs), tuple(k for k, _ in pairs))
        if self.eat("["):
            return Node("list", tuple(self.items("]", self.node, depth + 1)))
        if self.eat("CustomNode("):
            return self.custom(depth + 1)
        if self.eat("("):
            if self.eat(")"):
                return Node("tuple")
            first = self.node(depth + 1)
            if self.eat(",)"):
                return Node("tuple", (first,))
            self.expect(", ")
            return Node("tuple", (first, *self.items(")", self.node, depth + 1)))
        raise self.fail("expected a treedef node")

    def pair(self, depth: int) -> tuple[str, Node]:
        key = self.string() if self.text[self.pos:self.pos + 1] in ("'", '"') else self.match(_INT, "a dict key")
        self.expect(": ")
        return key, self.node(depth)

    def custom(self, depth: int) -> Node:
        type_name = self.match(_IDENT, "a type name")
        self.expect("[")
        if self.eat("()"):
            aux: tuple[str, ...] | str = ()
        elif self.eat("("):
            first = self.string()
            if self.eat(",)"):
                aux = (first,)
            else:
                self.expect(", ")
                aux = (first, *self.items(")", lambda _: self.string(), depth))
        else:
            aux = self.match(_IDENT, "auxiliary data (a tuple of strings or a name)")
        self.expect("], [")
        return Node("custom", tuple(self.items("])", self.node, depth)), type_name=type_name, aux=aux)


def parse(text: str) -> Node:
    """The tree ``text`` (``str`` of a ``PyTreeDef``) describes; anything else is refused."""
    parser = _Parser(text)
    parser.expect("PyTreeDef(")
    root = parser.node(0)
    parser.expect(")")
    if parser.pos != len(text):
        raise parser.fail("text after the treedef")
    return root


# -- the checkpoint -----------------------------------------------------------------------------


class PaxmlFlaxCheckpoint(flax_msgpack.FlaxMsgpackCheckpoint):
    """The payload file; its leaves are read in place from the memory map, as Flax's are."""

    def __init__(self, path: Where, version: str, inventory: Inventory, files, data) -> None:
        super().__init__(path, version, inventory, files, data)
        self.format = NAME


def leaf_names(treedef: Node) -> list[KeyPath | None]:
    """Each leaf's key path, in ``tree_flatten`` order, spelled as PaxML's tensorstore names."""
    names: list[KeyPath | None] = []
    _name(treedef, (), names)
    return names


def _indexed(prefix: KeyPath, i: int) -> KeyPath:
    """PaxML's ``left_separator='_'``: position ``i`` is appended to the last component."""
    return prefix[:-1] + (f"{prefix[-1]}_{i}",) if prefix else (f"_{i}",)


def _name(node: Node, prefix: KeyPath, out: list) -> None:
    if node.kind == "leaf":
        out.append(prefix)
    elif node.kind == "dict":
        for key, child in zip(node.keys, node.children):
            _name(child, prefix + (key,), out)
    elif node.kind in ("list", "tuple"):
        for i, child in enumerate(node.children):
            _name(child, _indexed(prefix, i), out)
    elif node.kind == "custom":
        for key, child in zip(_custom_keys(node), node.children):
            _name(child, prefix + (key,), out)
    # "none": no leaves


def _custom_keys(node: Node) -> tuple[str, ...]:
    if not node.children:
        return ()
    if node.type_name == "TrainState" and node.aux == () and len(node.children) in _TRAIN_STATE_FIELDS:
        return _TRAIN_STATE_FIELDS[len(node.children)]
    if node.type_name in _MAPPING_NODES and isinstance(node.aux, tuple) \
            and len(node.aux) == len(node.children) and all(isinstance(k, str) for k in node.aux):
        return node.aux
    raise TreeDefSyntaxError(
        f"a {node.type_name} node with {len(node.children)} children and auxiliary data "
        f"{node.aux!r:.80}, whose children's names the treedef does not print (ckptshim names "
        f"the children of TrainState, {', '.join(sorted(_MAPPING_NODES))}, dicts, lists and tuples)")


def _positional(value: Any, where: Where) -> list:
    """``flattened_state`` as a list: Orbax writes a msgpack array, Flax a ``{'0': ...}`` map."""
    if isinstance(value, list):
        return value
    if isinstance(value, dict) and list(value) == [str(i) for i in range(len(value))]:
        return list(value.values())
    raise CorruptCheckpointError(
        f"{where}: {LEAVES} is a {type(value).__name__}, not the list of leaves PaxML writes; "
        "the file is damaged or not a PaxML FLAX checkpoint. Re-copy it from the original.")


@reader
def open_checkpoint(path: Where) -> PaxmlFlaxCheckpoint:
    """A payload file, its ``state`` item, its step folder, or a checkpoints root (latest step);
    locally or below a bucket prefix (the payload then fetched whole, as PaxML reads it)."""
    payload = _payload_of(path)
    version = "flax msgpack"
    if payload is None:
        found = steps(path)
        if not found:
            raise CorruptCheckpointError(f"{path}: no PaxML checkpoint_<step> with a FLAX payload found")
        payload = found[max(found)]
        version += f", latest of {len(found)} step(s)"
    Location.of(payload).require_inside(Location.of(path))  # a payload linked out of the folder
    data = msgpack_tree.contents(payload)
    tree = msgpack_tree.read_tree(data, str(payload))
    if not isinstance(tree, dict) or set(tree) != {LEAVES, TREEDEF} or not isinstance(tree[TREEDEF], str):
        raise CorruptCheckpointError(
            f"{payload}: a PaxML FLAX checkpoint holds exactly {LEAVES} and the string {TREEDEF}; "
            f"this file holds {sorted(tree) if isinstance(tree, dict) else type(tree).__name__}. "
            "Re-copy it from the original.")
    leaves = _positional(tree[LEAVES], payload)
    try:
        names = leaf_names(parse(tree[TREEDEF]))
    except TreeDefSyntaxError as error:
        raise CorruptCheckpointError(
            f"{payload}: cannot name the leaves from {TREEDEF} ({error}); ckptshim reads only the "
            "syntax jax's str(PyTreeDef) prints. Restore it through PaxML with the model's own "
            "train state, or re-copy the file if it is damaged.") from None
    if len(names) != len(leaves):
        raise CorruptCheckpointError(
            f"{payload}: {TREEDEF} has {len(names)} leaves but {LEAVES} holds {len(leaves)}; the "
            "positions cannot be named without a guess. The file is damaged or was edited; "
            "re-copy it from the original.")
    entries = []
    for i, (key, leaf) in enumerate(zip(names, leaves)):
        if leaf is None:  # a leaf PaxML does not store (a masked node): it holds no data
            continue
        if isinstance(leaf, (dict, list, str, complex)):
            raise CorruptCheckpointError(
                f"{payload}: {LEAVES}[{i}] ({'.'.join(key)}) is a {type(leaf).__name__}, not an "
                "array or number; the file is damaged. Re-copy it from the original.")
        entries.append(msgpack_tree.inline_entry(key, leaf))
    try:
        inventory = Inventory(entries, str(payload))
    except ValueError as error:
        raise CorruptCheckpointError(f"{payload}: two leaves of {TREEDEF} spell one name ({error}); "
                                     "the names would be a guess. Re-copy the file.") from None
    return PaxmlFlaxCheckpoint(payload, version, inventory, [located.file_info_at(payload, size=len(data))], data)
