"""An allow-listed unpickler that never runs code from a checkpoint and never imports torch.

Every global a pickle names is looked up in an allow list and mapped to an inert stand-in:
tensors become `TensorRef`s (where their bytes are), dtypes become `DType`s, `torch.Size` a tuple.
Anything else is refused at the GLOBAL opcode, before any call could happen, unless the user
passes --trust-pickle. Formats add their own classes (DeepSpeed's loss scaler, DCP metadata).

What the allow list hands out is shared by every pickle ckpt reads, so a pickle must not be able to
change it: a BUILD (or SETITEM, APPEND) on a handed-out object would otherwise rewrite, say, the dtype
table for every later file. Handed-out objects are immutable (frozen slots dataclasses whose
`__setstate__` refuses), callables are wrapped in `Allowed` (no attributes to set), and classes have
the `Sealed` metaclass (no class attribute can be set). What the callables return is fresh. Each
callable checks its arguments' types and charges what it copies to the load's budget; the work a pickle
may cause is bounded in core/pickles/pickle_guard.py.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import functools
import math
import pickle
import secrets
import types
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any

from ckpt_cli.core import heap
from ckpt_cli.core.dtypes import BY_NAME, BY_STORAGE_CLASS, DType
from ckpt_cli.core.pickles import pickle_guard, pickle_stream
from ckpt_cli.core.pickles.frozen import Frozen, Sealed, frozen
from ckpt_cli.core.pickles.pickle_guard import PickleRefused, charge, printable
from ckpt_cli.errors import DataError, UnsafePickleError

MAX_DIMS = 64  # torch.Size of a real tensor; a longer one is not a shape


@frozen(eq=False)
class Allowed(Frozen):
    """An allow-listed callable as a pickle sees it: callable, nothing else (no `__defaults__` to rewrite)."""

    function: Callable[..., Any]
    name: str

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


class TorchSize(tuple[int, ...]):
    """A torch.Size read from a pickle: a tuple that is written back as torch.Size."""

    __slots__ = ()


@frozen
class StorageType(Frozen):
    """Stand-in for torch.<X>Storage classes; UntypedStorage is uint8 with numel in bytes."""

    dtype: DType
    untyped: bool = False


@frozen
class StorageRef(Frozen):
    """A persistent storage reference: record `data/<key>` holding `numel` elements of `dtype`."""

    key: str
    dtype: DType
    numel: int


_NO_ATTRS: Mapping[str, Any] = types.MappingProxyType({})


@frozen
class TensorRef(Frozen):
    """A tensor as pickled: a view (offset, size, stride) of a storage. `attrs`: Python attributes.

    The view is taken as the pickle states it; `view_problem` says whether it lies inside its storage."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: DType
    requires_grad: bool = False
    attrs: Mapping[str, Any] = field(default_factory=lambda: _NO_ATTRS)  # one shared empty mapping: most tensors have none
    is_parameter: bool = False


pickle_guard.CHILDREN[TensorRef] = lambda ref: [ref.attrs]


def view_problem(ref: TensorRef) -> str | None:
    """Why the view cannot be read as stated (None when it can): it must start at or after its storage's
    first element, step forward, end inside the storage, and not repeat storage elements (an expanded
    tensor, stride 0 on a dim of size > 1, would be materialised at its full size)."""
    if ref.storage_offset < 0 or any(st < 0 for st in ref.stride):
        return "a tensor view with a negative offset or stride"
    numel = math.prod(ref.shape)
    if numel == 0:
        return "a tensor view that starts past the end of its storage" if ref.storage_offset > ref.storage.numel else None
    last = ref.storage_offset + sum((n - 1) * st for n, st in zip(ref.shape, ref.stride))
    if last >= ref.storage.numel:
        return "a tensor view that runs past the end of its storage"
    if numel > ref.storage.numel or any(st == 0 and n > 1 for n, st in zip(ref.shape, ref.stride)):
        return "a tensor view that repeats storage elements (an expanded tensor; save it with .contiguous())"
    return None


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS:
        raise PickleRefused(f"a tensor's {what} is not a list of integers")
    for v in value:  # a loop, not all(...): called for every torch.Size of a wide .metadata
        if type(v) is not int:
            raise PickleRefused(f"a tensor's {what} is not a list of integers")
    return tuple(value)


def _shared(dims: tuple[int, ...]) -> tuple[int, ...]:
    """One object for equal shapes and strides: a model-states file of 20,000 per-expert tensors holds a few distinct."""
    found = _DIMS.get(dims)
    if found is None:
        found = dims
        if len(_DIMS) < _SIZES_KEPT:
            _DIMS[dims] = dims
    return found


