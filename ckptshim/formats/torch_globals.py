"""The globals a ``torch.save`` pickle may name -- exactly those ``torch.load(weights_only=True)``
allows in this process -- and the inert stand-in ckptshim builds for each.

torch's ``weights_only`` unpickler allows a set of globals it computes itself (``OrderedDict``,
``torch.Size``, the tensor rebuild functions, storage types, dtypes, ``torch.device``,
``torch.Tensor``...) plus whatever the process has put in torch's safe-globals registry:
``torch.serialization.add_safe_globals``, the ``safe_globals`` context manager, and the
libraries that register their own classes when imported (torchao its float8 tensor subclass and
its configuration tuples). :class:`Globals` takes both from torch at the moment of the read, so
the decision is torch's own, never a list written here (:func:`allowed_globals`; reading a
torch pickle therefore imports torch, and without torch installed it is refused as unreadable). A
global in a module torch blocks (``os``, ``sys``, ``posix``, ``nt``) is refused even when
registered, as torch refuses it.

What ckptshim builds for an allowed global follows from what torch allows it as: a dtype, a
storage type, a tensor type, a quantization scheme; the few globals a state dict uses beyond
those -- containers, ``torch.Size``, ``torch.device``, layouts, the tensor rebuild functions --
each have their own builder (:data:`BUILDERS`). An allowed global ckptshim has no builder for
(sparse, quantized, nested or meta tensors, a dtype it has no name for) is refused as a form it
does not read (``UnknownFormatError``), never as unsafe.

What it hands the unpickler is never the real global, so nothing from the checkpoint runs --
not even the code of a class the process trusts:

- tensors: ``_rebuild_tensor_v2`` builds a :class:`TensorRef` (a strided window onto a
  :class:`StorageRef`); ``_rebuild_parameter(_with_state)`` returns that tensor;
- tensor subclasses: ``_rebuild_from_type_v2(func, type, args, state)`` with torch's own
  ``Tensor`` or ``Parameter`` as the type is the tensor ``func`` rebuilds (its Python attributes
  set aside). With a registered subclass that wraps one tensor of its values (listed in
  :mod:`ckptshim.layouts.subclasses`: torchao's ``WeightWithDynamicFloat8CastTensor``), rebuilt
  storage-less by ``_rebuild_wrapper_subclass``, it is the inner tensor its attributes hold,
  which must have the wrapper's shape and dtype. Any other subclass is refused as a form
  ckptshim does not read: which of its parts holds the values only its own code knows;
- every other registered global is an inert value that takes any arguments and any ``BUILD``
  state and keeps none of them (torchao's ``LinearMMConfig``, an enum member).

So a registered subclass's ``__new__``, ``__init__``, ``__setstate__`` and ``__setattr__`` never
run on checkpoint data; what ckptshim keeps of it is the inner tensor's record (its bytes are
read later, by the caller) and nothing of the wrapper but its type's name, checked.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptshim.errors import UnknownFormatError, UnsafeCheckpointError
from ckptshim.formats import safe_pickle
from ckptshim.formats.base import storage_dtype
from ckptshim.inventory import DTYPE_SIZES
from ckptshim.layouts.subclasses import WRAPPED_VALUES, values_attribute

def dtype_of(value: Any) -> str | None:
    """ckptshim's name for the dtype a ``torch.<dtype>`` global built (see :class:`Globals`), or
    ``None`` when ``value`` is not one."""
    return value.name if isinstance(value, _Dtype) else None


# -- the records a pickle becomes -----------------------------------------------------------------


@dataclass(frozen=True)
class StorageRef:
    """One storage record of the archive: the ``data/<key>`` member, its dtype and length."""

    key: str
    dtype: str
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * storage_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class TensorRef:
    """A tensor as the pickle describes it: a strided window (in elements) onto a storage."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def extent(self) -> int:
        """Elements of the storage the window reaches (0 for a tensor with no elements)."""
        if 0 in self.shape:
            return 0
        return self.offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))


# -- stand-ins the pickle builds (turned into records once it has been read) ----------------------


