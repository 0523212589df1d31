"""Zip archives as torch.save writes them: locate records for lazy reads, and lay them out for
streaming writes (stored, 64-byte aligned payloads, data descriptors, zip64 when needed).

Layout facts: docs/formats.md §1.4 and §4.2 (torch/serialization.py, miniz).
"""

from __future__ import annotations

import functools
import hashlib
import io
import re
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, BinaryIO, NamedTuple

from ckpt_cli.core import meter
from ckpt_cli.errors import DataError

_zip_scan: ModuleType | None
try:  # built by `pip install` where a C compiler is at hand (pyproject.toml: an optional extension)
    from ckpt_cli.core.pickles import _zip_scan
except ImportError:
    _zip_scan = None

ALIGNMENT = 64
_CONTROL = re.compile("[\x00-\x1f\x7f]")
WHOLE_BYTES = 1 << 20  # an archive this small is read whole (one system call) before it is parsed
ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_U32_MAX = 0xFFFFFFFF


class Record(NamedTuple):
    """One stored record: its payload is bytes [data_offset, data_offset + size) of the file (a tuple: a DCP rank
    file of thousands of chunk archives makes seven per chunk)."""

    name: str  # without the archive's top folder ("data.pkl", "data/0")
    data_offset: int
    size: int
    crc: int


