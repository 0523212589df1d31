"""Items of objects laid out by prediction: each checked whole before any byte of its data is served.

A reader in object storage may lay out an item from another one it parsed, instead of fetching the item's own
headers (formats/dcp/reader.py: a DCP chunk archive of the same dtype, shape and length as one whose headers it
read), so that the item costs no request before its data is fetched. It registers the item here (`expect`) with the
check its whole bytes must pass. `store.location.fetch` widens a GET that reaches into an unchecked item's data to the
whole item (its headers: a few KiB more) and runs the check on those bytes before it returns any of them; a fetch
that meets an item another thread is checking waits for that check. An item that fails keeps failing: no byte of its
data is ever served unchecked. `unchecked` tells the writers that let the store copy bytes unseen (S3 UploadPartCopy)
to fetch these instead.

A check raises `Mispredicted` when the item is well formed but laid out otherwise than predicted (a chunk of
the same shape saved with other strides): the write is then run again with every item's headers read
(ops/writes.py), never served from the wrong offsets. Any other DataError (a CRC32 that fails, a torn archive) is
the item's own fault and is reported as such.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

from ckpt_cli.errors import DataError

Check = Callable[[bytes, int], None]  # (bytes fetched, where the item starts in them)
PENDING, CLAIMED, PASSED, FAILED = range(4)


class Mispredicted(DataError):
    """An item is laid out otherwise than predicted: read the source again parsing every item's headers."""


class _Item:
    __slots__ = ("start", "end", "data_start", "data_end", "check", "state", "error")

    def __init__(self, start: int, end: int, data_start: int, data_end: int, check: Check) -> None:
        self.start, self.end, self.data_start, self.data_end, self.check = start, end, data_start, data_end, check
        self.state = PENDING
        self.error: BaseException | None = None


class _Object:
    """One object's items, sorted by start once more are added (a reader registers thousands, in its own order)."""

    __slots__ = ("starts", "items", "tidy")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.items: list[_Item] = []
        self.tidy = True

    def overlapping(self, start: int, end: int) -> list[_Item]:
        """The items whose data overlaps [start, end) (items do not overlap one another)."""
        if not self.tidy:
            self.items.sort(key=lambda item: item.start)
            self.starts = [item.start for item in self.items]
            self.tidy = True
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        found = []
        while i < len(self.items) and self.items[i].start < end:
            item = self.items[i]
            if item.data_start < end and start < item.data_end:
                found.append(item)
            i += 1
        return found


_objects: dict[str, _Object] = {}
_changed = threading.Condition()


def expect(url: str, start: int, end: int, data_start: int, data_end: int, check: Check) -> None:
    """Item [start, end) of the object at `url`, with its data at [data_start, data_end), is served only once `check`
    passed on the bytes fetched with it (given with the item's place in them; raising DataError, or Mispredicted, when
    they are not what the reader predicted)."""
    with _changed:
        found = _objects.setdefault(url, _Object())
        found.items.append(_Item(start, end, data_start, data_end, check))
        found.tidy = False


def unchecked(url: str, start: int, end: int) -> bool:
    """Whether bytes [start, end) of `url` reach into the data of an item not checked yet."""
    if url not in _objects:
        return False
    with _changed:
        return any(item.state != PASSED for item in _objects[url].overlapping(start, end))


def laid_out(url: str, start: int, end: int) -> bool:
    """Whether bytes [start, end) of `url` reach into the data of an item laid out by prediction, checked or not."""
    if url not in _objects:
        return False
    with _changed:
        return bool(_objects[url].overlapping(start, end))


def claim(url: str, start: int, end: int) -> tuple[list[_Item], list[_Item]]:
    """For a fetch of [start, end): the unchecked items it should fetch whole and check (now claimed by it), and the
    items another fetch is checking, to wait for. An item that failed raises its error again."""
    if url not in _objects:
        return [], []
    mine, theirs = [], []
    with _changed:
        for item in _objects[url].overlapping(start, end):
            if item.state == FAILED:
                raise item.error  # type: ignore[misc]  # set with the state
            if item.state == PENDING:
                item.state = CLAIMED
                mine.append(item)
            elif item.state == CLAIMED:
                theirs.append(item)
    return mine, theirs


def settle(mine: list[_Item], data: bytes | None, base: int) -> None:
    """Check the claimed items on `data` (bytes of the object from `base`), or give them back unchecked (`data` None:
    the fetch failed); raises the first check's error. Every item is settled, whatever is raised: an item left
    claimed would keep the fetches waiting for it waiting for ever (an error not of the data, or an interrupt, gives
    this item and the rest back)."""
    first: BaseException | None = None
    unexpected: BaseException | None = None
    for item in mine:
        state, error = PENDING, None
        if data is not None and unexpected is None:
            try:
                item.check(data, item.start - base)
                state = PASSED
            except DataError as exc:
                state, error = FAILED, exc
                first = first or exc
            except BaseException as exc:
                unexpected = exc
        with _changed:
            item.state, item.error = state, error
            _changed.notify_all()
    if unexpected is not None:
        raise unexpected
    if first is not None:
        raise first


def wait(theirs: list[_Item]) -> list[_Item]:
    """Wait for the checks other fetches run; raises the error of one that failed. Returns the items given back
    unchecked (their fetch failed), claimed now: the caller fetches and checks them itself."""
    again = []
    for item in theirs:
        with _changed:
            while item.state == CLAIMED:
                _changed.wait()
            if item.state == FAILED:
                raise item.error  # type: ignore[misc]
            if item.state == PENDING:
                item.state = CLAIMED
                again.append(item)
    return again


def forget(url: str) -> None:
    """Drop the items registered for `url`: a reader lays the object's items out again, and its checks replace the
    earlier read's (a plan of that earlier read, run after it in the same process, is checked against the new read's
    layout). Neither `store.fresh()` nor a write forgets them: a plan made from them may still be run."""
    with _changed:
        _objects.pop(url, None)