_DIMS: dict[tuple[int, ...], tuple[int, ...]] = {}


def _view(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any) -> TensorRef:
    """The tensor over `storage`, in the storage's dtype."""
    if not isinstance(storage, StorageRef) or type(storage_offset) is not int:
        raise PickleRefused("a tensor without a storage reference")
    shape, strides = _shared(_ints(size, "size")), _shared(_ints(stride, "stride"))
    if len(shape) != len(strides):
        raise PickleRefused("a tensor whose size and stride differ in length")
    return TensorRef(storage, storage_offset, shape, strides, storage.dtype, requires_grad is True)


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False, *_: Any) -> TensorRef:
    return _view(storage, storage_offset, size, stride, requires_grad)


def _rebuild_tensor_v3(
    storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, backward_hooks: Any, dtype: Any, *_: Any
) -> TensorRef:
    # The storage is untyped (numel counts bytes); the dtype comes last.
    if not isinstance(storage, StorageRef) or not isinstance(dtype, DType):
        raise PickleRefused("a tensor without a storage reference or dtype")
    typed = StorageRef(storage.key, dtype, storage.numel // dtype.itemsize)
    return _view(typed, storage_offset, size, stride, requires_grad)


def _with_attrs(ref: TensorRef, state: Any, **changes: Any) -> TensorRef:
    """`ref` with `changes` and the Python attributes in `state` (a dict, or a tuple ending in one)."""
    if isinstance(state, tuple) and state and isinstance(state[-1], dict):
        state = state[-1]
    attrs = dict(ref.attrs)
    if isinstance(state, dict):
        charge(len(state))
        attrs.update(state)
    return dataclasses.replace(ref, attrs=attrs, **changes)


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any, state: Any = None) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise PickleRefused("a parameter that is not a tensor")
    return _with_attrs(data, state, requires_grad=requires_grad is True, is_parameter=True)


@frozen
class _TensorClass(Frozen):
    """Stand-in for torch.Tensor / torch.nn.Parameter as the `new_type` of _rebuild_from_type_v2."""

    is_parameter: bool


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if not isinstance(new_type, _TensorClass) or not isinstance(args, tuple):
        raise PickleRefused("_rebuild_from_type_v2 of a non-tensor type")
    ref = func(*args)
    if not isinstance(ref, TensorRef):
        return ref
    return _with_attrs(ref, state, is_parameter=ref.is_parameter or new_type.is_parameter)


# ---- builtins a pickle may call, each on the arguments it needs and no more ------------------------------


def _latin1_encode(text: Any, encoding: str = "latin1") -> bytes:
    # Protocol-2 pickles store bytes as _codecs.encode(str, 'latin1'); allow nothing else.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise PickleRefused("_codecs.encode of something other than latin-1 text")
    charge(len(text))
    return codecs.encode(text, "latin1")


def _bytearray(*args: Any) -> bytearray:
    """bytearray(bytes) or bytearray(str, encoding); never bytearray(n), which allocates n bytes."""
    if args and not isinstance(args[0], (bytes, str)):
        raise PickleRefused("bytearray of something other than bytes or text")
    charge(len(args[0]) if args else 0)
    return bytearray(*args)


def _hashable_items(items: Any, what: str) -> list[Any]:
    """The items a set or dict constructor would hash, charged for what hashing them costs."""
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise PickleRefused(f"{what} of something other than a list")
    items = list(items)
    charge(sum(pickle_guard.hash_cost(item, 1 << 20) for item in items))
    return items


def _set(items: Any = ()) -> set[Any]:
    return set(_hashable_items(items, "set"))


def _frozenset(items: Any = ()) -> frozenset[Any]:
    return frozenset(_hashable_items(items, "frozenset"))


def _ordered_dict(items: Any = ()) -> collections.OrderedDict[Any, Any]:
    if items == ():  # how torch pickles one: OrderedDict() then SETITEMS
        return collections.OrderedDict()
    pairs = _hashable_items(items, "OrderedDict")
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise PickleRefused("OrderedDict of something other than pairs")
    _hashable_items([k for k, _ in pairs], "OrderedDict")
    return collections.OrderedDict(pairs)


def _plain(*args: Any) -> tuple[Any, ...]:
    if not all(isinstance(a, (int, float, str, type(None))) for a in args):
        raise PickleRefused("a value built from something other than numbers and text")
    return args


_SIZES: dict[tuple[int, ...], TorchSize] = {}  # equal sizes as one (immutable) object, across loads
_SIZES_KEPT = 1 << 16


