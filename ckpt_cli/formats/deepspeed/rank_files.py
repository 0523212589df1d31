"""A DeepSpeed tag's rank files as read: the stand-ins for the DeepSpeed classes they pickle (loss scaler, fragment
address, ZeRO stage), each file parsed once (`load`) or, where a read does not need its content, checked without
being built (`check`), and the files of many ranks parsed when first asked for (`LazyRanks`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import LazyPieces, StoredArray
from ckpt_cli.core.pickles import pickler, zipio
from ckpt_cli.core.pickles.frozen import Sealed
from ckpt_cli.core.pickles.pickle_guard import charge
from ckpt_cli.core.pickles.pickler import Global, Instance, Reduce
from ckpt_cli.core.pickles.safe_pickle import TensorRef
from ckpt_cli.errors import DataError
from ckpt_cli.formats.deepspeed.partitions import WholePiece
from ckpt_cli.formats.torch_save import Shared, check_archive, open_archive, stored_array


class _Stub(metaclass=Sealed):
    """Stand-in for a pickled DeepSpeed object (loss scaler, fragment address): keeps its state.
    Sealed: a pickle cannot change the class itself; each instance is the pickle's own."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        charge(len(state) if isinstance(state, dict) else 1)
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class LossScaler(_Stub):
    pass


class DynamicLossScaler(_Stub):
    pass


class FragmentAddress(_Stub):
    pass


class ZeroStage(int, metaclass=Sealed):
    """ZeroStageEnum's value; written back as the enum."""

    __slots__ = ()


_STUBS = {
    LossScaler: ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    DynamicLossScaler: ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    FragmentAddress: ("deepspeed.utils.tensor_fragment", "fragment_address"),
}
DS_GLOBALS: dict[tuple[str, str], Any] = {where: cls for cls, where in _STUBS.items()}
DS_GLOBALS[("deepspeed.runtime.zero.config", "ZeroStageEnum")] = ZeroStage


def _as_instance(g: Global) -> Callable[[Any], Instance]:
    """Describe a stub as an instance of `g`, its state less `args`."""
    return lambda obj: Instance(g, {k: v for k, v in obj.__dict__.items() if k != "args"})


# Written back with the same pickle globals, so DeepSpeed reads what ckpt writes (docs/formats.md §2.5).
for _cls, (_module, _name) in _STUBS.items():
    pickler.register(_cls, _as_instance(Global(_module, _name)))
pickler.register(ZeroStage, lambda v: Reduce(Global("deepspeed.runtime.zero.config", "ZeroStageEnum"), (int(v),)))


def fragment_address(numel: int, start: int) -> FragmentAddress:
    address = FragmentAddress.__new__(FragmentAddress)
    address.__dict__.update({"numel": numel, "start": start})
    return address


@dataclass
class RankFile:
    path: Path
    tree: Any
    records: dict[str, zipio.Record]

    def array(self, ref: TensorRef) -> StoredArray:
        return stored_array(ref, self.records, str(self.path))

    def whole(self, ref: TensorRef) -> LazyPieces:
        """The stored tensor as the one piece of a logical tensor of its shape, located when data is read (inspect of
        a model-states file of thousands of tensors locates none)."""
        return LazyPieces(WholePiece(self, ref), 1)


class LazyRanks(Mapping[int, RankFile]):
    """Rank files by rank, each parsed when first asked for. At stage 3 every rank's model states repeat the whole
    module description: inspect and the exports need rank 0's (and the others' only for frozen parameters), verify
    and the writers ask for each."""

    def __init__(self, paths: Mapping[int, Path], load: Callable[[Path], RankFile], loaded: dict[int, RankFile]) -> None:
        self.paths, self._load, self.loaded = dict(paths), load, loaded
        self._last: tuple[int, RankFile] | None = None

    def __getitem__(self, rank: int) -> RankFile:
        if rank not in self.loaded:
            self.loaded[rank] = self._load(self.paths[rank])
        return self.loaded[rank]

    def passing(self) -> Iterator[RankFile]:
        """Every rank's file in turn, each parsed (unless held already) and let go when the caller moves on: a check
        that reads a field of each held all 64 of a wide MoE's (5 MB each parsed) to the end."""
        for rank in self:
            yield self.unkept(rank)

    def unkept(self, rank: int) -> RankFile:
        """The rank's file, parsed now unless held already, and not kept beyond the last one asked for (a writer
        reads each old rank's once, or with 'wrap' the few it cycles through, rank 0's being held)."""
        held = self.loaded.get(rank) or (self._last[1] if self._last and self._last[0] == rank else None)
        if held is None:
            held = self._load(self.paths[rank])
            self._last = (rank, held)
        return held

    def __contains__(self, rank: object) -> bool:  # without parsing the file (Mapping's own would)
        return rank in self.paths

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.paths))

    def __len__(self) -> int:
        return len(self.paths)


def load(path: Path, options: ReadOptions, parsed: Shared | None = None) -> RankFile:
    tree, records = open_archive(path, options, DS_GLOBALS, not_zip=None, parsed=parsed)
    if not isinstance(tree, dict):
        raise DataError(f"{path}: does not hold a DeepSpeed state dict")
    return RankFile(path, tree, records)


def check(path: Path, options: ReadOptions) -> bool:
    """A rank file checked as `load` would refuse it, without building its pickle's value (torch_save.check_archive):
    False where only parsing would tell."""
    return check_archive(path, options, DS_GLOBALS)
