"""An unpickler that builds only what its caller allows, in time and memory linear in its input.

Python's own unpicklers can be told which globals to resolve (``find_class``), but not what the
rest of the pickle does to them: the C unpickler sizes its memo table by the largest index it is
given (one ``LONG_BINPUT 775000000`` in a 6 KiB file zeroes about 12 GiB), hashes dictionary
keys as it builds them (a key that is a tuple nested with exponential sharing hashes for a time
exponential in the nesting), and applies ``BUILD`` to whatever is on its stack, so an object
that was checked when built can be changed afterwards. This interpreter reads the same opcodes
with none of that:

- the opcodes of each :class:`Dialect` only: :data:`TORCH` is exactly what
  ``torch.load(weights_only=True)`` interprets (protocol 2, as ``torch.save`` writes),
  :data:`PICKLE` adds what ``pickle.dump`` writes at protocols 3 to 5 (DCP's ``.metadata``);
  anything else (``INST``, ``OBJ``, ``EXT*``, text protocol 0) is refused;
- globals through the caller's ``find_class``, which returns an inert stand-in or refuses;
  ``REDUCE``/``NEWOBJ`` call only what ``find_class`` returned; ``BUILD`` applies state only
  through a stand-in's own ``__setstate__`` (a built-in container or a stand-in without one
  refuses it), so each stand-in decides what its state may change;
- a memo that is a dictionary (an index costs nothing), and every object costs one unit of a
  :class:`~ckptshim.formats.base.Budget`;
- dictionary keys and set members that hash in constant time: strings, bytes, numbers up to
  64 bits, ``None``, stand-in objects, or flat tuples of at most :data:`MAX_KEY_ITEMS` of those.

Errors are :class:`~ckptshim.errors.CorruptCheckpointError` naming the file and the byte offset
(and whatever ``find_class`` or a stand-in raises, typically
:class:`~ckptshim.errors.UnsafeCheckpointError`). On a 100,000-tensor ``data.pkl`` (12 MB,
3.2 million opcodes) this takes about twice the time of CPython's C unpickler with the same
``find_class`` and stand-ins, and a fraction of ``torch.load(weights_only=True)``'s (also pure
Python); bench/README.md has the figures.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptshim.errors import CorruptCheckpointError, ShimError, describe
from ckptshim.formats.base import Budget

#: Items in a tuple used as a dictionary key or set member (tuples do not cache their hash).
MAX_KEY_ITEMS = 16
_KEY_ATOMS = (str, bytes, int, float, bool, type(None))
_BUILTINS = (dict, list, tuple, set, frozenset, str, bytes, bytearray, int, float, bool, complex,
             type(None))

# Opcode bytes (names as in pickletools).
MARK, STOP, POP, POP_MARK, DUP = 0x28, 0x2E, 0x30, 0x31, 0x32
BININT, BININT1, BININT2, LONG1, LONG4 = 0x4A, 0x4B, 0x4D, 0x8A, 0x8B
NONE, NEWTRUE, NEWFALSE, BINFLOAT = 0x4E, 0x88, 0x89, 0x47
BINUNICODE, SHORT_BINUNICODE, BINUNICODE8 = 0x58, 0x8C, 0x8D
SHORT_BINSTRING, SHORT_BINBYTES, BINBYTES, BINBYTES8 = 0x55, 0x43, 0x42, 0x8E
EMPTY_TUPLE, TUPLE, TUPLE1, TUPLE2, TUPLE3 = 0x29, 0x74, 0x85, 0x86, 0x87
EMPTY_LIST, APPEND, APPENDS = 0x5D, 0x61, 0x65
EMPTY_DICT, SETITEM, SETITEMS = 0x7D, 0x73, 0x75
EMPTY_SET, ADDITEMS, FROZENSET = 0x8F, 0x90, 0x91
GLOBAL, STACK_GLOBAL, REDUCE, BUILD, NEWOBJ = 0x63, 0x93, 0x52, 0x62, 0x81
BINPERSID = 0x51
BINGET, LONG_BINGET, BINPUT, LONG_BINPUT, MEMOIZE = 0x68, 0x6A, 0x71, 0x72, 0x94
PROTO, FRAME = 0x80, 0x95


@dataclass(frozen=True)
class Dialect:
    """Which opcodes a kind of file may use."""

    name: str
    opcodes: frozenset[int]


#: The highest pickle protocol there is (Python 3.8 to 3.14).
MAX_PROTOCOL = 5


#: ``torch._weights_only_unpickler.Unpickler`` (torch 2.13): what ``torch.load(weights_only=True)``
#: reads, so ckptshim refuses the torch files torch refuses for their opcodes.
TORCH = Dialect("torch.save", frozenset({
    PROTO, STOP, MARK, GLOBAL, NEWOBJ, REDUCE, BUILD, APPEND, APPENDS, SETITEM, SETITEMS,
    TUPLE, TUPLE1, TUPLE2, TUPLE3, NONE, NEWFALSE, NEWTRUE, EMPTY_TUPLE, EMPTY_LIST, EMPTY_DICT,
    EMPTY_SET, BININT, BININT1, BININT2, BINFLOAT, BINUNICODE, SHORT_BINSTRING, BINPERSID,
    BINGET, LONG_BINGET, BINPUT, LONG_BINPUT, LONG1}))
#: What ``pickle.dump`` writes for plain data and dataclasses at protocols 2 to 5.
PICKLE = Dialect("pickle", TORCH.opcodes | frozenset({
    FRAME, SHORT_BINUNICODE, BINUNICODE8, SHORT_BINBYTES, BINBYTES, BINBYTES8, MEMOIZE,
    STACK_GLOBAL, ADDITEMS, FROZENSET, LONG4, POP, POP_MARK, DUP}))

_NAMES = {value: name for name, value in globals().items() if name.isupper() and isinstance(value, int)}
_u1 = struct.Struct("<B").unpack_from
_u2 = struct.Struct("<H").unpack_from
_i4 = struct.Struct("<i").unpack_from
_u4 = struct.Struct("<I").unpack_from
_u8 = struct.Struct("<Q").unpack_from
_f8 = struct.Struct(">d").unpack_from


class Refused(Exception):
    """Raised by the interpreter, or by a stand-in refusing its arguments or state: :func:`load`
    reports it as a :class:`CorruptCheckpointError` naming the file and the opcode."""


def key_hashes_cheaply(value: object) -> bool:
    """Whether ``value`` may be a dictionary key or set member: hashing it costs constant time.

    Strings and bytes cache their hash; a stand-in object hashes by identity; a number of at
    most 64 bits and a flat tuple of at most :data:`MAX_KEY_ITEMS` such atoms hash in a few
    steps. A deeper tuple could share its parts exponentially (``((x, x), (x, x))``), and an
    integer of a million digits takes a million steps each time it is hashed.
    """
    if type(value) is tuple:
        return len(value) <= MAX_KEY_ITEMS and all(_atom(item) for item in value)
    return _atom(value)


def _atom(value: object) -> bool:
    if isinstance(value, int):
        return value.bit_length() <= 64
    return isinstance(value, _KEY_ATOMS) or (
        not isinstance(value, _BUILTINS) and type(value).__hash__ is object.__hash__)


def _key(value: object) -> object:
    if type(value) is str:  # nearly every key: strings cache their hash
        return value
    if not key_hashes_cheaply(value):
        raise Refused(f"a dictionary key or set member that is a {type(value).__name__} "
                       f"({'too long or nested' if isinstance(value, (tuple, int)) else 'not hashable'}); "
                       "checkpoints key by names and numbers")
    return value


class SafeDict(dict):
    """A dictionary a stand-in builds from pickle data (``collections.OrderedDict(pairs)`` through
    ``REDUCE``, DeepSpeed's ``argparse.Namespace``): each key passes :func:`key_hashes_cheaply`
    before it is hashed, as ``SETITEM(S)`` keys do. ``dict(pairs)`` would hash a key that is a
    tuple shared many ways for a time exponential in its nesting -- ``torch.load(weights_only=True)``
    hangs on such a file.

    The pairs are any iterable of two-item tuples or lists (what ``dict`` takes), or a dictionary
    this interpreter built (its keys were checked when it was built).
    """

    def __init__(self, items: Any = (), /) -> None:
        super().__init__()
        if isinstance(items, dict):
            self.update(items)
            return
        for pair in items:
            if type(pair) not in (tuple, list) or len(pair) != 2:
                raise Refused(f"a dictionary built from a {type(pair).__name__} where a (key, value) "
                              "pair belongs")
            self[_key(pair[0])] = pair[1]


def load(data: bytes, where: str, dialect: Dialect, find_class: Callable[[str, str], Any],
         persistent_load: Callable[[Any], Any] | None = None, budget: Budget | None = None) -> Any:
    """The object the pickle ``data`` describes, built from ``find_class``'s stand-ins.

    ``persistent_load`` receives each ``BINPERSID`` id (``None``: persistent ids are refused).
    ``budget`` (default: the allowance alone, no array bytes credited) is charged one unit per
    opcode, which bounds the objects built.
    """
    budget = budget if budget is not None else Budget(where)
    interpreter = _Interpreter(data, dialect, find_class, persistent_load, budget)
    try:
        return interpreter.run()
    except ShimError:
        raise
    except Refused as refusal:
        raise CorruptCheckpointError(_message(where, interpreter, str(refusal))) from None
    except (IndexError, KeyError, struct.error):  # a stack, mark or memo that is not there
        raise CorruptCheckpointError(_message(
            where, interpreter, "an opcode whose operands are not on the stack or in the memo")) from None
    except (TypeError, ValueError, AttributeError, OverflowError, UnicodeDecodeError,
            RecursionError, MemoryError) as error:  # a stand-in given arguments it does not take
        raise CorruptCheckpointError(_message(
            where, interpreter, describe(error, 200))) from None


def _message(where: str, interpreter: _Interpreter, what: str) -> str:
    name = _NAMES.get(interpreter.op, f"0x{interpreter.op:02x}")
    return (f"{where}: does not unpickle: {what} (opcode {name} at byte {interpreter.at}); the "
            "pickle is damaged or was not written by the library that names this file. Re-copy it "
            "from the original.")


class _Interpreter:
    """One run over one pickle; its loop is written for speed (locals, one ``if`` chain with
    the opcodes ``torch.save`` writes most often first: memo puts, small ints, memo gets)."""

    def __init__(self, data: bytes, dialect: Dialect, find_class, persistent_load, budget: Budget) -> None:
        self.data, self.dialect = memoryview(data).cast("B") if not isinstance(data, bytes) else data, dialect
        self.find_class, self.persistent_load, self.budget = find_class, persistent_load, budget
        self.op, self.at = 0, 0

    def run(self) -> Any:  # noqa: C901 - one dispatch loop, by design
        data, end = self.data, len(self.data)
        allowed = bytes(1 if i in self.dialect.opcodes else 0 for i in range(256))
        find_class, budget = self.find_class, self.budget
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        memo: dict[int, Any] = {}
        push = stack.append
        pos = at = op = 0
        left = budget.left()
        try:
            while True:
                if pos >= end:
                    raise Refused("the pickle ends without STOP")
                at = pos
                op = data[pos]
                pos += 1
                if not allowed[op]:
                    raise Refused(f"an opcode {self.dialect.name} files do not use")
                left -= 1
                if left < 0:
                    budget.spend(budget.left() + 1)  # raises, naming the budget
                if op == LONG_BINPUT:
                    memo[_u4(data, pos)[0]] = stack[-1]
                    pos += 4
                elif op == BININT1:
                    push(data[pos])
                    pos += 1
                elif op == BINGET:
                    push(memo[data[pos]])
                    pos += 1
                elif op == MARK:
                    metastack.append(stack)
                    stack = []
                    push = stack.append
                elif op == BINUNICODE:  # inline: every key and storage name is one
                    (n,) = _u4(data, pos)
                    pos += 4
                    if pos + n > end:
                        raise Refused(f"a string of {n} bytes where the pickle has {end - pos}")
                    push(str(data[pos:pos + n], "utf-8", "surrogatepass"))
                    pos += n
                elif op == REDUCE:
                    args = stack.pop()
                    if type(args) is not tuple:
                        raise Refused("REDUCE with arguments that are not a tuple")
                    stack[-1] = _callable(stack[-1], "REDUCE")(*args)
                elif op == TUPLE:
                    items = tuple(stack)
                    stack = metastack.pop()
                    push = stack.append
                    push(items)
                elif op == TUPLE2:
                    stack[-2:] = [(stack[-2], stack[-1])]
                elif op == EMPTY_TUPLE:
                    push(())
                elif op == BINPERSID:
                    if self.persistent_load is None:
                        raise Refused("a persistent id, which this kind of file never holds")
                    stack[-1] = self.persistent_load(stack[-1])
                elif op == NEWFALSE:
                    push(False)
                elif op == BINPUT:
                    memo[data[pos]] = stack[-1]
                    pos += 1
                elif op == LONG_BINGET:
                    push(memo[_u4(data, pos)[0]])
                    pos += 4
                elif op == TUPLE1:
                    stack[-1] = (stack[-1],)
                elif op == TUPLE3:
                    stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
                elif op == SETITEMS:
                    items = stack
                    stack = metastack.pop()
                    push = stack.append
                    target = _mapping(stack[-1])
                    if len(items) % 2:
                        raise Refused("SETITEMS with a key and no value")
                    for i in range(0, len(items), 2):
                        target[_key(items[i])] = items[i + 1]
                elif op == MEMOIZE:
                    memo[len(memo)] = stack[-1]
                elif op == SHORT_BINUNICODE:
                    pos = _text(data, pos + 1, data[pos], end, push)
                elif op == NEWTRUE:
                    push(True)
                elif op == NONE:
                    push(None)
                elif op == SETITEM:
                    value, key = stack.pop(), stack.pop()
                    _mapping(stack[-1])[_key(key)] = value
                elif op == EMPTY_DICT:
                    push({})
                elif op == EMPTY_LIST:
                    push([])
                elif op == APPEND:
                    item = stack.pop()
                    _list(stack[-1]).append(item)
                elif op == APPENDS:
                    items = stack
                    stack = metastack.pop()
                    push = stack.append
                    _list(stack[-1]).extend(items)
                elif op == BUILD:
                    state = stack.pop()
                    _build(stack[-1], state)
                elif op == NEWOBJ:
                    args, cls = stack.pop(), stack.pop()
                    if type(args) is not tuple or not isinstance(_callable(cls, "NEWOBJ"), type):
                        raise Refused("NEWOBJ of something that is not an allowed class")
                    push(cls.__new__(cls, *args))
                elif op == GLOBAL:
                    first = _line(data, pos, end)
                    second = _line(data, first + 1, end)
                    module, name = _utf8(data[pos:first]), _utf8(data[first + 1:second])
                    pos = second + 1
                    push(find_class(module, name))
                elif op == STACK_GLOBAL:
                    name, module = stack.pop(), stack.pop()
                    if type(module) is not str or type(name) is not str:
                        raise Refused("STACK_GLOBAL with a module or name that is not a string")
                    push(find_class(module, name))
                elif op == BININT:
                    push(_i4(data, pos)[0])
                    pos += 4
                elif op == BININT2:
                    push(_u2(data, pos)[0])
                    pos += 2
                elif op == BINFLOAT:
                    push(_f8(data, pos)[0])
                    pos += 8
                elif op == LONG1 or op == LONG4:
                    (n,) = _u1(data, pos) if op == LONG1 else _i4(data, pos)
                    pos += 1 if op == LONG1 else 4
                    if n < 0 or pos + n > end:
                        raise Refused(f"an integer of {n} bytes where the pickle has {end - pos}")
                    push(int.from_bytes(data[pos:pos + n], "little", signed=True))
                    pos += n
                elif op == BINUNICODE8:
                    (n,) = _u8(data, pos)
                    pos = _text(data, pos + 8, n, end, push)
                elif op == SHORT_BINSTRING:  # torch.load decodes Python 2 strings as UTF-8
                    n = data[pos]
                    if pos + 1 + n > end:
                        raise Refused(f"a string of {n} bytes where the pickle has {end - pos - 1}")
                    push(_utf8(data[pos + 1:pos + 1 + n]))
                    pos += 1 + n
                elif op in (SHORT_BINBYTES, BINBYTES, BINBYTES8):
                    size = {SHORT_BINBYTES: 1, BINBYTES: 4, BINBYTES8: 8}[op]
                    n = int.from_bytes(data[pos:pos + size], "little")
                    pos += size
                    if pos + n > end:
                        raise Refused(f"{n} bytes where the pickle has {end - pos}")
                    push(bytes(data[pos:pos + n]))
                    pos += n
                elif op == EMPTY_SET:
                    push(set())
                elif op == ADDITEMS:
                    items = stack
                    stack = metastack.pop()
                    push = stack.append
                    target = stack[-1]
                    if type(target) is not set:
                        raise Refused(f"ADDITEMS to a {type(target).__name__}")
                    target.update(map(_key, items))
                elif op == FROZENSET:
                    items = stack
                    stack = metastack.pop()
                    push = stack.append
                    push(frozenset(map(_key, items)))
                elif op == POP:
                    if stack:
                        stack.pop()
                    else:
                        stack = metastack.pop()
                        push = stack.append
                elif op == POP_MARK:
                    stack = metastack.pop()
                    push = stack.append
                elif op == DUP:
                    push(stack[-1])
                elif op == FRAME:  # a buffering hint: its 8-byte length must fit the pickle
                    (n,) = _u8(data, pos)
                    pos += 8
                    if pos + n > end:
                        raise Refused(f"a frame of {n} bytes where the pickle has {end - pos}")
                elif op == PROTO:
                    if data[pos] > MAX_PROTOCOL:
                        raise Refused(f"pickle protocol {data[pos]}")
                    pos += 1
                elif op == STOP:
                    if len(stack) != 1 or metastack:
                        raise Refused("STOP with other than one object left")
                    budget.spend(budget.left() - left)
                    return stack[0]
                else:  # pragma: no cover - every allowed opcode has a branch
                    raise Refused("an opcode ckptshim does not interpret")
        except BaseException:
            self.at, self.op = at, op  # where it went wrong, for the message
            raise


def _text(data, start: int, n: int, end: int, push) -> int:
    if start + n > end:
        raise Refused(f"a string of {n} bytes where the pickle has {end - start}")
    push(str(data[start:start + n], "utf-8", "surrogatepass"))
    return start + n


def _line(data, start: int, end: int) -> int:
    """The position of the newline that ends the line starting at ``start`` (at most 256 bytes)."""
    for i in range(start, min(end, start + 257)):
        if data[i] == 0x0A:
            return i
    raise Refused("a GLOBAL whose module or name is not a line of at most 256 bytes")


def _utf8(raw) -> str:
    return bytes(raw).decode("utf-8")


def _callable(value: Any, opcode: str) -> Any:
    """Only what ``find_class`` returned is ever called: never data built from the pickle."""
    if isinstance(value, _BUILTINS) or not callable(value):
        raise Refused(f"{opcode} of a {type(value).__name__}, which is not an allowed global")
    return value


def _mapping(target: Any) -> dict:
    if not isinstance(target, dict):
        raise Refused(f"SETITEM on a {type(target).__name__}, not a dictionary")
    return target


def _list(target: Any) -> list:
    if type(target) is not list:
        raise Refused(f"APPEND to a {type(target).__name__}, not a list")
    return target


def _build(instance: Any, state: Any) -> None:
    """Apply ``BUILD`` through the stand-in's own ``__setstate__``; nothing else takes state."""
    setstate = getattr(type(instance), "__setstate__", None)
    if setstate is None:
        raise Refused(f"BUILD on a {type(instance).__name__}, which takes no state")
    setstate(instance, state)
