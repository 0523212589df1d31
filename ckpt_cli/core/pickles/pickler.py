"""Writing pickles that name torch's classes without importing torch.

torch.save's `data.pkl` and DCP's `.metadata` are plain pickles of a few torch globals, written here from
inert descriptions (`Global`, `Reduce`, `Instance`), so a conversion that only moves bytes never pays for
`import torch` (about 1.5 s and 250 MB). The C pickler does the work (a wide DCP `.metadata` holds millions of
objects): the globals it cannot import are written first, each GLOBAL memoized (and left under the value, which
STOP takes from the top), and the pickler starts with that memo, so it refers to them with BINGET; a global
found on the way is added and the dump restarted (a pickle names a few). Instances are written as their
class's NEWOBJ + BUILD, as dataclasses pickle.
"""

from __future__ import annotations

import copyreg
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.pickles.safe_pickle import TorchSize


class Global:
    """`module.name`, written as a GLOBAL opcode. One object per name (the pickler's memo goes by identity)."""

    __slots__ = ("module", "name")
    _interned: ClassVar[dict[tuple[str, str], Global]] = {}
    module: str
    name: str

    def __new__(cls, module: str, name: str) -> Global:
        found = cls._interned.get((module, name))
        if found is None:
            found = object.__new__(cls)
            object.__setattr__(found, "module", module)
            object.__setattr__(found, "name", name)
            cls._interned[(module, name)] = found
        return found

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Global is immutable")

    def __repr__(self) -> str:
        return f"Global({self.module!r}, {self.name!r})"

    def __call__(self, *args: Any) -> Any:  # the pickler requires reduce functions to be callable
        raise TypeError(f"{self.module}.{self.name} is a pickle reference, not a function")

    def __reduce_ex__(self, protocol: Any) -> Any:  # never pickled as an object of ckpt's: only through the memo
        raise pickle.PicklingError(f"{self!r} reached the pickler outside its memo")


@dataclass(frozen=True, eq=False, slots=True)  # slots: a wide `.metadata` is described by millions of these
class Reduce:
    """`func(*args)`, written as REDUCE."""

    func: Global
    args: tuple[Any, ...]


@dataclass(frozen=True, eq=False, slots=True)
class Instance:
    """`cls.__new__(cls, *args)` then BUILD(state): how dataclasses pickle (state None: no BUILD), and with `args` and
    no state how NamedTuples do."""

    cls: Global
    state: Any = None
    args: tuple[Any, ...] = ()

    @property  # type: ignore[misc]  # object.__class__ is settable in typeshed; this one is read-only on purpose
    def __class__(self) -> type:  # what the C pickler's NEWOBJ checks the object against: the class it names
        return _placeholder(self.cls)


def _placeholder(glob: Global) -> type:
    """A class standing for `glob` (NEWOBJ takes a class); written as `glob` through the memo."""
    made = _PLACEHOLDERS.get(glob)
    if made is None:
        made = _PLACEHOLDERS[glob] = type(glob.name, (), {"__module__": "ckpt_cli.core.pickles.pickler.placeholder"})
    return made


_PLACEHOLDERS: dict[Global, type] = {}


def torch_dtype(dtype: DType) -> Global:
    return Global("torch", dtype.name)


_REGISTERED: dict[type, Callable[[Any], Any]] = {}


class _Unknown(Exception):  # noqa: N818 - a signal to dumps(), not an error
    """An object the pickler must write as a global that is not in its memo yet."""

    def __init__(self, obj: Any, glob: Global) -> None:
        self.obj, self.glob = obj, glob