class _StorageType:
    """``torch.<T>Storage``, the type named in a storage record, by the dtype torch gives it."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class Storage:
    """What a persistent id stands for: its storage record. ``torch.load`` lets ``BUILD`` give a
    storage attributes, which change nothing it reads; so does this stand-in."""

    __slots__ = ("ref",)

    def __init__(self, ref: StorageRef) -> None:
        self.ref = ref

    def __setstate__(self, state: Any) -> None:
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        if not all(part is None or isinstance(part, dict) for part in parts):
            raise safe_pickle.Refused(f"a storage given a {type(state).__name__} as its attributes")


class Tensor:
    """What ``_rebuild_tensor_v2`` returned; ``BUILD`` cannot change it (torch.save never
    writes one there, and torch refuses a dictionary as a tensor's state)."""

    __slots__ = ("ref",)

    def __init__(self, ref: TensorRef) -> None:
        self.ref = ref

    def __setstate__(self, state: Any) -> None:
        raise safe_pickle.Refused(
            "a tensor record followed by BUILD, which would change it after it was checked; "
            "torch.save never writes that")


class _StateDict(safe_pickle.SafeDict):
    """``collections.OrderedDict``, built from pairs as :class:`~ckptshim.formats.safe_pickle.SafeDict`
    builds a dictionary (keys that hash in constant time). ``BUILD`` may give it attributes, as
    torch.save writes a state dict's ``_metadata``; an attribute that would hide one of the
    dictionary's own methods (``values``, ``items``, ``keys``...) is refused, since the tensors
    would be read through it."""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, dict) and all(isinstance(name, str) for name in state)):
            raise safe_pickle.Refused(
                f"an OrderedDict given a {type(state).__name__} as its attributes; torch.save "
                "writes a dictionary of attribute names there")
        hiding = sorted(name for name in state if hasattr(collections.OrderedDict, name))
        if hiding:
            raise safe_pickle.Refused(
                f"an OrderedDict given the attribute(s) {', '.join(hiding)[:200]}, which would hide "
                "the dictionary's own methods of that name (and the tensors read through them); "
                "a state dict never carries such attributes")


@dataclass(frozen=True)
class _Dtype:
    """A ``torch.<dtype>`` global, by ckptshim's name for it."""

    name: str


class Size(tuple):
    """``torch.Size(dims)``: a tuple of integers >= 0, kept as its own type so that whoever turns
    the records back into torch objects (DCP's metadata) knows it was a ``torch.Size``."""

    __slots__ = ()


class Layout(str):
    """``torch.serialization._get_layout(name)``: a layout by its name (``"torch.strided"``)."""

    __slots__ = ()


@dataclass(frozen=True)
class Unreadable:
    """A global torch allows whose values ckptshim cannot read from the pickle (a sparse, quantized,
    nested or meta tensor's rebuild function, a dtype ckptshim has no name for): naming it in a
    pickle is refused as an unknown form, not as unsafe."""

    name: str
    kind: str

    def error(self, where: str) -> UnknownFormatError:
        return UnknownFormatError(
            f"{where} holds {self.kind} {self.name}, which torch.load(weights_only=True) allows but "
            "ckptshim does not read yet. Load it without ckptshim: torch.load(..., weights_only=True) "
            "for a torch.save file, dcp.load with the hook off (CKPTSHIM_DISABLE_HOOKS=torch-dcp) "
            "for a DCP checkpoint.")


