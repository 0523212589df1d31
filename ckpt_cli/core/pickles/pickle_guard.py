"""Bounds on the work a pickle can make ckpt do: checked before, during and after the C unpickler runs.

The allow list (core/pickles/safe_pickle.py) decides *what* a pickle may build; this module bounds *how much*.
A few hundred bytes of pickle can otherwise hang or exhaust a reader without running any code:

- before: `scan` walks the opcodes once. Dict keys and set items are hashed inside the C unpickler, and
  a tuple that holds a shared tuple twice, nested 40 deep, takes 2**40 steps to hash; the scan knows
  every tuple's expanded size (tuples are immutable) and refuses keys whose hashing would run away.
  It also refuses memo indices far past the data (the C unpickler would allocate a memo that large).
- during: `charge` is called by the allow-listed callables for every copy they make (bytes, state dicts,
  set items), against a budget proportional to the pickle's size (one object copied a million times).
- after: `bound_tree` counts the value's tree as every later traversal will see it (shared references
  counted each time) and refuses cycles, nesting past MAX_DEPTH and expansions far beyond its size.
"""

from __future__ import annotations

import contextlib
import pickle
import pickletools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import ModuleType
from typing import Any

_pickle_scan: ModuleType | None
_pickle_memo: ModuleType | None
try:  # built by `pip install` where a C compiler is at hand (pyproject.toml: an optional extension)
    from ckpt_cli.core.pickles import _pickle_scan
except ImportError:
    _pickle_scan = None
try:  # likewise optional (core/pickles/_pickle_memo.c)
    from ckpt_cli.core.pickles import _pickle_memo
except ImportError:
    _pickle_memo = None

MAX_DEPTH = 100  # nesting of containers; every later traversal (flatten, repr, the pickler) recurses
HASH_BASE = 10_000  # tuple nodes the C unpickler may hash for keys, beyond 4 per byte of pickle
COPY_BASE = 1 << 16  # items or bytes the allow-listed callables may copy, beyond 4 per byte of pickle
TREE_BASE = 1_000  # tree nodes beyond EXPANSION per stored reference
EXPANSION = 16  # times a tree may reach each stored reference (real pickles: about once)
_SIZE_CAP = 1 << 62


class PickleRefused(pickle.UnpicklingError):
    """A pickle ckpt will not build; the message is ckpt's own words (never bytes of the file)."""


def printable(text: str, limit: int = 100) -> str:
    """`text` reduced to printable ASCII and `limit` characters, fit to quote from a foreign file."""
    clean = "".join(c if " " <= c <= "~" else "?" for c in text[: limit + 1])
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


# ---- during: a budget for what the allow-listed callables copy ----------------------------------------


def reason(exc: Exception) -> str:
    """What went wrong, in words that quote nothing from the file beyond a few printable characters."""
    if isinstance(exc, PickleRefused):
        return str(exc)
    if isinstance(exc, (pickle.UnpicklingError, EOFError)):  # the C unpickler's own messages
        return printable(f"{type(exc).__name__}: {exc}", 80)
    return type(exc).__name__


class _Budget:
    def __init__(self, steps: int) -> None:
        self.left = steps


_BUDGET: ContextVar[_Budget | None] = ContextVar("ckpt_pickle_budget", default=None)


@contextlib.contextmanager
def budget(data_size: int) -> Iterator[None]:
    """The copy budget of one load: COPY_BASE plus 4 per byte of pickle."""
    token = _BUDGET.set(_Budget(COPY_BASE + 4 * data_size))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def charge(steps: int) -> None:
    """Spend `steps` of the current load's budget (no-op outside a load); refuse the pickle when spent."""
    current = _BUDGET.get()
    if current is None:
        return
    current.left -= steps
    if current.left < 0:
        raise PickleRefused("the pickle rebuilds far more data than it holds (shared references copied over and over)")


def hash_cost(value: Any, limit: int) -> int:
    """Steps to hash `value`: nodes of nested tuples (other hashable stand-ins hash in one step), at most limit + 1."""
    if type(value) is not tuple and not isinstance(value, tuple):
        return 1
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        total += 1
        if isinstance(item, tuple):
            stack.extend(item)
    return total


# ---- before: the opcode scan -------------------------------------------------------------------------
# The scan keeps the unpickler's two stacks: values and marks. A value is one int, depth << 96 | size: the
# depth of nested containers in it and its expanded size (nodes reached through it, shared ones each time).
# sum() and max() over a slice of the stack do a container's arithmetic in C. A memoized container is
# memoized as it is created and filled afterwards, so the memo follows the value at its stack position while
# it is filled; a GET then copies its final size and the sizes stay exact. Only a container changed after
# it was fetched from the memo (a cycle, or a reference counted before it grew) makes them inexact: the scan
# then says so, and the caller counts the built value instead (bound_tree). Tuples never change, so the
# cost of hashing them is exact either way.