class _Pickler(pickle.Pickler):
    """The C pickler, told how to write ckpt's descriptions; `known`: ids of the objects its memo starts with."""

    def __init__(self, file: Any, known: dict[int, Any], persistent: Callable[[Any], Any] | None) -> None:
        super().__init__(file, protocol=2)
        self.known = known
        if persistent is not None:
            self.persistent_id = persistent  # type: ignore[method-assign]  # only then: the pickler calls it for every object

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is Reduce:
            return obj.func, obj.args
        if kind is TorchSize:
            return Global("torch", "Size"), (tuple(obj),)
        if kind is Global:
            raise _Unknown(obj, obj)
        if kind is DType:
            raise _Unknown(obj, torch_dtype(obj))
        if kind is Instance:
            return self._newobj(_placeholder(obj.cls), obj.cls, obj.state, obj.args)
        describe = _REGISTERED.get(kind)
        if describe is None:
            return NotImplemented
        described = describe(obj)
        if type(described) is Instance:  # NEWOBJ of the stand-in's own class, which the memo writes as the global it names
            return self._newobj(kind, described.cls, described.state)
        return self.reducer_override(described)

    def _newobj(self, cls: type, glob: Global, state: Any, args: tuple[Any, ...] = ()) -> Any:
        if id(cls) not in self.known:
            raise _Unknown(cls, glob)
        return copyreg.__newobj__, (cls, *args), state  # type: ignore[attr-defined]  # typeshed's copyreg omits __newobj__


def register(cls: type, describe: Callable[[Any], Any]) -> None:
    """Pickle instances of `cls` (a reader's stand-in for a foreign class) as `describe(obj)` says."""
    _REGISTERED[cls] = describe


def _put(i: int) -> bytes:
    return pickle.BINPUT + bytes([i]) if i < 256 else pickle.LONG_BINPUT + i.to_bytes(4, "little")


def _preamble(globals_: list[Global], strings: list[str]) -> bytes:
    """PROTO 2, then each global (GLOBAL) and each shared string (BINUNICODE), memoized at its position. They stay
    on the stack under the value, where STOP leaves them (torch's weights_only unpickler has no POP)."""
    out = [pickle.PROTO + b"\x02"]
    for i, glob in enumerate(globals_):
        out.append(pickle.GLOBAL + f"{glob.module}\n{glob.name}\n".encode() + _put(i))
    for i, text in enumerate(strings, len(globals_)):
        data = text.encode("utf-8", "surrogatepass")
        out.append(pickle.BINUNICODE + len(data).to_bytes(4, "little") + data + _put(i))
    return b"".join(out)


