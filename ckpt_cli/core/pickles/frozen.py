"""Stand-ins a pickle cannot change: what the allow list (core/pickles/safe_pickle.py) hands out is shared by every
pickle ckpt reads, so its classes refuse to be set (`Sealed`) and its objects are frozen slots dataclasses whose
`__setstate__` refuses (`frozen`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, overload

from ckpt_cli.core.pickles.pickle_guard import PickleRefused

if TYPE_CHECKING:  # typing has it from Python 3.11 (3.12 for frozen_default); the checker alone needs it
    from typing_extensions import dataclass_transform
else:

    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda function: function


class Sealed(type):
    """Metaclass of the classes a pickle may name: their attributes cannot be set or deleted (a BUILD on the
    class itself would otherwise change the class for every later file)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise PickleRefused(f"a pickle may not change the class {cls.__name__} (read-only)")

    def __delattr__(cls, name: str) -> None:
        raise PickleRefused(f"a pickle may not change the class {cls.__name__} (read-only)")


class Frozen:
    """Base of the stand-ins a pickle may get hold of (see `frozen`); immutable, so copies are the object itself."""

    __slots__ = ()

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: Any) -> Any:
        return self


def _refuse_state(self: Any, state: Any) -> None:
    raise PickleRefused(f"a pickle may not change the allow list's {getattr(self, 'name', type(self).__name__)}")


_T = TypeVar("_T")


@overload
def frozen(cls: type[_T], /) -> type[_T]: ...
@overload
def frozen(*, eq: bool = ...) -> Callable[[type[_T]], type[_T]]: ...
@dataclass_transform(frozen_default=True)
def frozen(cls: type[_T] | None = None, /, **options: Any) -> type[_T] | Callable[[type[_T]], type[_T]]:
    """A frozen slots dataclass a pickle's BUILD cannot change: no `__dict__` to write, and the `__setstate__`
    that dataclasses adds to frozen slots classes (it bypasses `frozen`) replaced by one that refuses."""

    def make(cls: type[_T]) -> type[_T]:
        made = dataclass(cls, frozen=True, slots=True, **options)
        made.__setstate__ = _refuse_state  # type: ignore[attr-defined]  # replaces the method dataclasses added
        return made

    return make(cls) if cls is not None else make