class _Inert:
    """A value torch allows and ckptshim never uses -- a device, a layout, an instance of a
    registered class that is not a tensor: built from any arguments (a registered class's own
    constructor never runs to check them), given any state, it keeps nothing."""

    def __new__(cls, *args: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _TensorType:
    """A tensor type a pickle names: torch's own ``Tensor``/``Parameter`` (``plain``), or a
    subclass in torch's safe-globals registry. It only names the type a tensor is rebuilt as."""

    def __init__(self, name: str, plain: bool) -> None:
        self.name, self.plain = name, plain

    def __call__(self, *args: Any) -> Any:
        raise safe_pickle.Refused(f"a call of {self.name}; torch.save rebuilds tensors through "
                                  "torch._utils and torch._tensor, never by calling their type")


class _Wrapper:
    """What ``_rebuild_wrapper_subclass`` returned: a storage-less tensor subclass of a dtype and
    shape, whose values its attributes (given by ``_rebuild_from_type_v2``) hold."""

    __slots__ = ("type", "dtype", "shape")

    def __init__(self, type_: _TensorType, dtype: str, shape: tuple[int, ...]) -> None:
        self.type, self.dtype, self.shape = type_, dtype, shape

    def __setstate__(self, state: Any) -> None:
        raise safe_pickle.Refused(f"BUILD on a {self.type.name} rebuilt by _rebuild_wrapper_subclass; "
                                  "torch.save gives a subclass its attributes through _rebuild_from_type_v2")


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> Tensor:
    """A tensor record, once its arguments are what ``torch.save`` writes: a storage record,
    a non-negative offset, and sizes and strides as equally long tuples of ints (sizes >= 0)."""
    if not (type(storage) is Storage and _is_int(storage_offset) and storage_offset >= 0
            and _is_shape(size, stride)):
        raise safe_pickle.Refused(
            "a tensor record that is not (storage, offset, sizes, strides): "
            f"({', '.join(type(a).__name__ for a in (storage, storage_offset, size, stride))})")
    return Tensor(TensorRef(storage.ref, storage_offset, size, stride))


def _rebuild_tensor_v3(storage, storage_offset, size, stride, _requires_grad=False, _hooks=None, dtype=None,
                       *_ignored) -> Tensor:
    """A tensor record of a dtype torch stores in an untyped storage (``uint16``, ``float8``...):
    the storage's bytes seen as ``dtype``, which must divide them exactly. The first record of a
    storage decides its type, as for :func:`_rebuild_tensor`; a storage read as two dtypes is
    refused as a form ckptshim does not read."""
    tensor = _rebuild_tensor(storage, storage_offset, size, stride)
    if type(dtype) is not _Dtype:
        raise safe_pickle.Refused(f"_rebuild_tensor_v3 with a {type(dtype).__name__} as its dtype")
    ref = tensor.ref.storage
    if ref.dtype == dtype.name:
        return tensor
    itemsize = storage_dtype(dtype.name).itemsize
    if ref.dtype != "uint8" or ref.numel % itemsize:
        raise UnknownFormatError(f"a {dtype.name} tensor on a storage of {ref.numel} {ref.dtype} elements, "
                                 "which ckptshim does not read (one storage seen as two dtypes)")
    typed = StorageRef(ref.key, dtype.name, ref.numel // itemsize)
    storage.ref = typed  # later records of this storage see it typed, as the first one decided
    return Tensor(dataclasses.replace(tensor.ref, storage=typed))


def _rebuild_parameter(data, *_ignored):
    return data


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad) -> _Wrapper:
    """torch's ``_rebuild_wrapper_subclass``, without making the tensor: the registered subclass,
    dtype and shape it would have."""
    if not (isinstance(cls, _TensorType) and not cls.plain and type(dtype) is _Dtype and _is_shape(size, stride)):
        raise safe_pickle.Refused(
            "a tensor subclass record that is not (registered subclass, dtype, sizes, strides, ...): "
            f"({', '.join(type(a).__name__ for a in (cls, dtype, size, stride))})")
    return _Wrapper(cls, dtype.name, size)


def _device(kind, index=None) -> _Inert:
    """``torch.device(kind[, index])``, where torch would place a tensor: ckptshim reads bytes
    into whatever the caller's destination is, so only the arguments' form is checked."""
    if type(kind) is not str or not (index is None or _is_int(index)):
        raise safe_pickle.Refused(f"torch.device of ({type(kind).__name__}, {type(index).__name__})")
    return _Inert()


def _layout(name) -> Layout:
    """``torch.serialization._get_layout(name)``: a layout by its name (``"torch.strided"``)."""
    if type(name) is not str or not name.startswith("torch."):
        raise safe_pickle.Refused(f"torch.serialization._get_layout of a {type(name).__name__}")
    return Layout(name)


def _size(dims: Any = ()) -> Size:
    """``torch.Size(dims)``, as ``torch.Size.__reduce__`` writes it: one tuple of integers >= 0."""
    if type(dims) is not tuple or not _all_ints(dims, 0):
        raise safe_pickle.Refused(f"torch.Size of a {type(dims).__name__} that is not a tuple of integers >= 0")
    return Size(dims)


def members(kind: type) -> Callable[..., Any]:
    """``set``/``frozenset`` of an iterable (protocol 2 pickles them so), whose members must hash
    in constant time."""
    def build(items: Sequence = ()) -> Any:
        if type(items) is not list or not all(map(safe_pickle.key_hashes_cheaply, items)):
            raise safe_pickle.Refused(f"a {kind.__name__} of other than a list of names or numbers")
        return kind(items)
    return build


def _counter(counts: Any = None) -> dict:
    """``collections.Counter`` (protocol 2 pickles one as ``Counter({key: count})``): a dict."""
    if counts is None:
        return {}
    if type(counts) is not dict:
        raise safe_pickle.Refused(f"a Counter of a {type(counts).__name__}, not a dictionary")
    return dict(counts)


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    """``complex(real, imag)`` of two numbers (as pickle writes a complex value)."""
    if not all(type(part) in (int, float) for part in (real, imag)):
        raise safe_pickle.Refused("complex() of other than two numbers")
    return complex(real, imag)


def _bytearray(data: Any = b"", *encoding: str) -> bytearray:
    """``bytearray`` of bytes, or of text and its encoding (never of a length, which would
    allocate it: pickle never writes that)."""
    if type(data) is str and encoding in (("latin1",), ("latin-1",)):
        return bytearray(data.encode("latin1"))
    if type(data) is not bytes or encoding:
        raise safe_pickle.Refused(f"bytearray of a {type(data).__name__}, not of bytes")
    return bytearray(data)


def encode(text: Any, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode(text, "latin1")``: how protocol 2 pickles carry bytes (torch.save's, numpy's)."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise safe_pickle.Refused(f"_codecs.encode({type(text).__name__}, {encoding!r}), which is not how "
                                  "a pickle carries bytes")
    return text.encode("latin1")


def _is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_shape(size: object, stride: object) -> bool:
    return (type(size) is tuple and type(stride) is tuple and len(size) == len(stride)
            and _all_ints(size, 0) and _all_ints(stride, None))


def _all_ints(values: tuple, low: int | None) -> bool:
    """Every value an int (not a bool), at least ``low`` if given (a plain loop: it runs for
    every tensor of a state dict)."""
    for value in values:
        if type(value) is not int or (low is not None and value < low):
            return False
    return True


def _attributes(state: Any) -> dict[str, Any]:
    """The Python attributes ``_rebuild_from_type_v2`` would set: ``state`` as torch's
    ``_set_obj_state`` takes it (a dict, or a (dict, slots dict) pair, either part possibly
    ``None``), names being strings (``setattr`` takes nothing else)."""
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    if not all(part is None or isinstance(part, dict) for part in parts):
        raise safe_pickle.Refused(f"a tensor given a {type(state).__name__} as its attributes; torch.save "
                                  "writes a dictionary of attribute names there")
    attributes = {name: value for part in parts if part for name, value in part.items()}
    if not all(type(name) is str for name in attributes):
        raise safe_pickle.Refused("a tensor given attributes whose names are not strings, which torch "
                                  "cannot set either")
    return attributes


_TENSOR_REBUILDS = (_rebuild_tensor, _rebuild_tensor_v3, _rebuild_parameter, _rebuild_wrapper_subclass)
_PLAIN_TYPES = {name: _TensorType(name, plain=True) for name in ("torch.Tensor", "torch.nn.parameter.Parameter")}


#: What ckptshim builds for the globals of torch's allow-list that a state dict uses beyond dtypes,
#: storage and tensor types (by torch's name for each): whether each is allowed is torch's call.
BUILDERS: Mapping[str, Any] = {
    "collections.OrderedDict": _StateDict,
    "collections.Counter": _counter,
    "builtins.set": members(set),
    "builtins.complex": _complex,
    "builtins.bytearray": _bytearray,
    "_codecs.encode": encode,
    "torch.Size": _size,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
    "torch.device": _device,
    "torch.serialization._get_layout": _layout,
    **_PLAIN_TYPES,
}
#: Built by :meth:`Globals.rebuild_from_type`, which needs the archive's own state.
_REBUILD_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"


def _torch() -> Any:
    """torch, for its allow-list; a pickle ckptshim cannot check against it is not read."""
    try:
        import torch._weights_only_unpickler  # noqa: F401 - the module whose decisions ckptshim takes
    except ImportError as error:
        raise UnknownFormatError(
            "reading a torch pickle needs torch: ckptshim allows exactly the globals "
            "torch.load(weights_only=True) allows, and asks torch which those are "
            f"({type(error).__name__}: {error}). Install torch (pip install torch).") from None
    return sys.modules["torch"]


@functools.cache
def _allowed_stand_ins() -> Mapping[str, Any]:
    """torch's own ``weights_only`` allow-list (computed by torch, once per process), each global
    by torch's name for it, as the stand-in ckptshim builds in its place."""
    torch = _torch()
    return {name: BUILDERS.get(name) or _by_kind(torch, name, value)
            for name, value in torch._weights_only_unpickler._get_allowed_globals().items()}


def allowed_globals(where: str) -> Mapping[str, Any]:
    """torch's allow-list as stand-ins (see :func:`_allowed_stand_ins`); ``where`` names the file
    whose read needs it, should torch be missing."""
    try:
        return _allowed_stand_ins()
    except UnknownFormatError as error:
        raise UnknownFormatError(f"{where}: {error}") from None


def _by_kind(torch: Any, name: str, value: Any) -> Any:
    """The stand-in for a global torch allows as a dtype, storage type, tensor type or
    quantization scheme; anything else torch allows (sparse, quantized, nested, meta tensors'
    rebuild functions) ckptshim does not read."""
    if isinstance(value, torch.dtype):
        dtype = name.removeprefix("torch.")
        return _Dtype(dtype) if dtype in DTYPE_SIZES else Unreadable(name, "dtype")
    if isinstance(value, torch.serialization.StorageType) or value is torch.UntypedStorage:
        dtype = str(value.dtype if value is not torch.UntypedStorage else torch.uint8).removeprefix("torch.")
        return _StorageType(dtype) if dtype in DTYPE_SIZES else Unreadable(name, "storage type")
    if value in torch._tensor_classes:
        return _TensorType(name, plain=False)
    if isinstance(value, torch.qscheme):
        return _Inert
    return Unreadable(name, "the global")


def blocked_modules() -> frozenset[str]:
    """The modules torch's weights_only unpickler never takes a global from, registered or not."""
    return frozenset(getattr(_torch()._weights_only_unpickler, "_blocklisted_modules", ("sys", "os", "posix", "nt")))


#: Extra globals a caller allows for one read: ``(module, name)`` -> the inert stand-in to
#: build instead (a function or class that makes plain data, never the real global).
ExtraGlobals = Mapping[tuple[str, str], Callable[..., Any]]


class Globals:
    """``find_class`` and ``persistent_load`` for one archive: the allow-list (torch's registry
    read at the first global outside ckptshim's own), and storage records by key -- the first
    record of a key is the storage, as in ``torch.load``, which hands every later record of that
    key the same storage whatever dtype or size it names."""

    def __init__(self, where: str, extra: ExtraGlobals | None) -> None:
        self.where = where
        self.extra = {f"{module}.{name}": stand_in for (module, name), stand_in in (extra or {}).items()}
        self.storages: dict[str, StorageRef] = {}
        self._registered: dict[str, Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"  # as torch matches globals: by the joined name
        found = allowed_globals(self.where).get(full) or self.extra.get(full)
        if full == _REBUILD_FROM_TYPE and found is not None:
            return self.rebuild_from_type
        if isinstance(found, Unreadable):
            raise found.error(self.where)
        if found is not None:
            return found
        found = self._registered_globals().get(full) if module not in blocked_modules() else None
        if found is None:
            raise UnsafeCheckpointError(_unsafe_message(self.where, full))
        return found

    def _registered_globals(self) -> dict[str, Any]:
        """Stand-ins for what torch's safe-globals registry holds now, by the name torch matches
        each by (``module.qualname``, or the name given with it); empty when torch is not imported."""
        if self._registered is None:
            serialization = sys.modules.get("torch.serialization")
            entries = serialization.get_safe_globals() if serialization is not None else []
            self._registered = {}
            for entry in entries:
                value, name = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, None)
                if name is None:
                    name = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
                if isinstance(name, str):
                    self._registered[name] = _stand_in(name, value)
        return self._registered

    def rebuild_from_type(self, func, new_type, args, state) -> Tensor:
        """``torch._tensor._rebuild_from_type_v2``: the tensor ``func(*args)`` rebuilds, as torch's
        own type or as a registered wrapper of one tensor of its values (see the module docstring)."""
        if not isinstance(new_type, _TensorType):
            raise safe_pickle.Refused("_rebuild_from_type_v2 to a type that is not a tensor type (a "
                                      "registered class that does not derive from torch.Tensor)")
        if func not in _TENSOR_REBUILDS or type(args) is not tuple:
            raise safe_pickle.Refused(
                f"_rebuild_from_type_v2 to {new_type.name} with something other than torch's tensor "
                "rebuild functions and their arguments; torch.save never writes that")
        value, attributes = func(*args), _attributes(state)
        if new_type.plain:
            if type(value) is not Tensor:
                raise safe_pickle.Refused(f"a {type(value).__name__} rebuilt as {new_type.name}, which "
                                          "torch.save writes for plain tensors only")
            return value
        attribute = values_attribute(new_type.name)
        if attribute is None:
            raise self._unreadable(new_type.name)
        if type(value) is not _Wrapper or value.type.name != new_type.name:
            raise safe_pickle.Refused(f"a {new_type.name} not rebuilt by _rebuild_wrapper_subclass as one, "
                                      "as torch.save writes it")
        inner = attributes.get(attribute)
        if type(inner) is not Tensor or inner.ref.shape != value.shape or inner.ref.storage.dtype != value.dtype:
            raise safe_pickle.Refused(
                f"a {new_type.name} {value.dtype}{list(value.shape)} whose {attribute} is not a "
                "tensor of that dtype and shape; the wrapper's values are that tensor's")
        return inner

    def _unreadable(self, name: str) -> UnknownFormatError:
        return UnknownFormatError(
            f"{self.where} holds tensors of type {name}, a tensor subclass that torch allows in this "
            "process but whose values ckptshim cannot read from its parts (it reads torch's own "
            "tensors and subclasses wrapping one tensor of their values: "
            f"{', '.join(sorted(WRAPPED_VALUES))}). Load it without ckptshim: torch.load(..., "
            "weights_only=True) for a torch.save file, dcp.load with the hook off "
            "(CKPTSHIM_DISABLE_HOOKS=torch-dcp) for a DCP checkpoint.")

    def persistent_load(self, pid: Any) -> Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise safe_pickle.Refused(f"an unexpected storage record (a {type(pid).__name__})")
        _, storage_type, key, _location, numel = pid
        if not (_is_int(numel) and numel >= 0 and isinstance(key, str)):
            raise safe_pickle.Refused(f"a storage record whose key or element count is not one "
                                      f"({type(key).__name__}, {type(numel).__name__})")
        found = self.storages.get(key)
        if found is None:
            found = self.storages[key] = StorageRef(key, storage_type.dtype, numel)
        return Storage(found)


def _stand_in(name: str, value: Any) -> Any:
    """The stand-in for a registered global: a tensor subclass is a type tensors are rebuilt as,
    anything else an inert value."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, type) and issubclass(value, torch.Tensor):
        return _TensorType(name, plain=False)
    return _Inert


def _unsafe_message(where: str, first: str) -> str:
    """Why a file naming the global ``first`` is refused, and what to do about it. Only the
    first global the pickle names is known: nothing more of a refused file is read (torch's own
    ``get_unsafe_globals_in_checkpoint`` would parse the hostile file again, with torch)."""
    return (f"{where} needs {first} to unpickle, which torch.load(weights_only=True) "
            "does not allow in this process and ckptshim will not run. If it is a class you trust, "
            "register it with torch.serialization.add_safe_globals (libraries such as torchao "
            "register their own tensor subclasses when imported: import them first); ckptshim then "
            "allows it as torch does. If you trust the whole file, load it yourself with "
            "torch.load(..., weights_only=False), re-save its state dict with torch.save, and load that.")