class _Window:
    """A read-only file object over bytes [start, start + length) of `f` (a DCP byte range)."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.length + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.start + self.pos)
        data = self.f.read(max(n, 0))
        self.pos += len(data)
        return data

    def seekable(self) -> bool:
        return True


def read_records(f: BinaryIO, where: str, start: int = 0, length: int | None = None) -> dict[str, Record]:
    """Records of the archive in bytes [start, start+length) of `f`, keyed by name minus top folder (read_archive)."""
    return read_archive(f, where, start, length)[0]


def read_archive(
    f: BinaryIO, where: str, start: int = 0, length: int | None = None, shared: dict[bytes, dict[str, Record]] | None = None
) -> tuple[dict[str, Record], bytes | None]:
    """Records of the archive in bytes [start, start+length) of `f`, keyed by name minus top folder, and the
    archive's bytes when it was small enough to be read whole (WHOLE_BYTES; else None).

    `shared`: records already parsed in this read, by the SHA-256 of a whole file's bytes (archives from offset 0): files
    that are the same byte for byte (every rank's ZeRO-3 model states) share one read-only table instead of holding
    2,000 records each (1,024 ranks: 290 MB).

    Refused (DataError): what torch.save never writes and readers would disagree on. torch's reader (miniz,
    caffe2/serialize/inline_container.cc) looks every record up by name and takes whichever of two equal names
    its search meets first, so a duplicate name hides a record from one reader and shows it to another;
    records outside the first entry's folder are invisible to it; a local header whose name differs from the
    central directory's, or records whose bytes overlap, are not torch's either.
    """
    if length is None:
        length = f.seek(0, 2) - start
    tail = _Window(f, start, length)
    window: _Window | io.BytesIO = tail
    whole: bytes | None = None
    if length <= WHOLE_BYTES and getattr(f, "prefetch", None) is None:  # a small archive (a DCP chunk): one read, parsed in memory
        f.seek(start)
        whole = f.read(length)
        if shared is not None and start == 0:
            key = hashlib.sha256(whole).digest()
            if key not in shared:  # parsed from the very bytes hashed
                shared[key] = read_archive(io.BytesIO(whole), where, 0, length)[0]
            return shared[key], whole
        window = io.BytesIO(whole)
        if _zip_scan is not None:
            plain = _plain_records(whole, start)
            if plain is not None:
                return plain, whole
    infos: list[Any] | None = _plain_directory(whole) if whole is not None else _tail_directory(tail)
    try:
        infos = infos or zipfile.ZipFile(window).infolist()
    except (zipfile.BadZipFile, OSError, ValueError, struct.error, NotImplementedError) as exc:  # NotImplemented: a version past 6.3
        raise DataError(f"{where}: not a readable zip archive ({exc}); the file may be truncated") from exc
    if not infos:
        raise DataError(f"{where}: empty zip archive")
    top = _top_folder(infos[0].filename, where)
    prefetch = getattr(f, "prefetch", None)
    if prefetch is not None:  # an object in object storage (ckpt_cli.store): every local header in one parallel round
        prefetch([(start + info.header_offset, _LOCAL_HEADER.size + 4 * len(info.orig_filename)) for info in infos])
    records: dict[str, Record] = {}
    spans: list[tuple[int, int, str]] = []
    for info in infos:
        name = _member_name(info.filename, top, where)
        if name in records:
            raise DataError(f"{where}: record {_shown(info.filename)} appears twice in the archive (torch.save writes each name once)")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise DataError(f"{where}: record {_shown(info.filename)} is compressed; torch archives are stored")
        if info.flag_bits & 0x1:
            raise DataError(f"{where}: record {_shown(info.filename)} is encrypted; torch archives are not")
        if not 0 <= info.header_offset <= length - _LOCAL_HEADER.size:  # zipfile shifts offsets by what precedes the directory
            raise DataError(f"{where}: record {_shown(info.filename)} has no local header (truncated or corrupt)")
        data_offset = _local_data_offset(window, info, where)
        if data_offset + info.file_size > length:
            raise DataError(f"{where}: record {_shown(info.filename)} runs past the end of the file (truncated)")
        records[name] = Record(name, start + data_offset, info.file_size, info.CRC)
        spans.append((info.header_offset, data_offset + info.file_size, info.filename))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise DataError(f"{where}: records {_shown(first)} and {_shown(second)} overlap (torch.save writes them one after another)")
    return records, whole


def _plain_records(archive: bytes, start: int) -> dict[str, Record] | None:
    """read_records of an archive held whole, by core/pickles/_zip_scan.c: the records when the archive is laid out as
    torch.save writes one and read_records would accept every record; else None (the Python path then decides)."""
    found = _zip_scan.records(archive) if _zip_scan is not None else None
    if found is None:
        return None
    # names interned: each of a wide DCP save's 200,000 chunk archives names the same few records
    records = {(name := sys.intern(n)): Record(name, start + offset, size, crc) for n, offset, size, crc in found}
    return records if len(records) == len(found) else None  # a name twice: the Python path says so


class _Entry(NamedTuple):
    """A central directory entry, with the ZipInfo attributes read_records uses."""

    filename: str
    orig_filename: str
    header_offset: int
    file_size: int
    compress_size: int
    compress_type: int
    flag_bits: int
    CRC: int  # noqa: N815 - ZipInfo's name


_END = struct.Struct("<IHHHHIIH")  # end of central directory record, 22 bytes
_END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record, 56 bytes (torch writes one)
_LOCATOR64 = struct.Struct("<IIQI")  # zip64 end of central directory locator, 20 bytes
_CENTRAL = struct.Struct("<IBBBBHHHHIIIHHHHHII")  # central directory header, 46 bytes


def _plain_directory(buf: bytes, base: int = 0) -> list[_Entry] | None:
    """The central directory of an archive whose bytes from offset `base` to its end are `buf` (the whole archive,
    or its tail from the directory on), when it is laid out as torch.save writes one (no comment, no extra fields,
    ASCII names, nothing before or after it, a zip64 end record or not); None for any other archive, which zipfile
    then parses. Parsing a DCP chunk's small archive this way costs a few microseconds, zipfile's ~20."""
    span = _directory_span(buf, base)
    if span is None or span[0] < base:
        return None
    cd_offset, count, cd_end = span
    entries, pos, cd_end = [], cd_offset - base, cd_end - base
    for _ in range(count):
        if pos + _CENTRAL.size > cd_end:
            return None
        fields = _CENTRAL.unpack_from(buf, pos)
        sig, needs, flags, method, crc, csize, usize, name_len, extra_len, comment_len, offset = (
            fields[0], fields[3], fields[5], fields[6], fields[9], fields[10], fields[11], fields[12], fields[13], fields[14], fields[18],
        )  # fmt: skip
        raw = buf[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len]
        if sig != 0x02014B50 or needs > zipfile.MAX_EXTRACT_VERSION or extra_len or comment_len or not raw.isascii() or b"\0" in raw:
            return None
        name = raw.decode("ascii")
        entries.append(_Entry(name, name, offset, usize, csize, method, flags, crc))
        pos += _CENTRAL.size + name_len
    return entries if pos == cd_end else None


def _directory_span(buf: bytes, base: int) -> tuple[int, int, int] | None:
    """(offset, entry count, end) of the central directory, in archive offsets, from the end records at the end of
    `buf` (archive bytes from `base` on); None when they are not torch.save's."""
    end = len(buf) - _END.size
    if end < 0:
        return None
    sig, disk, cd_disk, on_disk, count, cd_size, cd_offset, comment = _END.unpack_from(buf, end)
    if sig != 0x06054B50 or comment:
        return None
    cd_end = end
    if end >= _LOCATOR64.size and buf[end - _LOCATOR64.size : end - _LOCATOR64.size + 4] == b"PK\x06\x07":
        _, locator_disk, _, disks = _LOCATOR64.unpack_from(buf, end - _LOCATOR64.size)
        cd_end = end - _LOCATOR64.size - _END64.size
        if locator_disk or disks > 1 or cd_end < 0:
            return None
        sig, _, _, _, disk, cd_disk, on_disk, count, cd_size, cd_offset = _END64.unpack_from(buf, cd_end)
        if sig != 0x06064B50:
            return None
    if disk or cd_disk or on_disk != count or cd_offset + cd_size != base + cd_end:
        return None
    return cd_offset, count, base + cd_end


