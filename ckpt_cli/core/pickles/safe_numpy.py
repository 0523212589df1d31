"""numpy values in pickles (RNG states, scalars), rebuilt without letting a pickle shape numpy's objects.

numpy pickles arrays as `_reconstruct(ndarray, (0,), b'b')` + BUILD(version, shape, dtype, fortran, bytes),
dtypes as `dtype('f8', False, True)` + BUILD(state) and scalars as `scalar(dtype, bytes)`. Left to numpy,
a BUILD can give a dtype fields that nest other dtypes (hashing one then takes exponential time), or flags
that make numpy read numbers as object pointers, and `ndarray(shape)` allocates any size. Here a dtype is
a fresh `NumpyDType` whose BUILD may only set a byte order, arrays are built from exactly the bytes the
pickle holds, and object scalars are refused. numpy is imported when a pickle first names it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from ckpt_cli.core.pickles import pickle_guard
from ckpt_cli.core.pickles.pickle_guard import PickleRefused, charge


class NumpyDType:
    """`numpy.dtype(...)` as a pickle builds it; `dtype` is the real (simple, fresh) numpy dtype."""

    __slots__ = ("dtype",)
    dtype: Any  # set once, by __init__ (or __setstate__'s byte order), through object.__setattr__

    def __init__(self, dtype: Any) -> None:
        object.__setattr__(self, "dtype", dtype)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("read-only")

    def __setstate__(self, state: Any) -> None:
        # numpy's state: (version, byteorder, subarray, names, fields, elsize, alignment, flags[, metadata]);
        # all but the byte order must be what numpy itself gives this dtype.
        own = self.dtype.__reduce__()[2]
        if not isinstance(state, tuple) or len(state) != len(own) or state[1] not in ("<", ">", "|", "="):
            raise PickleRefused("a numpy dtype state of an unknown form")
        if any(a != b for i, (a, b) in enumerate(zip(state, own)) if i != 1 and not (i == 0 and a in (3, 4))):
            raise PickleRefused("a numpy dtype with fields, sub-arrays or flags of its own")
        if state[1] in "<>":
            object.__setattr__(self, "dtype", self.dtype.newbyteorder(state[1]))

    def __reduce__(self) -> Any:
        return self.dtype.__reduce__()

    def __repr__(self) -> str:
        return repr(self.dtype)


@functools.cache
def _numpy() -> Any:
    import numpy

    return numpy


@functools.cache
def array_class() -> type:
    """An ndarray whose BUILD takes only a NumpyDType and exactly the bytes (or objects) its shape needs."""
    base: Any = _numpy().ndarray

    class ndarray(base):  # noqa: N801 - shown as numpy shows its arrays
        def __setstate__(self, state: Any) -> None:
            if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], NumpyDType)):
                raise PickleRefused("a numpy array state of an unknown form")
            version, shape, dtype, fortran, raw = state
            if not isinstance(shape, tuple) or len(shape) > 32 or not all(type(n) is int and n >= 0 for n in shape):
                raise PickleRefused("a numpy array with a bad shape")
            numel, real = math.prod(shape), dtype.dtype
            if real.hasobject:
                ok = isinstance(raw, list) and len(raw) == numel
            else:
                ok = isinstance(raw, (bytes, bytearray)) and real.itemsize > 0 and len(raw) == numel * real.itemsize
            if not ok:
                raise PickleRefused("a numpy array whose data does not match its shape")
            charge(len(raw))
            super().__setstate__((version, shape, real, bool(fortran), raw))

        def __reduce__(self) -> Any:
            return self.view(base).__reduce__()

        def __repr__(self) -> str:
            return repr(self.view(base))

    pickle_guard.CHILDREN[ndarray] = lambda a: list(a.flat) if a.dtype.hasobject else []
    return ndarray


def _dtype(spec: Any, align: Any = False, copy: Any = True) -> NumpyDType:
    if not isinstance(spec, str) or len(spec) > 16:
        raise PickleRefused("a numpy dtype that is not a plain type code")
    try:
        dtype = _numpy().dtype(spec, bool(align), True)
    except (TypeError, ValueError):
        raise PickleRefused("an unknown numpy dtype") from None
    if dtype.fields is not None or dtype.subdtype is not None:
        raise PickleRefused("a numpy dtype with fields or sub-arrays")
    return NumpyDType(dtype)


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
    if getattr(subtype, "name", None) != "numpy.ndarray" or shape != (0,) or dtype not in (b"b", "b"):
        raise PickleRefused("numpy _reconstruct of something other than an empty array")
    return _numpy().ndarray.__new__(array_class(), (0,), "b")


def _scalar(dtype: Any, data: Any) -> Any:
    if not isinstance(dtype, NumpyDType) or dtype.dtype.hasobject or not isinstance(data, bytes) or len(data) != dtype.dtype.itemsize:
        raise PickleRefused("a numpy scalar other than a number of its dtype's size")
    numpy = _numpy()
    core = numpy._core if hasattr(numpy, "_core") else numpy.core
    return core.multiarray.scalar(dtype.dtype, data)


def _not_callable(*args: Any) -> Any:
    raise PickleRefused("numpy.ndarray called directly (it would allocate any size)")


_CALLS: dict[str, Callable[..., Any]] = {"dtype": _dtype, "_reconstruct": _reconstruct, "scalar": _scalar, "ndarray": _not_callable}


def call(name: str, *args: Any) -> Any:
    return _CALLS[name](*args)