def _size(*args: Any) -> TorchSize:
    """A torch.Size, the same object for equal ones: a wide DCP `.metadata` holds three per chunk (600,000 at 64 ranks
    x 2,000 parameters: 35 MB), a few thousand distinct."""
    value = _ints(args[0], "size") if args else ()
    size = _SIZES.get(value)
    if size is None:
        size = TorchSize(value)
        if len(_SIZES) < _SIZES_KEPT:
            _SIZES[value] = size
    return size


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in _plain(*args))


def _layout(name: Any) -> str:
    if not isinstance(name, str):
        raise PickleRefused("a tensor layout that is not a name")
    return name


def _numpy_global(name: str) -> Callable[..., Any]:
    """numpy's pickled globals, checked (numpy is imported when a pickle first names one)."""
    from ckpt_cli.core.pickles import safe_numpy

    return functools.partial(safe_numpy.call, name)


def _base_globals() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Tensor"): _TensorClass(False),
        ("torch.nn.parameter", "Parameter"): _TensorClass(True),
        ("torch.storage", "UntypedStorage"): StorageType(BY_NAME["uint8"], untyped=True),
        ("torch", "UntypedStorage"): StorageType(BY_NAME["uint8"], untyped=True),
        ("torch", "Size"): _size,
        ("torch", "device"): _device,
        ("torch.serialization", "_get_layout"): _layout,
        ("collections", "OrderedDict"): _ordered_dict,
        ("builtins", "set"): _set,
        ("builtins", "frozenset"): _frozenset,
        ("builtins", "slice"): lambda *a: slice(*_plain(*a)),
        ("builtins", "complex"): lambda *a: complex(*_plain(*a)),
        ("builtins", "bytearray"): _bytearray,
        ("_codecs", "encode"): _latin1_encode,
    }
    for cls, dtype in BY_STORAGE_CLASS.items():
        table[("torch", cls)] = StorageType(dtype)
    for name, dtype in BY_NAME.items():
        table[("torch", name)] = dtype
    for alias, name in (("float", "float32"), ("half", "float16"), ("double", "float64"), ("long", "int64")):
        table[("torch", alias)] = BY_NAME[name]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(module, "_reconstruct")] = _numpy_global("_reconstruct")
        table[(module, "scalar")] = _numpy_global("scalar")
    table[("numpy", "ndarray")] = _numpy_global("ndarray")
    table[("numpy", "dtype")] = _numpy_global("dtype")
    return table