_SHIFT = 62
_SIZE = (1 << _SHIFT) - 1
_CAP = 1 << 30  # sizes stop counting here (far past every limit); a sum of 2**32 of them still fits below _SHIFT
_ATOM = 1
_DEPTH1 = 1 << _SHIFT
_EMPTY_C = _DEPTH1 | _ATOM
# Opcode kinds, in the order the scan tests them (the frequent ones first).
(K_GET1, K_MEMOIZE, K_ATOM, K_TUPLE, K_MARK, K_ATOM_LEN, K_EMPTY, K_GET4, K_PUT1, K_PUT4, K_CALL, K_BUILD, K_FILL_MARK,
 K_FILL, K_TO_MARK, K_ATOM_LINES, K_POP, K_POP_MARK, K_DUP, K_REPLACE, K_SKIP, K_STOP, K_BIGINT, K_PUT_LINE, K_GET_LINE,
 K_INST) = range(26)  # fmt: skip
_KINDS = {
    "h": (K_GET1, 1), "j": (K_GET4, 4), "g": (K_GET_LINE, 1), "q": (K_PUT1, 1), "r": (K_PUT4, 4), "p": (K_PUT_LINE, 1),
    "\x94": (K_MEMOIZE, 0), "(": (K_MARK, 0), "]": (K_EMPTY, 0), "}": (K_EMPTY, 0), "\x8f": (K_EMPTY, 0),
    ")": (K_EMPTY, 0), "\x85": (K_TUPLE, 1), "\x86": (K_TUPLE, 2), "\x87": (K_TUPLE, 3),
    "R": (K_CALL, 2), "\x81": (K_CALL, 2), "\x92": (K_CALL, 3), "\x93": (K_CALL, 2), "b": (K_BUILD, 0),
    "u": (K_FILL_MARK, 2), "\x90": (K_FILL_MARK, 1), "e": (K_FILL_MARK, 0), "s": (K_FILL, 2), "a": (K_FILL, 1),
    "t": (K_TO_MARK, 0), "l": (K_TO_MARK, 0), "d": (K_TO_MARK, 2), "\x91": (K_TO_MARK, 1), "o": (K_TO_MARK, 0),
    "i": (K_INST, 2), "0": (K_POP, 0), "1": (K_POP_MARK, 0), "2": (K_DUP, 0), "Q": (K_REPLACE, 0), "\x98": (K_REPLACE, 0),
    "\x80": (K_SKIP, 1), "\x95": (K_SKIP, 8), ".": (K_STOP, 0), "\x8a": (K_BIGINT, 1), "\x8b": (K_BIGINT, 4),
}  # fmt: skip
_LEN_WIDTH = {-2: 1, -3: 4, -4: 4, -5: 8}  # pickletools' n -> width of the length prefix


def _opcode_table() -> list[tuple[int, int] | None]:
    """byte -> (kind, n): n is the argument size (fixed), the length-prefix width (K_ATOM_LEN, K_BIGINT), the
    newline-ended lines (K_ATOM_LINES), the values taken (K_TUPLE, K_CALL), or the step between hashed items."""
    table: list[tuple[int, int] | None] = [None] * 256
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg else 0
        if op.code in _KINDS:
            table[ord(op.code)] = _KINDS[op.code]
        elif n >= 0:  # pushes one atom after a fixed-size argument (or none): ints, floats, NONE, EXTn
            table[ord(op.code)] = (K_ATOM, n)
        elif n == -1:  # text arguments: INT, LONG, STRING, UNICODE, FLOAT, PERSID; GLOBAL has two lines
            table[ord(op.code)] = (K_ATOM_LINES, 2 if op.name == "GLOBAL" else 1)
        else:
            table[ord(op.code)] = (K_ATOM_LEN, _LEN_WIDTH[n])
    return table


_OPS = _opcode_table()
# The same table for the C walk: kind and argument size of each byte (255: not an opcode).
_KIND_BYTES = bytes(255 if op is None else op[0] for op in _OPS)
_N_BYTES = bytes(0 if op is None else op[1] for op in _OPS)
# The C walk's refusals (core/pickles/_pickle_scan.c R_*): the Python walk's words.
SCAN_REFUSALS = {
    -1: "malformed opcodes",
    -2: f"the pickle nests containers more than {MAX_DEPTH} deep",
    -3: "memo of nothing",
    -4: "stack underflow",
    -5: "negative length",
    -6: "memo index out of range",
    -7: "dict keys or set items that take too long to hash (nested shared tuples)",
    -8: "too many nested references (a shared value expands far beyond the pickle)",
    -9: "truncated",
    -10: "no STOP opcode",
}


