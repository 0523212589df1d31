"""core/pickles/_pickle_memo.c: a large pickle loaded without the memo stores nothing reads back gives the same value.

The rewrite must never change what a pickle builds (sharing included), never read outside the pickle, and leave
alone what it does not handle; the allow list and the scan see the same opcodes either way."""

from __future__ import annotations

import mmap
import pickle
import random
from pathlib import Path

import pytest
from conftest import ckpt_quiet
from test_hostile_pickles import HOSTILE

from ckpt_cli.core.pickles import pickle_guard
from ckpt_cli.core.pickles.safe_pickle import safe_loads
from ckpt_cli.errors import DataError, UnsafePickleError
from ckpt_cli.formats.dcp.metadata import (
    METADATA_GLOBALS,
    SharedTensors,
    StorageFiller,
    as_tuple,
    load_metadata,
    storage_index,
)

pytestmark = pytest.mark.skipif(pickle_guard._pickle_memo is None, reason="the C extension is not built")


def lean(data: bytes) -> bytes:
    return pickle_guard.lean(data, at_least=0)


def random_value(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth > 4 or r < 0.3:
        return rng.choice([1, 2**40, -5, 10**30, 1.5, None, True, "s" * rng.randint(0, 300), b"x" * rng.randint(0, 3)])
    if r < 0.5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    if r < 0.7:
        return tuple(random_value(rng, depth + 1) for _ in range(rng.randint(0, 5)))
    if r < 0.9:
        return {str(i): random_value(rng, depth + 1) for i in range(rng.randint(0, 5))}
    return {frozenset([1, 2]): {3, 4}}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_same_value_at_every_protocol(protocol):
    rng = random.Random(protocol)
    rewritten = 0
    for _ in range(200):
        shared = random_value(rng)
        value = [random_value(rng), shared, [shared, random_value(rng)], shared]
        data = pickle.dumps(value, protocol=protocol)
        out = lean(data)
        assert len(out) <= len(data)
        assert pickle.loads(out) == pickle.loads(data)
        rewritten += out is not data
    # protocol 0 stores by text lines, left alone; every binary protocol is rewritten
    assert rewritten == (0 if protocol == 0 else 200)


@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
def test_sharing_kept_and_indices_past_255_renumbered(protocol):
    rows = [[i] for i in range(1000)]
    data = pickle.dumps([rows, rows[::-1], {"a": rows[300]}], protocol=protocol)
    out = lean(data)
    assert len(out) < len(data)
    a, b, c = pickle.loads(out)
    assert a == [[i] for i in range(1000)] and all(x is y for x, y in zip(a, b[::-1])) and c["a"] is a[300]
    memo_ops = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
    stores = sum(op.name in memo_ops for op, _, _ in pickle_guard.pickletools.genops(out))
    assert stores == 1000  # the rows are fetched again; nothing else is stored


def test_unread_stores_are_what_the_unpickler_kept():
    """The point of it: a pickle of many records builds them without keeping each one's state in the memo."""
    value = {f"k{i}": (i, [i, i + 1], {"x": i}) for i in range(20_000)}
    data = pickle.dumps(value, protocol=2)
    out = lean(data)
    assert pickle.loads(out) == value
    assert len(out) < 0.75 * len(data)
    stores = sum(op.name in {"BINPUT", "LONG_BINPUT"} for op, _, _ in pickle_guard.pickletools.genops(out))
    assert stores == 1  # the key "x", fetched by every record after the first


def outcome(data: bytes) -> tuple[str, object]:
    """What ckpt's own load makes of a pickle (the scan and the allow list first: some of these would hang or run
    code in a plain pickle.loads)."""
    try:
        return "ok", safe_loads(data, "x")
    except DataError as exc:
        return "error", str(exc).split("(")[0]


def test_left_alone_or_same_value_on_damaged_and_hostile_pickles():
    rng = random.Random(7)
    samples = [data for data, _ in HOSTILE.values()]
    bases = [pickle.dumps([[i, str(i)] for i in range(300)] * 2, protocol=p) for p in (2, 4)]
    for i in range(3000):  # cut short, bytes flipped: never a crash, never a read past the end
        data = bytearray(bases[i % 2])
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        samples.append(bytes(data[: rng.randint(1, len(data))] if i % 3 == 0 else data))
    rewritten = 0
    for data in samples:
        try:
            pickle_guard.scan(data)
        except pickle.UnpicklingError:
            continue  # refused before any rewrite would run
        out = lean(data)
        assert isinstance(out, bytes) and len(out) <= len(data)
        if out is not data:
            rewritten += 1
            expected, got = outcome(data), outcome(out)
            assert got[0] == expected[0]
            if expected[0] == "ok":
                assert got == expected
    assert rewritten > 100


def shape_of(value: object) -> object:
    """The records' fields as plain data, to compare two loads of one `.metadata`."""
    if hasattr(type(value), "_DEFAULTS"):
        fields = {k: shape_of(getattr(value, k, None)) for k in type(value)._DEFAULTS}
        return (type(value).__name__, fields)
    if isinstance(value, dict):
        return {k if isinstance(k, str) else repr(shape_of(k)): shape_of(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [shape_of(v) for v in value]
    return value


def test_real_dcp_metadata_loads_the_same(fsdp2_saves, tmp_path):
    """torch's own `.metadata` (protocol 4: MEMOIZE and FRAME), and ckpt's reshard of it (protocol 2: BINPUT, only for
    the globals and strings it refers to again, so nothing to drop: loaded as written)."""
    resharded = tmp_path / "w5"
    ckpt_quiet("reshard", fsdp2_saves[2] / "ckpt", resharded, "--world-size", "5", "--quiet")
    for folder in (fsdp2_saves[2] / "ckpt", resharded):
        data = (folder / ".metadata").read_bytes()
        out = lean(data)
        assert (out is data) == (folder == resharded) and len(out) <= len(data)
        plain = safe_loads(data, "x", METADATA_GLOBALS)
        leaner = safe_loads(out, "x", METADATA_GLOBALS)
        assert shape_of(leaner) == shape_of(plain)
        meta = load_metadata(Path(folder) / ".metadata", False)
        assert type(meta.storage_data) is StorageFiller and type(meta.state_dict_metadata) is SharedTensors  # filled
        assert shape_of(meta.state_dict_metadata) == shape_of(plain.state_dict_metadata)
        expected = [((k.fqn, as_tuple(k.offset)), (v.relative_path, v.offset, v.length)) for k, v in plain.storage_data.items()]
        got = [(k, (v.relative_path, v.offset, v.length)) for k, v in storage_index(folder / ".metadata", meta).items()]
        assert sorted(got) == sorted(expected) and len(expected) > 10


class Filled(dict):
    """A filler that records what the unpickler gave it."""

    def __setitem__(self, key: object, value: object) -> None:
        super().__setitem__(key, value)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_filler_gets_the_items_of_the_dict_it_replaces(protocol):
    """The dict right after the key's text (and only that one) is the filler, holding the same items, at every
    protocol the rewrite handles; protocol 0 (text memo) is loaded as written, with a plain dict."""
    shared = ["s"]
    value = {
        "a": {"storage_data": 1},  # the key's text followed by something else
        "storage_data": {f"k{i}": (i, shared) for i in range(2500)},  # more than two SETITEMS batches
        "b": ["storage_data", [{}]],
        "c": shared,
    }
    data = pickle.dumps(value, protocol=protocol)
    loaded = safe_loads(data, "x", fillers={"storage_data": Filled})
    assert loaded == value
    kinds = {k: type(v) for k, v in loaded.items()}
    assert kinds == {"a": dict, "storage_data": dict if protocol == 0 else Filled, "b": list, "c": list}
    assert loaded["storage_data"]["k7"][1] is loaded["c"]  # sharing kept


def test_a_filler_past_frames_and_memo_stores():
    """FRAME and MEMOIZE may stand between the key and its dict; the frame hint is dropped with the rest."""
    body = b"\x8c\x0cstorage_data\x94" + b"\x95" + (8).to_bytes(8, "little") + b"}\x94\x8c\x01kK\x01s" + b"s."
    data = b"\x80\x04}" + body
    assert pickle.loads(data) == {"storage_data": {"k": 1}}
    loaded = safe_loads(data, "x", fillers={"storage_data": Filled})
    assert type(loaded["storage_data"]) is Filled and loaded == {"storage_data": {"k": 1}}


def test_no_pickle_can_name_a_filler():
    """The rewrite names each load's fillers by a new random name; a pickle naming one of ckpt's own is refused."""
    for name in ("filler_0", "StorageFiller", f"filler_{'0' * 32}"):
        data = b"\x80\x02cckpt_cli.own\n" + name.encode() + b"\n)R."
        with pytest.raises(UnsafePickleError):
            safe_loads(data, "x", fillers={"storage_data": Filled})


def test_pickler_without_memo_still_shares_globals_and_named_strings():
    """ckpt's pickler for `.metadata` (shared=False): objects are not memoized, but the globals and the strings it is
    given are written once and fetched; the value reads back the same through torch's own unpickler."""
    import torch  # noqa: F401 - torch.Size for pickle.loads

    from ckpt_cli.core.pickles import pickler
    from ckpt_cli.core.pickles.safe_pickle import TorchSize

    names = [f"layers.{i}.weight" for i in range(300)]
    path = "__0_0.distcp"
    value = {n: [(path, TorchSize((i, 0)), TorchSize((1, 4))) for i in range(3)] for n in names}
    plain = pickler.dumps(value, expected=[pickler.Global("torch", "Size")], shared=False)
    named = pickler.dumps(value, expected=[pickler.Global("torch", "Size")], shared=False, strings=[*names, path])
    expected = {n: [(path, torch.Size((i, 0)), torch.Size((1, 4))) for i in range(3)] for n in names}
    assert pickle.loads(plain) == pickle.loads(named) == expected
    assert named.count(path.encode()) == 1 and plain.count(path.encode()) == 900
    assert named.count(b"layers.7.weight") == 1 and len(named) < len(plain)
    stores = sum(op.name in {"BINPUT", "LONG_BINPUT"} for op, _, _ in pickle_guard.pickletools.genops(named))
    assert stores == 1 + 301  # torch.Size, then the strings; nothing else is memoized


@pytest.mark.parametrize("count", [0, 1, 2, 999, 1000, 1001, 2000, 2001, 3999])
def test_spliced_dict_is_the_bytes_of_the_whole_dict(count: int):
    """A dict written a batch at a time where its marker stands (a `.metadata`'s storage_data) is byte for byte the
    dict the C pickler writes whole, at every batch edge (one item, a full last batch, one item past a full batch),
    with its keys and values fetched from the same memo."""
    import torch  # noqa: F401 - torch.Size for pickle.loads

    from ckpt_cli.core.pickles import pickler
    from ckpt_cli.core.pickles.safe_pickle import TorchSize

    names = [f"layers.{i}.weight" for i in range(count)]
    items = [(n, (TorchSize((i, 0)), i * 7)) for i, n in enumerate(names)]
    others = [(n, i) for i, n in enumerate(reversed(names))]  # a second dict, spliced too (a `.metadata` has two)
    size = pickler.Global("torch", "Size")
    value = {"before": 1, "data": dict(items), "mid": "x", "more": dict(others), "after": [2]}
    whole = pickler.dumps(value, expected=[size], shared=False, strings=names)

    def batches_of(pairs):
        def batches():
            for start in range(0, len(pairs), pickler.BATCH):
                yield pairs[start : start + pickler.BATCH]

        return batches

    spliced = [pickler.SplicedDict("\0marker\0", count, batches_of(items)), pickler.SplicedDict("\0second\0", count, batches_of(others))]
    value = {"before": 1, "data": spliced[0].marker, "mid": "x", "more": spliced[1].marker, "after": [2]}
    parts = pickler.dump_parts(value, expected=[size], shared=False, strings=names, spliced=spliced[::-1])  # found by position
    assert b"".join(parts) == whole
    assert pickle.loads(whole)["data"] == {n: (torch.Size((i, 0)), i * 7) for i, n in enumerate(names)}


def _bad_offset(meta) -> None:
    meta.storage_data[next(k for k in meta.storage_data if k.fqn == "model.head.bias")].offset = -64


def _bad_path(meta) -> None:
    meta.storage_data[next(k for k in meta.storage_data if k.fqn == "model.head.bias")].relative_path = "../x.distcp"


def _bad_key(meta) -> None:
    key = next(k for k in meta.storage_data if k.fqn == "model.head.bias")
    meta.storage_data[("model.head.bias", (0,))] = meta.storage_data.pop(key)


def _bad_offsets(meta) -> None:
    key = next(k for k in meta.storage_data if k.fqn == "model.head.bias")
    object.__setattr__(key, "offset", [[0]])  # unhashable once made a tuple


@pytest.mark.parametrize(
    "change,needle",
    [
        (None, None),
        (_bad_offset, "offset -64"),
        (_bad_path, "relative_path"),
        (_bad_key, "entry of an unknown kind"),
        (_bad_offsets, "chunk offsets that are not numbers"),
    ],
)
def test_storage_data_is_the_same_filled_or_as_a_dict(fsdp2_saves, tmp_path, monkeypatch, change, needle):
    """Where the C rewrite is not built, storage_data is a dict put through the same checks afterwards: the same
    entries, the same one-line errors."""
    import torch  # noqa: F401 - torch's own classes, to change a real `.metadata` as torch would write it

    path = tmp_path / ".metadata"
    meta = pickle.loads((fsdp2_saves[2] / "ckpt" / ".metadata").read_bytes())
    if change:
        change(meta)
    path.write_bytes(pickle.dumps(meta))

    def outcome():
        try:
            loaded = load_metadata(path, False)
            kind = type(loaded.storage_data)
            entries = [(k, (v.relative_path, v.offset, v.length)) for k, v in storage_index(path, loaded).items()]
            return kind, shape_of(loaded.state_dict_metadata), entries
        except DataError as exc:
            return "error", str(exc)

    filled = outcome()
    monkeypatch.setattr(pickle_guard, "_pickle_memo", None)
    as_dict = outcome()
    if needle is None:
        assert filled[0] is StorageFiller and as_dict[0] is dict
        assert filled[1:] == as_dict[1:] and len(filled[2]) > 10
    else:
        assert filled == as_dict and filled[0] == "error" and needle in filled[1] and str(path) in filled[1]


def _in_place(data: bytes, headroom: int, replacements: dict[bytes, bytes] | None = None) -> tuple[bytes | None, bytes]:
    """lean_in_place over `data` after `headroom` bytes of room: (the rewrite or None, the buffer's pickle part)."""
    buffer = bytearray(b"\xee" * headroom + data)
    written = pickle_guard.lean_in_place(buffer, headroom, replacements)
    return (None if written is None else bytes(buffer[:written])), bytes(buffer[headroom:])


@pytest.mark.parametrize("protocol", range(1, pickle.HIGHEST_PROTOCOL + 1))
def test_the_rewrite_in_place_is_the_rewrite(protocol):
    """Written over the pickle's own bytes (from the buffer's start, reading ahead of the writes), the rewrite is the
    one `lean` makes, replacements included; without room for what they add, the buffer is left as it was."""
    rng = random.Random(protocol)
    replacements = {b"storage_data": b"cbuiltins\ndict\n)R"}  # 17 bytes for the dict's 1
    for _ in range(150):
        shared = random_value(rng)
        value = {"storage_data": {"a": shared}, "b": [random_value(rng), shared, "storage_data", {}], "c": shared}
        data = pickle.dumps(value, protocol=protocol)
        for chosen in (None, replacements):
            expected = pickle_guard._pickle_memo.lean(data, pickle_guard._KIND_BYTES, pickle_guard._N_BYTES, *([chosen] if chosen else []))
            got, left = _in_place(data, 64, chosen)
            if expected is None:  # nothing dropped, nothing replaced: untouched
                assert got is None and left == data
            else:
                assert got == expected and pickle.loads(got) == value
        got, left = _in_place(data, 0, replacements)  # no room for the replacement: untouched
        assert got is None and left == data


def test_the_rewrite_in_place_leaves_damaged_pickles_as_they_were():
    rng = random.Random(11)
    base = pickle.dumps([[i, str(i)] for i in range(300)] * 2, protocol=4)
    for _ in range(2000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data[: rng.randint(1, len(data))])
        try:
            pickle_guard.scan(data)
        except pickle.UnpicklingError:
            continue
        expected = pickle_guard._pickle_memo.lean(data, pickle_guard._KIND_BYTES, pickle_guard._N_BYTES)
        got, left = _in_place(data, 16)
        assert got == expected and (got is not None or left == data)


def test_a_large_metadata_file_is_loaded_from_its_own_copy(fsdp2_saves, monkeypatch):
    """Past LEAN_FROM, `.metadata` is read into ckpt's own memory once, scanned and rewritten there (pickle_stream.OwnCopy):
    the same records as from its bytes, and a file that changes size while it is read is refused."""
    from ckpt_cli.core.pickles import pickle_stream

    path = fsdp2_saves[2] / "ckpt" / ".metadata"

    def loaded():
        meta = load_metadata(path, False)
        return shape_of(meta.state_dict_metadata), sorted(storage_index(path, meta).spans())

    as_bytes = loaded()
    made = []
    in_place = pickle_guard.lean_in_place
    monkeypatch.setattr(pickle_guard, "LEAN_FROM", 0)
    monkeypatch.setattr(pickle_guard, "lean_in_place", lambda buffer, *a: made.append(type(buffer)) or in_place(buffer, *a))
    assert loaded() == as_bytes and made == [mmap.mmap]

    class Changing:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def read(self, n: int) -> bytes:
            out, self.data = self.data[:n], self.data[n:]
            return out

    data = path.read_bytes()
    with pytest.raises(DataError, match="shrank"):
        pickle_stream.OwnCopy(Changing(data[:-5]), len(data), "x")
    with pytest.raises(DataError, match="grew"):
        pickle_stream.OwnCopy(Changing(data + b"x"), len(data), "x")
