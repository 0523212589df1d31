"""DCP chunk headers in object storage: fetched in one round, or laid out from a parsed twin and checked with the data.

Every tensor chunk of a torch.save-serialized DCP checkpoint is a small zip archive around its data. Reading one's
layout costs a ranged GET of its head and tail, so a checkpoint of 240 chunks spent 267 requests (and on moto 4.6 s)
before the first byte of data moved. But torch.save writes the same archive, byte for byte but the data and a
serialization id, for every tensor of one dtype, shape and strides: chunks of one (dtype, sizes, item length) are
twins. For a write (ReadOptions.predicted_chunks) the reader parses the first chunk of each kind (`Twins.first`) and
lays the others out from it (`Twins.predict`), shifted to their own offset, each registered with store/predicted.py:
the GET of its data is widened to the whole archive (a few KiB), and before any byte is served the archive is parsed
(`_check`): the same records at the same places, the same data.pkl byte for byte (so the same dtype, shape, strides
and storage), and the data's CRC32 against the one its own central directory records. A chunk that differs only in
layout raises Mispredicted (the write runs again, every chunk parsed); a damaged one is refused as the full parse
would refuse it.

Only chunks between TWIN_LEAST and TWIN_MOST bytes are predicted: smaller ones are fetched whole with their
neighbours anyway, and larger ones would be fetched whole before any byte is served (the prefetch's pieces are
PIECE_BYTES; a few headers are a small share of a large chunk's requests).
"""

from __future__ import annotations

import functools
import io
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpt_cli.core.dtypes import DType
from ckpt_cli.core.model import StoredArray
from ckpt_cli.core.pickles import zipio
from ckpt_cli.errors import DataError
from ckpt_cli.formats.dcp.metadata import StorageIndex, StorageInfoRec, TensorStorageRec, as_tuple
from ckpt_cli.formats.torch_save import stored_array
from ckpt_cli.store import predicted
from ckpt_cli.store.prefetch import PIECE_BYTES

TWIN_LEAST = 256 << 10
TWIN_MOST = 2 * PIECE_BYTES
Kind = tuple[DType, tuple[int, ...], int]  # dtype, chunk sizes, archive length


@dataclass(frozen=True)
class _Parsed:
    """The first chunk of a kind, parsed: what its twins are checked against."""

    offset: int
    length: int  # of its archive
    ref: Any  # its data.pkl's TensorRef
    records: dict[str, zipio.Record]
    layout: dict[str, tuple[int, int]]  # record name -> (data offset in the archive, size)
    pickle: bytes


class Twins:
    """The chunks of one read that are laid out from a parsed twin."""

    def __init__(self, meta_tensors: dict[str, Any], storage: StorageIndex) -> None:
        self.parsed: dict[Kind, _Parsed] = {}  # the first of each kind, once parsed as a torch.save archive
        self.first: dict[Kind, tuple[str, int]] = {}  # (file, offset) of the first chunk of each kind
        self.twins: set[tuple[str, int]] = set()  # the chunks laid out from their first
        for fqn, item in meta_tensors.items():
            if not isinstance(item, TensorStorageRec):
                continue
            for chunk in item.chunks:
                info = storage.get((fqn, as_tuple(chunk.offsets)))
                if info is not None and TWIN_LEAST <= info.length <= TWIN_MOST:
                    here = (info.relative_path, info.offset)
                    if self.first.setdefault((item.properties.dtype, as_tuple(chunk.sizes), info.length), here) != here:
                        self.twins.add(here)

    def is_twin(self, info: StorageInfoRec) -> bool:
        """Whether the chunk is laid out from the first of its kind (its headers are not fetched)."""
        return (info.relative_path, info.offset) in self.twins

    def learn(self, kind: Kind, info: StorageInfoRec, ref: Any, records: dict[str, zipio.Record], pickle: bytes) -> None:
        """The chunk as the reader parsed it from its torch.save archive; kept when it is the first of its kind."""
        if self.first.get(kind) != (info.relative_path, info.offset):
            return
        layout = {name: (rec.data_offset - info.offset, rec.size) for name, rec in records.items()}
        self.parsed[kind] = _Parsed(info.offset, info.length, ref, records, layout, pickle)

    def predict(self, url: str, kind: Kind, info: StorageInfoRec, fqn: str) -> StoredArray | None:
        """The chunk's array laid out from its parsed twin, registered to be checked when fetched; None when it is no
        twin or its first is not parsed (it is then parsed itself)."""
        twin = self.parsed.get(kind)
        if twin is None or not self.is_twin(info):
            return None
        shift = info.offset - twin.offset
        records = {name: zipio.Record(name, rec.data_offset + shift, rec.size, 0) for name, rec in twin.records.items()}
        array = stored_array(twin.ref, records, url, fqn)  # crc 0: its CRC32 is checked when fetched, from its own archive
        data = records[f"data/{twin.ref.storage.key}"]
        check = functools.partial(_check, twin, info.offset, url, fqn)
        predicted.expect(url, info.offset, info.offset + info.length, data.data_offset, data.data_offset + data.size, check)
        return array


EDGE_BYTES = 1536  # of a stored item: its head (local headers, data.pkl: ~730 B for a torch 2.13 tensor) and tail (~880 B)


def prefetch_edges(open_file: Callable[[str], BinaryIO], infos: Iterable[StorageInfoRec]) -> None:
    """In object storage, fetch the head and tail of each stored item named (those parsed from their own headers) in
    one parallel round (store/location.py RemoteFile.prefetch): parsing an item's archive reads only there, a few
    round trips each otherwise. `open_file`: a data file by its relative path."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for info in infos:
        n = min(info.length, EDGE_BYTES)
        ranges.setdefault(info.relative_path, []).extend([(info.offset, n), (info.offset + info.length - n, n)])
    for relative, wanted in ranges.items():
        try:
            f = open_file(relative)
        except (DataError, OSError):
            continue  # reported by name when the item is read
        prefetch = getattr(f, "prefetch", None)
        if prefetch is not None:
            prefetch(wanted)


def forget_predicted(urls: Iterable[str]) -> None:
    """A new read of these objects: the items an earlier read laid out there are dropped (store/predicted.forget)."""
    for url in urls:
        predicted.forget(url)


def _check(twin: _Parsed, offset: int, url: str, fqn: str, fetched: bytes, at: int) -> None:
    """The chunk's archive, fetched whole (from `at` in `fetched`), is its twin's but for the data (Mispredicted where it
    is another valid layout), and its data matches the CRC32 its own directory records (DataError)."""
    where = f"{url} ('{fqn}' at {offset})"
    length = twin.length
    records = zipio.read_archive(io.BytesIO(fetched), where, at, length)[0]  # BytesIO shares the bytes: no copy
    pkl = records.get("data.pkl")
    layout = {name: (rec.data_offset - at, rec.size) for name, rec in records.items()}
    if layout != twin.layout or pkl is None or fetched[pkl.data_offset : pkl.data_offset + pkl.size] != twin.pickle:
        raise predicted.Mispredicted(f"{where}: laid out unlike the chunks of its dtype and shape")
    data = records[f"data/{twin.ref.storage.key}"]
    crc = zlib.crc32(memoryview(fetched)[data.data_offset : data.data_offset + data.size])
    if data.crc and crc != data.crc:
        raise DataError(
            f"{url}: record {data.name} at byte {offset + data.data_offset - at} fails its CRC32 check (stored "
            f"{data.crc:08x}, read {crc:08x}): the file is damaged; nothing was converted"
        )