def _tail_directory(window: _Window) -> list[_Entry] | None:
    """_plain_directory of a large archive, from two reads at its end (the end records, then the directory)."""
    tail = min(window.length, _END.size + _LOCATOR64.size + _END64.size)
    window.seek(window.length - tail)
    span = _directory_span(window.read(tail), window.length - tail)
    if span is None or not 0 <= span[0] <= window.length:
        return None
    window.seek(span[0])
    return _plain_directory(window.read(), span[0])


def _shown(name: str) -> str:
    """A member name for an error message: repr() (no control characters reach the terminal), cut short."""
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def _top_folder(first: str, where: str) -> str:
    """The archive's folder ("archive/", or the file stem): torch takes it from the first entry's name."""
    folder, sep, _ = first.partition("/")
    if not sep or not _plain_part(folder):
        raise DataError(f"{where}: first record {_shown(first)} is not inside a folder, as torch.save writes every record")
    return folder + "/"


def _member_name(full: str, top: str, where: str) -> str:
    """`full` minus the archive folder; DataError for a name torch would not find or torch.save would not write."""
    name = _plain_member(full, top)
    if name is None:
        raise DataError(f"{where}: record {_shown(full)} is not a plain name inside the archive folder {_shown(top)}")
    return name


def _plain_member(full: str, top: str) -> str | None:
    """`full` minus `top` when every part of it is plain, else None."""
    if not full.startswith(top):
        return None
    name = full[len(top) :]
    return name if _PLAIN_NAME.fullmatch(name) or _plain_parts(name) else None


_PLAIN_NAME = re.compile(r"(?:\.*[\w-][\w.-]*/)*\.*[\w-][\w.-]*", re.ASCII)  # what torch.save writes: data/0, .data/version


@functools.lru_cache(maxsize=1024)
def _plain_parts(name: str) -> bool:
    return bool(name) and all(_plain_part(part) for part in name.split("/"))


def _plain_part(part: str) -> bool:
    return part not in ("", ".", "..") and "\\" not in part and _CONTROL.search(part) is None


def _local_data_offset(window: _Window | io.BytesIO, info: zipfile.ZipInfo, where: str) -> int:
    """Where the record's payload starts: after its local header, whose name must be the central directory's
    and whose own extra length (zip64 and torch's 'FB' padding) counts, not the central one (§1.4)."""
    window.seek(info.header_offset)
    header = window.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or header[:4] != ZIP_MAGIC:
        raise DataError(f"{where}: record {_shown(info.filename)} has no local header (truncated or corrupt)")
    name_len, extra_len = _LOCAL_HEADER.unpack(header)[-2:]
    if window.read(name_len) != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
        raise DataError(f"{where}: record {_shown(info.filename)}: its local header names another record")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def archive_problems(f: BinaryIO, where: str) -> list[str]:
    """Every record of the torch.save archive open as `f` that does not match its CRC32 (verify --deep of a whole file)."""
    return [p for rec in read_records(f, where).values() if (p := crc_problem(f, rec, where))]