def _container(items: list[int]) -> int:
    """A new container (or object) holding `items`."""
    if not items:
        return _EMPTY_C
    depth = (max(items) >> _SHIFT) + 1
    if depth > MAX_DEPTH:
        raise PickleRefused(f"the pickle nests containers more than {MAX_DEPTH} deep")
    return depth << _SHIFT | min(1 + (sum(items) & _SIZE), _CAP)


def _key_cost(keys: list[int]) -> int:
    """Tuple nodes hashed beyond one per key (atoms and most objects hash in one step)."""
    return (sum(keys) & _SIZE) - len(keys)


def scan(data: bytes) -> bool:
    """Refuse a pickle whose opcodes alone would hang or exhaust the C unpickler, or whose value expands far
    beyond its size (PickleRefused); return whether the sizes were inexact (then bound the built value)."""
    if len(data) <= _CACHED_SIZE:
        cached = _SCANNED.get(data)
        if cached is None:
            cached = _SCANNED[data] = _walk(data)
            if len(_SCANNED) > _CACHE_ENTRIES:
                _SCANNED.pop(next(iter(_SCANNED)))
        return cached
    return _walk(data)


def _walk(data: bytes) -> bool:
    """The scan in C (core/pickles/_pickle_scan.c: the same walk, a few ns an opcode) where it was built, else in Python."""
    if _pickle_scan is None:
        return _Scan(data).run()
    verdict = _pickle_scan.scan(data, _KIND_BYTES, _N_BYTES, MAX_DEPTH, HASH_BASE, TREE_BASE, EXPANSION)
    if verdict < 0:
        raise PickleRefused(SCAN_REFUSALS[verdict])
    return bool(verdict)


def named_globals(data: bytes) -> list[tuple[str, str]] | None:
    """The (module, name) of each global the pickle names by text (GLOBAL, INST), in the unpickler's order, read
    without building its value (core/pickles/_pickle_scan.c); None where only unpickling would tell (STACK_GLOBAL, the
    copyreg registry), where the opcodes do not walk or a name is not UTF-8, or where the C walk is not built."""
    found = _pickle_scan.named_globals(data, _KIND_BYTES, _N_BYTES) if _pickle_scan is not None else None
    try:
        return None if found is None else [(module.decode(), name.decode()) for module, name in found]
    except UnicodeDecodeError:
        return None


LEAN_FROM = 1 << 20  # pickles this large are loaded without their unread memo stores


def lean(data: bytes, at_least: int = LEAN_FROM, replacements: dict[bytes, bytes] | None = None) -> bytes:
    """`data` without the memo stores no GET reads back (core/pickles/_pickle_memo.c): the same value, but the C
    unpickler no longer keeps every state dict and tuple of a large pickle alive until the load ends (a DCP
    `.metadata` of 200,000 chunks: 405 -> 128 MB). Only for a pickle `scan` accepted; `data` itself where the
    extension is not built or the pickle is one it leaves alone. `replacements` (key text -> opcodes): an empty
    dict pickled right after a key's text is made by its opcodes instead (safe_pickle.safe_loads' `fillers`)."""
    if _pickle_memo is None or len(data) < at_least:
        return data
    leaner = _pickle_memo.lean(data, _KIND_BYTES, _N_BYTES, *([replacements] if replacements else []))
    return data if leaner is None else leaner


def in_place() -> bool:
    """Whether a large pickle can be scanned and rewritten in its own buffer (both C extensions built)."""
    return _pickle_memo is not None and _pickle_scan is not None


def lean_in_place(buffer: Any, headroom: int, replacements: dict[bytes, bytes] | None = None) -> int | None:
    """`lean` within `buffer` (its pickle after `headroom` free bytes, rewritten to its start): the new length, or
    None where the buffer is left as it was (core/pickles/_pickle_memo.c). Only for a pickle `scan` accepted."""
    if _pickle_memo is None:
        return None
    return _pickle_memo.lean_in_place(buffer, _KIND_BYTES, _N_BYTES, headroom, *([replacements] if replacements else []))


_CACHED_SIZE = 4096  # DCP writes one small, often identical, pickle per tensor chunk
_CACHE_ENTRIES = 4096
_SCANNED: dict[bytes, bool] = {}


