"""An allow-listed unpickler that never runs code from a checkpoint and never imports torch.

Every global a pickle names is looked up in an allow list and mapped to an inert stand-in:
tensors become `TensorRef`s (where their bytes are), dtypes become `DType`s, `torch.Size` a tuple.
Anything else is refused at the GLOBAL opcode, before any call could happen, unless the user
passes --trust-pickle. Formats add their own classes (DeepSpeed's loss scaler, DCP metadata).
"""

from __future__ import annotations

import codecs
import collections
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpt_cli.core.dtypes import BY_NAME, BY_STORAGE_CLASS, DType
from ckpt_cli.errors import DataError, UnsafePickleError


class TorchSize(tuple):  # type: ignore[type-arg]
    """A torch.Size read from a pickle: a tuple that is written back as torch.Size."""


@dataclass(frozen=True)
class StorageType:
    """Stand-in for torch.<X>Storage classes; UntypedStorage is uint8 with numel in bytes."""

    dtype: DType
    untyped: bool = False


@dataclass(frozen=True)
class StorageRef:
    """A persistent storage reference: record `data/<key>` holding `numel` elements of `dtype`."""

    key: str
    dtype: DType
    numel: int


@dataclass
class TensorRef:
    """A tensor as pickled: a view (offset, size, stride) of a storage. `attrs`: Python attributes."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: DType
    requires_grad: bool = False
    attrs: dict[str, Any] = field(default_factory=dict)
    is_parameter: bool = False


def _rebuild_tensor_v2(
    storage: StorageRef,
    storage_offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> TensorRef:
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride), storage.dtype, bool(requires_grad))


def _rebuild_tensor_v3(
    storage: StorageRef,
    storage_offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool,
    backward_hooks: Any,
    dtype: DType,
    metadata: Any = None,
) -> TensorRef:
    # The storage is untyped (numel counts bytes); the dtype comes last.
    typed = StorageRef(storage.key, dtype, storage.numel // dtype.itemsize)
    return TensorRef(typed, int(storage_offset), tuple(size), tuple(stride), dtype, bool(requires_grad))


def _rebuild_parameter(data: TensorRef, requires_grad: bool, backward_hooks: Any, state: Any = None) -> TensorRef:
    data.requires_grad = bool(requires_grad)
    data.is_parameter = True
    if isinstance(state, dict):
        data.attrs.update(state)
    return data


class _TensorClass:
    """Stand-in for torch.Tensor / torch.nn.Parameter as the `new_type` of _rebuild_from_type_v2."""

    def __init__(self, is_parameter: bool) -> None:
        self.is_parameter = is_parameter


def _rebuild_from_type_v2(func: Callable[..., Any], new_type: Any, args: tuple[Any, ...], state: Any) -> Any:
    if not isinstance(new_type, _TensorClass):
        raise pickle.UnpicklingError("_rebuild_from_type_v2 of a non-tensor type")
    ref = func(*args)
    if isinstance(ref, TensorRef):
        ref.is_parameter = ref.is_parameter or new_type.is_parameter
        if isinstance(state, dict):
            ref.attrs.update(state)
        elif isinstance(state, tuple) and state and isinstance(state[-1], dict):
            ref.attrs.update(state[-1])
    return ref


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Protocol-2 pickles store bytes as _codecs.encode(str, 'latin1'); allow nothing else.
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}")
    return codecs.encode(text, "latin1")


def _numpy_global(name: str) -> Callable[[], Any]:
    def load() -> Any:
        import numpy

        if name == "_reconstruct":
            return numpy._core.multiarray._reconstruct if hasattr(numpy, "_core") else numpy.core.multiarray._reconstruct
        if name == "scalar":
            return numpy._core.multiarray.scalar if hasattr(numpy, "_core") else numpy.core.multiarray.scalar
        return getattr(numpy, name)

    return load


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
        ("torch", "Size"): lambda *a: TorchSize(a[0]) if a else TorchSize(),
        ("torch", "device"): lambda *a: ":".join(str(x) for x in a),
        ("torch.serialization", "_get_layout"): str,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): bytearray,
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


_BASE = _base_globals()
_LAZY = {key for key, value in _BASE.items() if getattr(value, "__name__", "") == "load"}


_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class SafeUnpickler(pickle.Unpickler):
    """Resolves globals through the allow list; `extra` adds format-specific stand-ins."""

    def __init__(self, file: Any, where: str, extra: dict[tuple[str, str], Any] | None = None, trust: bool = False) -> None:
        super().__init__(file)
        self.where = where
        self.trust = trust
        self.table = dict(_BASE)
        if extra:
            self.table.update(extra)

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_MODULES.get(module, module)  # protocol-2 pickles name Python 2 modules
        key = (module, name)
        if key in self.table:
            value = self.table[key]
            return value() if key in _LAZY else value
        if self.trust:
            return super().find_class(module, name)
        raise UnsafePickleError(self.where, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], StorageType):
            _, storage_type, key, _location, numel = pid
            return StorageRef(str(key), storage_type.dtype, int(numel))
        raise pickle.UnpicklingError(f"unsupported persistent id {pid!r:.80}")


def safe_loads(data: bytes, where: str, extra: dict[tuple[str, str], Any] | None = None, trust: bool = False) -> Any:
    """Unpickle `data` with the allow list; every failure becomes a one-line DataError naming `where`."""
    try:
        return SafeUnpickler(io.BytesIO(data), where, extra, trust).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # a corrupt pickle raises anything from EOFError to UnicodeDecodeError
        raise DataError(f"{where}: unreadable pickle ({type(exc).__name__}: {exc})") from exc