def crc_problem(f: BinaryIO, record: Record, where: str, block: int = 1 << 24) -> str | None:
    """Why `record`'s bytes do not match its CRC32 (None when they do, or the CRC is a 0 skeleton)."""
    crc, done = 0, 0
    f.seek(record.data_offset)
    while done < record.size:
        chunk = f.read(min(block, record.size - done))
        if not chunk:
            return f"{where}: record {record.name} is truncated"
        crc = zlib.crc32(chunk, crc)
        done += len(chunk)
        meter.advance(len(chunk))
    if record.crc and crc != record.crc:
        return f"{where}: record {record.name} fails its CRC32 check (stored {record.crc:08x}, data {crc:08x})"
    return None


@dataclass(frozen=True)
class ZipEntryLayout:
    """Where one record sits in an archive being written."""

    name: str
    header_offset: int
    header: bytes
    data_offset: int
    size: int

    @property
    def zip64(self) -> bool:
        return self.size >= _U32_MAX or self.header_offset >= _U32_MAX

    @property
    def descriptor_size(self) -> int:
        return 24 if self.zip64 else 16

    @property
    def end(self) -> int:
        return self.data_offset + self.size + self.descriptor_size


def local_header(name: str, header_offset: int, size: int) -> bytes:
    """A miniz-style local header (CRC and sizes deferred to the data descriptor), payload 64-aligned."""
    encoded = name.encode()
    zip64 = size >= _U32_MAX or header_offset >= _U32_MAX
    extra = struct.pack("<HHQQ", 0x0001, 16, 0, 0) if zip64 else b""
    base = header_offset + _LOCAL_HEADER.size + len(encoded) + len(extra) + 4
    pad = (-base) % ALIGNMENT
    extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # 'FB' padding field, as torch writes
    sizes = _U32_MAX if zip64 else 0
    head = _LOCAL_HEADER.pack(0x04034B50, 45 if zip64 else 0, 0x0808, 0, 0, 0, 0, sizes, sizes, len(encoded), len(extra))
    return head + encoded + extra


def layout_entry(name: str, header_offset: int, size: int) -> ZipEntryLayout:
    header = local_header(name, header_offset, size)
    return ZipEntryLayout(name, header_offset, header, header_offset + len(header), size)


def data_descriptor(entry: ZipEntryLayout, crc: int) -> bytes:
    if entry.zip64:
        return struct.pack("<IIQQ", 0x08074B50, crc, entry.size, entry.size)
    return struct.pack("<IIII", 0x08074B50, crc, entry.size, entry.size)


def central_directory_size(entries: list[ZipEntryLayout]) -> int:
    size = sum(46 + len(e.name.encode()) + (28 if e.zip64 else 0) for e in entries)
    return size + (56 + 20 if _needs_zip64_end(entries, 0) else 0) + 22


def _needs_zip64_end(entries: list[ZipEntryLayout], cd_offset: int) -> bool:
    end = entries[-1].end if entries else 0
    return len(entries) >= 0xFFFF or end >= _U32_MAX or cd_offset >= _U32_MAX


def central_directory(entries: list[ZipEntryLayout], crcs: dict[str, int]) -> bytes:
    """Central directory plus end records for `entries` written back to back from offset 0."""
    cd_offset = entries[-1].end if entries else 0
    parts = []
    for e in entries:
        encoded = e.name.encode()
        extra = struct.pack("<HHQQQ", 0x0001, 24, e.size, e.size, e.header_offset) if e.zip64 else b""
        small = _U32_MAX if e.zip64 else e.size
        offset = _U32_MAX if e.zip64 else e.header_offset
        record = (crcs[e.name], small, small, len(encoded), len(extra))  # CRC, sizes, name and extra lengths
        parts.append(
            _CENTRAL.pack(0x02014B50, 0, 0, 45 if e.zip64 else 0, 0, 0x0808, 0, 0, 0, *record, 0, 0, 0, 0, offset) + encoded + extra
        )
    cd = b"".join(parts)
    count = len(entries)
    if not _needs_zip64_end(entries, cd_offset):
        return cd + _END.pack(0x06054B50, 0, 0, count, count, len(cd), cd_offset, 0)
    end64 = cd_offset + len(cd)
    tail = _END64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, len(cd), cd_offset) + _LOCATOR64.pack(0x07064B50, 0, end64, 1)
    return cd + tail + _END.pack(0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _U32_MAX, _U32_MAX, 0)