class _Scan:
    """One pass over a pickle's opcodes (see the comment above `_SHIFT`)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: dict[int, int] = {}
        self.memo_at: dict[int, int] = {}  # stack position -> memo index of the container there
        self.fetched: set[int] = set()  # memo indices of containers a GET copied
        self.inexact = False
        self.hash_left = HASH_BASE + 4 * len(data)

    def run(self) -> bool:
        try:
            return self._run()
        except (IndexError, KeyError, ValueError, TypeError):
            raise PickleRefused("malformed opcodes") from None

    def _run(self) -> bool:  # noqa: C901 - one loop, the opcodes in order of frequency
        data, stack, marks, memo, memo_at = self.data, self.stack, self.marks, self.memo, self.memo_at
        table, push = _OPS, stack.append
        pos, end, ops = 0, len(data), 0
        while pos < end:
            kind, n = table[data[pos]]  # type: ignore[misc]  # None (not an opcode) fails to unpack: TypeError, refused below
            pos += 1
            ops += 1
            if kind == K_GET1 or kind == K_GET4:
                index = data[pos] if n == 1 else int.from_bytes(data[pos : pos + 4], "little")
                pos += n
                value = memo[index]
                if value >= _DEPTH1:
                    self.fetched.add(index)
                    memo_at[len(stack)] = index
                push(value)
            elif kind == K_MEMOIZE:
                if len(stack) <= (marks[-1] if marks else 0):
                    raise PickleRefused("memo of nothing")
                memo_at[len(stack) - 1] = len(memo)
                memo[len(memo)] = stack[-1]
            elif kind == K_ATOM:
                pos += n
                push(_ATOM)
            elif kind == K_TUPLE or kind == K_CALL:
                if len(stack) - n < (marks[-1] if marks else 0):
                    raise PickleRefused("stack underflow")
                items = stack[-n:]
                del stack[-n:]
                push(_container(items))  # a call's new object, too, may hold what it was built from
            elif kind == K_MARK:
                marks.append(len(stack))
            elif kind == K_ATOM_LEN:
                length = data[pos] if n == 1 else int.from_bytes(data[pos : pos + n], "little", signed=data[pos - 1] == 0x54)
                if length < 0:
                    raise PickleRefused("negative length")
                pos += n + length
                push(_ATOM)
            elif kind == K_EMPTY:
                push(_EMPTY_C)
            elif kind == K_PUT1 or kind == K_PUT4 or kind == K_PUT_LINE:
                if kind == K_PUT_LINE:
                    newline = data.index(b"\n", pos)
                    index = int(data[pos:newline]) if data[pos:newline].isdigit() else -1
                    pos = newline + 1
                else:
                    index = data[pos] if n == 1 else int.from_bytes(data[pos : pos + 4], "little")
                    pos += n
                if index < 0 or index > ops or len(stack) <= (marks[-1] if marks else 0):
                    raise PickleRefused("memo index out of range")  # the C unpickler would allocate a memo this large
                memo[index] = stack[-1]
                memo_at[len(stack) - 1] = index
            elif kind == K_BUILD or kind == K_FILL or kind == K_FILL_MARK:
                start = marks.pop() if kind == K_FILL_MARK else len(stack) - (n if kind == K_FILL else 1)
                if start <= (marks[-1] if marks else 0):
                    raise PickleRefused("stack underflow")
                items = stack[start:]
                del stack[start:]
                if n and kind != K_BUILD:  # dict keys (every 2nd item) or set items (each)
                    self._hash(items[::2] if kind == K_FILL else items[::n])
                self._fill(items)
            elif kind == K_TO_MARK or kind == K_INST:
                if kind == K_INST:
                    pos = data.index(b"\n", data.index(b"\n", pos) + 1) + 1
                items = stack[marks.pop() :]
                del stack[len(stack) - len(items) :]
                if n and kind == K_TO_MARK:
                    self._hash(items[::n])
                push(_container(items))
            elif kind == K_ATOM_LINES or kind == K_GET_LINE:
                for _ in range(n):
                    newline = data.index(b"\n", pos)
                    digits = data[pos:newline]
                    pos = newline + 1
                if kind == K_GET_LINE:
                    index = int(digits) if digits.isdigit() else -1
                    value = memo[index]
                    if value >= _DEPTH1:
                        self.fetched.add(index)
                        memo_at[len(stack)] = index
                    push(value)
                else:
                    push(_ATOM)
            elif kind == K_POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                elif len(stack) <= (marks[-1] if marks else 0):
                    raise PickleRefused("stack underflow")
                else:
                    stack.pop()
            elif kind == K_POP_MARK:
                del stack[marks.pop() :]
            elif kind == K_DUP or kind == K_REPLACE:
                if len(stack) <= (marks[-1] if marks else 0):
                    raise PickleRefused("stack underflow")
                if kind == K_DUP:
                    self.inexact = self.inexact or stack[-1] >= _DEPTH1  # two references to one container, untracked
                    push(stack[-1])
                else:
                    stack[-1] = _ATOM
            elif kind == K_SKIP:
                pos += n
            elif kind == K_BIGINT:  # a big int hashes in time proportional to its digits
                length = int.from_bytes(data[pos : pos + n], "little", signed=n == 4)
                if length < 0:
                    raise PickleRefused("negative length")
                pos += n + length
                push(min(1 + length // 64, _CAP))
            elif kind == K_STOP:
                if not self.inexact and (stack[-1] & _SIZE) > TREE_BASE + EXPANSION * ops:
                    raise PickleRefused("too many nested references (a shared value expands far beyond the pickle)")
                return self.inexact
            if pos > end:
                raise PickleRefused("truncated")
        raise PickleRefused("no STOP opcode")

    def _hash(self, keys: list[int]) -> None:
        self.hash_left -= _key_cost(keys)
        if self.hash_left < 0:
            raise PickleRefused("dict keys or set items that take too long to hash (nested shared tuples)")

    def _fill(self, items: list[int]) -> None:
        """Put `items` into the container on top of the stack and keep its memo entry up to date; a copy
        fetched from the memo earlier is then out of date, and the sizes no longer exact."""
        stack = self.stack
        old = stack[-1]
        added = _container(items)
        depth = max(old >> _SHIFT, added >> _SHIFT)
        new = stack[-1] = depth << _SHIFT | min((old & _SIZE) + (added & _SIZE) - 1, _CAP)
        index = self.memo_at.get(len(stack) - 1)
        if index is not None and self.memo.get(index) == old:
            self.memo[index] = new
            self.inexact = self.inexact or index in self.fetched


# ---- after: the tree as later traversals see it ------------------------------------------------------

_ATOMS = (str, bytes, bytearray, int, float, bool, type(None), complex)
CHILDREN: dict[type, Callable[[Any], list[Any]]] = {}  # stand-ins without a __dict__ (safe_pickle registers them)


def _children(value: Any) -> list[Any] | None:
    """The references a traversal follows from `value` (None for a leaf)."""
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    rule = CHILDREN.get(type(value))
    if rule is not None:
        return rule(value)
    state = getattr(value, "__dict__", None)
    return list(state.values()) if type(state) is dict else None


def bound_tree(value: Any) -> None:
    """Refuse a value with a cycle, nesting deeper than MAX_DEPTH, or whose tree (each shared reference counted
    every time it is reached, as flatten, repr and the pickler reach it) exceeds EXPANSION times its stored
    references plus TREE_BASE. Linear in the stored references: each container is counted once."""
    done: dict[int, tuple[int, int]] = {}  # id -> (expanded size, height) of a finished container
    keep: list[Any] = []  # finished containers stay referenced, so their ids stay theirs
    edges = 0
    root = _children(value)
    if root is None:
        return
    stack: list[tuple[Any, list[Any], int]] = [(value, root, 0)]
    on_path = {id(value)}
    while stack:
        node, kids, i = stack[-1]
        if i < len(kids):
            stack[-1] = (node, kids, i + 1)
            child = kids[i]
            if isinstance(child, _ATOMS):
                continue
            if id(child) in done:
                if len(stack) + done[id(child)][1] > MAX_DEPTH:
                    raise PickleRefused(f"the pickle nests containers more than {MAX_DEPTH} deep")
                continue
            if id(child) in on_path:
                raise PickleRefused("the pickle holds a recursive reference (a container inside itself)")
            grandchildren = _children(child)
            if grandchildren is None:
                continue
            if len(stack) >= MAX_DEPTH:
                raise PickleRefused(f"the pickle nests containers more than {MAX_DEPTH} deep")
            stack.append((child, grandchildren, 0))
            on_path.add(id(child))
            continue
        stack.pop()
        on_path.discard(id(node))
        edges += len(kids)
        size, height = 1, 1
        for child in kids:
            child_size, child_height = done.get(id(child), (1, 0))
            size += child_size
            height = max(height, child_height + 1)
        done[id(node)] = (min(size, _SIZE_CAP), height)
        keep.append(node)
    if done[id(value)][0] > TREE_BASE + EXPANSION * edges:
        raise PickleRefused("too many nested references (a shared value expands far beyond the pickle)")