def immune(table: dict[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """The table as handed to pickles: functions wrapped in Allowed; everything else must be immutable already."""
    out = {}
    for (module, name), value in table.items():
        if isinstance(value, (Frozen, DType)) or (isinstance(value, type) and isinstance(value, Sealed)):
            out[(module, name)] = value
        elif callable(value) and not isinstance(value, type):
            out[(module, name)] = Allowed(value, f"{module}.{name}")
        else:  # a mutable class or object would let a pickle change it for every later file
            raise TypeError(f"allow list entry {module}.{name} is neither immutable nor a function")
    return out


_BASE = immune(_base_globals())
_EXTRA: dict[int, tuple[dict[tuple[str, str], Any], dict[tuple[str, str], Any]]] = {}  # id(extra) -> (extra, table)

_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


def _table(extra: dict[tuple[str, str], Any] | None) -> dict[tuple[str, str], Any]:
    if not extra:
        return _BASE
    cached = _EXTRA.get(id(extra))
    if cached is None or cached[0] is not extra:
        cached = _EXTRA[id(extra)] = (extra, {**_BASE, **immune(extra)})
    return cached[1]


class SafeUnpickler(pickle.Unpickler):
    """Resolves globals through the allow list; `extra` adds format-specific stand-ins."""

    def __init__(
        self,
        file: Any,
        where: str,
        extra: dict[tuple[str, str], Any] | None = None,
        trust: bool = False,
        own: dict[tuple[str, str], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self.where = where
        self.trust = trust
        self.table = _table(extra)
        self.own = own or {}  # names only ckpt's rewrite of this pickle holds (safe_loads' `filler`)

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_MODULES.get(module, module)  # protocol-2 pickles name Python 2 modules
        value = self.own.get((module, name)) or self.table.get((module, name))
        if value is not None:
            return value
        if self.trust:
            return super().find_class(module, name)
        raise UnsafePickleError(self.where, printable(f"{module}.{name}"))

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], StorageType):
            _, storage_type, key, _location, numel = pid
            if not isinstance(key, str) or not key.isascii() or not key.isalnum() or len(key) > 64:
                raise PickleRefused("a storage key that is not a plain name")
            if type(numel) is not int or numel < 0:
                raise PickleRefused("a storage with a negative or non-integer size")
            return StorageRef(key, storage_type.dtype, numel)
        raise PickleRefused(f"unsupported persistent id (a {type(pid).__name__})")


def check_unbuilt(data: bytes, where: str, extra: dict[tuple[str, str], Any] | None = None, trust: bool = False) -> bool:
    """safe_loads' refusals that need nothing built (the scan's bounds, a global off the allow list), checked without
    unpickling; False where only unpickling would tell the globals (the caller then loads the pickle)."""
    names = pickle_guard.named_globals(data)
    if names is not None:
        try:
            pickle_guard.scan(data)
        except PickleRefused as exc:
            raise DataError(f"{where}: unreadable pickle ({pickle_guard.reason(exc)})") from exc
        off_list = [f"{m}.{n}" for module, n in names if ((m := _PY2_MODULES.get(module, module)), n) not in _table(extra)]
        if off_list and not trust:
            raise UnsafePickleError(where, printable(off_list[0]))
    return names is not None


def _own_fillers(fillers: Mapping[str, Callable[[], Any]] | None) -> tuple[dict[tuple[str, str], Any], dict[bytes, bytes]]:
    """The globals a rewritten pickle names to make the fillers (new random names each load: no pickle can hold
    them beforehand) and the rewrite's key text -> opcodes (GLOBAL module/name, an empty tuple, REDUCE)."""
    own, replacements = {}, {}
    for key, factory in (fillers or {}).items():
        module, name = "ckpt_cli.own", f"filler_{secrets.token_hex(16)}"
        own[module, name] = Allowed(factory, f"{module}.{name}")
        replacements[key.encode()] = f"c{module}\n{name}\n".encode() + b")R"
    return own, replacements


_TENSOR_PICKLES: dict[tuple[bytes, int], TensorRef] = {}  # data.pkl of a DCP chunk -> its tensor (immutable: shared)
_TENSOR_PICKLE_BYTES, _TENSOR_PICKLE_ENTRIES = 4096, 4096


def safe_loads(
    data: bytes | pickle_stream.OwnCopy,
    where: str,
    extra: dict[tuple[str, str], Any] | None = None,
    trust: bool = False,
    fillers: Mapping[str, Callable[[], Any]] | None = None,
) -> Any:
    """Unpickle `data` with the allow list, within the bounds of core/pickles/pickle_guard.py; every failure becomes a
    one-line DataError naming `where`. A small pickle of one plain tensor (a DCP chunk's data.pkl: thousands per
    file, a few distinct) is unpickled once and its TensorRef shared. `fillers` (key text -> factory): where the C
    rewrite is built, a dict pickled right after a key's text is `factory()`, given the dict's items one by one
    through its __setitem__ (so that they need never be held together); elsewhere it is a dict as usual. An OwnCopy
    is closed once loaded (or refused)."""
    small = isinstance(data, bytes) and not trust and len(data) <= _TENSOR_PICKLE_BYTES
    key = (data, id(_table(extra))) if isinstance(data, bytes) and small else None
    if key is not None and key in _TENSOR_PICKLES:
        return _TENSOR_PICKLES[key]
    own_copy = data if isinstance(data, pickle_stream.OwnCopy) else None
    try:
        own, replacements = _own_fillers(fillers)
        if isinstance(data, pickle_stream.OwnCopy):  # a large file's bytes, held once
            shared, size = data.scan(), len(data)
            stream = data.lean_stream(replacements)
        else:
            shared, size = pickle_guard.scan(data), len(data)
            leaner = pickle_guard.lean(data, 0, replacements) if fillers else pickle_guard.lean(data)
            if key is None:  # a caller that keeps no reference frees a large pickle's bytes now
                del data
            stream = pickle_stream.reader(leaner)
            del leaner  # a large one now lives only in the stream's pieces
        with pickle_guard.budget(size), heap.collector_paused(size >= pickle_guard.LEAN_FROM):
            value = SafeUnpickler(stream, where, extra, trust, own).load()
        if shared or trust:
            pickle_guard.bound_tree(value)
        if key is not None and type(value) is TensorRef and not value.attrs:
            if len(_TENSOR_PICKLES) >= _TENSOR_PICKLE_ENTRIES:
                _TENSOR_PICKLES.pop(next(iter(_TENSOR_PICKLES)))
            _TENSOR_PICKLES[key] = value
        return value
    except DataError:  # a refused global, or a filler's own words about an item
        raise
    except Exception as exc:  # a corrupt pickle raises anything from EOFError to UnicodeDecodeError
        raise DataError(f"{where}: unreadable pickle ({pickle_guard.reason(exc)})") from exc
    finally:
        if own_copy is not None:
            own_copy.close()