class _Handed:
    """The pickler's file: keeps what it is handed. At protocol 2 the C pickler builds the whole pickle in one buffer
    and hands that buffer over at the end of the dump, so it is kept as it is, not copied into a file's own buffer
    (a `.metadata` of 500,000 chunks is 95 MB: held twice, then cut and copied once more)."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(data)
        return len(data)


BATCH = 1000  # the C pickler's BATCHSIZE: a dict's items go out in MARK ... SETITEMS runs of this many


@dataclass(frozen=True)
class SplicedDict:
    """A dict too large to hold whole (a `.metadata`'s storage_data: two records for each of 500,000 chunks), written
    where the text `marker` stands in the value, from its items in order, BATCH at a time: the bytes the C pickler
    writes for the whole dict, made with one BATCH-item dict held at a time."""

    marker: str
    count: int
    batches: Callable[[], Iterable[list[tuple[Any, Any]]]]


def _batch_body(batch: bytes, size: int, last: bool, total: int) -> bytes | memoryview:
    """The items of a BATCH-item dict's pickle (PROTO, EMPTY_DICT, its framing, STOP) framed as the C pickler frames
    them inside a dict of `total` items: MARK items SETITEMS per batch, a trailing empty batch when the items
    fill the last one, SETITEM for a dict of one item."""
    body = memoryview(batch)[3:-1]
    if size == BATCH:  # alone, a full batch is followed by an empty one: kept only where the whole dict ends so
        return body if last and total % BATCH == 0 else body[:-2]
    if size == 1 and total > 1:  # alone, one item is written with SETITEM
        return pickle.MARK + bytes(body[:-1]) + pickle.SETITEMS
    return body


def _splice(out: bytes, pickler: pickle.Pickler, handed: _Handed, spliced: Sequence[SplicedDict]) -> Iterator[bytes | memoryview]:
    """The pickle `out` (PROTO dropped) with each dict's bytes where its marker's are, made as they are asked for."""
    found = []
    for dict_ in spliced:
        text = dict_.marker.encode()
        marker = pickle.BINUNICODE + len(text).to_bytes(4, "little") + text
        at = out.find(marker)
        if at < 0 or out.find(marker, at + 1) >= 0:
            raise pickle.PicklingError("a spliced dict's marker is not in the pickle exactly once")
        found.append((at, len(marker), dict_))
    pos = 2
    for at, length, dict_ in sorted(found, key=lambda f: f[0]):
        yield memoryview(out)[pos:at]
        yield pickle.EMPTY_DICT
        done = 0
        for batch in dict_.batches():
            handed.parts.clear()
            try:
                pickler.dump(dict(batch))
            except _Unknown as missing:  # the bytes before are written already: every global must be announced
                raise pickle.PicklingError(f"{missing.glob} met in a spliced dict without being expected") from None
            done += len(batch)
            yield _batch_body(b"".join(handed.parts), len(batch), done == dict_.count, dict_.count)
        if done != dict_.count:
            raise pickle.PicklingError(f"the spliced dict has {done} items, not {dict_.count}")
        pos = at + length
    yield memoryview(out)[pos:]


def dumps(obj: Any, *args: Any, **options: Any) -> bytes:
    """`dump_parts` (same arguments) joined into one bytes object."""
    return b"".join(dump_parts(obj, *args, **options))


def dump_parts(
    obj: Any,
    persistent_id: Callable[[Any], Any] | None = None,
    expected: Iterable[Global | DType] = (),
    shared: bool = True,
    strings: Iterable[str] = (),
    stand_ins: Iterable[tuple[type, Global]] = (),
    spliced: Sequence[SplicedDict] = (),
) -> Iterator[bytes | memoryview]:
    """Protocol-2 pickle of `obj`, where Global/Reduce/Instance/DType stand for torch objects, as consecutive parts
    (the preamble, then the pickler's own output less its PROTO, not copied). `expected`: globals
    the caller knows `obj` names, written first so that no dump restarts for them (a restart pickles again all that
    came before: `.metadata` meets MetadataIndex only after every tensor's chunks). `shared=False`: a value that
    needs no object written twice to be the same object when loaded (no cycles either), pickled without memoizing
    each object (the pickler's "fast" mode: it would otherwise keep every object it wrote, and each tuple it made
    for one, alive until the end; the globals still come from the memo). `strings`: text objects `obj` holds many
    times (a `.metadata`'s keys and file names, once per chunk), written once and then fetched from the memo, even
    with shared=False. `stand_ins`: registered classes `obj` holds and the global each is written as (known up front
    too). `spliced`: dicts written in place of their markers (with shared=False), each made a batch at a time as the
    parts are asked for, so that a caller writing them out holds one batch's bytes, not the pickle's."""
    texts = list({id(t): t for t in strings}.values())  # by identity: the memo finds the very objects `obj` holds
    known: dict[int, tuple[Any, Global]] = {}  # id(object) -> (object, the global it is written as)
    for item in expected:
        glob = torch_dtype(item) if isinstance(item, DType) else item
        known[id(item)] = (item, glob)
        if isinstance(item, Global):  # as a REDUCE function and as an Instance's class
            known[id(_placeholder(item))] = (_placeholder(item), item)
    for cls, glob in stand_ins:
        known[id(cls)] = (cls, glob)
    while True:
        order = list(dict.fromkeys(glob for _, glob in known.values()))
        index = {glob: i for i, glob in enumerate(order)}
        handed = _Handed()
        pickler = _Pickler(handed, known, persistent_id)
        pickler.fast = not shared
        memo = {key: (index[glob], o) for key, (o, glob) in known.items()}
        memo.update({id(t): (len(order) + i, t) for i, t in enumerate(texts)})
        pickler.memo = memo
        try:
            pickler.dump(obj)
            out = handed.parts[0] if len(handed.parts) == 1 else b"".join(handed.parts)
        except _Unknown as missing:
            known[id(missing.obj)] = (missing.obj, missing.glob)
            continue
        yield _preamble(order, texts)
        if spliced:  # the same pickler: its memo refers to the same globals and strings
            yield from _splice(out, pickler, handed, spliced)
        else:
            yield memoryview(out)[2:]  # its PROTO 2 dropped: the preamble has it
        return
