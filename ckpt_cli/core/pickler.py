"""Writing pickles that name torch's classes without importing torch.

torch.save's `data.pkl` and DCP's `.metadata` are plain pickles of a few torch globals. The pure
Python pickler below writes them from inert descriptions (`Global`, `Reduce`, `Instance`), so a
conversion that only moves bytes never pays for `import torch` (about 1.5 s and 250 MB).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.safe_pickle import TorchSize


@dataclass(frozen=True, eq=False)
class Global:
    """`module.name`, written as a GLOBAL opcode."""

    module: str
    name: str

    def __call__(self, *args: Any) -> Any:  # the pickler requires reduce functions to be callable
        raise TypeError(f"{self.module}.{self.name} is a pickle reference, not a function")


@dataclass(frozen=True, eq=False)
class Reduce:
    """`func(*args)`, written as REDUCE."""

    func: Global
    args: tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class Instance:
    """`cls.__new__(cls)` then BUILD(state): how dataclasses pickle (state None: no BUILD)."""

    cls: Global
    state: Any = None


def torch_dtype(dtype: DType) -> Global:
    return Global("torch", dtype.name)


def size(dims: tuple[int, ...]) -> Reduce:
    """torch.Size(dims), as torch pickles it."""
    return Reduce(Global("torch", "Size"), (tuple(dims),))


class _Pickler(pickle._Pickler):  # type: ignore[name-defined]
    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: io.BytesIO, persistent: Callable[[Any], Any] | None) -> None:
        super().__init__(file, protocol=2)
        self._persistent = persistent

    def persistent_id(self, obj: Any) -> Any:
        return self._persistent(obj) if self._persistent else None

    def _save_global(self, obj: Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def _save_reduce(self, obj: Reduce) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    def _save_instance(self, obj: Instance) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _save_dtype(self, obj: DType) -> None:
        self._save_global(torch_dtype(obj))

    def _save_size(self, obj: tuple[int, ...]) -> None:
        self._save_reduce(size(tuple(obj)))

    dispatch[Global] = _save_global
    dispatch[Reduce] = _save_reduce
    dispatch[Instance] = _save_instance
    dispatch[DType] = _save_dtype
    dispatch[TorchSize] = _save_size


def register(cls: type, describe: Callable[[Any], Any]) -> None:
    """Pickle instances of `cls` (a reader's stand-in for a foreign class) as `describe(obj)` says."""
    _Pickler.dispatch[cls] = lambda self, obj: self.save(describe(obj))


def dumps(obj: Any, persistent_id: Callable[[Any], Any] | None = None) -> bytes:
    """Protocol-2 pickle of `obj`, where Global/Reduce/Instance/DType stand for torch objects."""
    buf = io.BytesIO()
    _Pickler(buf, persistent_id).dump(obj)
    return buf.getvalue()
