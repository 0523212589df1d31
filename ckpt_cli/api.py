"""The Python API: what the `ckpt` commands do, as functions for notebooks and training scripts.

    import ckpt_cli

    with ckpt_cli.open("demo/dcp") as ckpt:          # metadata only: no tensor data is read
        ckpt.format, ckpt.step, ckpt.world_size       # 'dcp', 3, 1
        ckpt.tensors["model.embed.weight"]            # TensorInfo(dtype='float32', shape=(96, 32), role='model', ...)
        w = ckpt.tensor("model.embed.weight")         # a torch.Tensor, streamed from its pieces
        a = ckpt.numpy("model.norm.weight")           # a numpy array (no torch needed when no cast is)
        print(ckpt.tree())                            # what `ckpt inspect --tree` prints
    report = ckpt_cli.verify("demo/hf", deep=True)     # the Report `ckpt verify` prints; report.ok
    ckpt_cli.convert("demo/dcp", "out/hf", to="hf", weights_only=True)  # a WriteReport

Errors are `ckpt_cli.errors` exceptions, all `CkptError`s: `UsageError` when the call is wrong (no such
path, an unknown format, dtype or tensor name, an option the target does not take, a destination that
exists without `overwrite=True`); `DataError` when the checkpoint is corrupt, truncated or inconsistent;
`UnsafePickleError` (a `DataError`) when a pickle names a global outside the allow list and `trust_pickle`
is not set (nothing was executed). A KeyboardInterrupt during a write propagates unchanged, once the staged
output is removed. The CLI is a thin layer over these functions; this module never imports `ckpt_cli.cli`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import Field, dataclass
from dataclasses import fields as dataclass_fields
from inspect import Parameter, signature
from pathlib import Path
from types import TracebackType
from typing import Any

from ckpt_cli import _API
from ckpt_cli.core import model as core_model
from ckpt_cli.core import roles
from ckpt_cli.core.dtypes import by_name
from ckpt_cli.core.model import FileInfo
from ckpt_cli.core.reading import SourceFiles
from ckpt_cli.errors import UsageError
from ckpt_cli.ops import inspect as inspect_op
from ckpt_cli.ops import tensor_read, tree_view
from ckpt_cli.ops.diff import DiffOptions, DiffReport
from ckpt_cli.ops.diff import diff as diff_op
from ckpt_cli.ops.parity import ParityReport
from ckpt_cli.ops.request import Request
from ckpt_cli.ops.resolve import resolve
from ckpt_cli.ops.source import open_checkpoint
from ckpt_cli.ops.tree_view import Tree
from ckpt_cli.ops.verify import Report, VerifyOptions
from ckpt_cli.ops.verify import verify as verify_op
from ckpt_cli.ops.writes import PreparedWrite, Progress, WriteReport, prepare, request_of, run  # noqa: F401 - PreparedWrite: in __all__
from ckpt_cli.options import API_SKIPS, COMMANDS, fields

__all__ = list(_API)  # the names ckpt_cli itself serves (on first use), listed once there


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's metadata: dtype name (torch's: 'float32', 'bfloat16'), global shape, role ('model',
    'optimizer' or 'other') and how many stored pieces (shards, partitions) hold it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str
    pieces: int
    numel: int
    nbytes: int


class Checkpoint:
    """An opened checkpoint (from `ckpt_cli.open`): its metadata, and its tensors read on request.

    Use it as a context manager, or call `close()`, to close the files that reads opened."""

    def __init__(self, ckpt: core_model.Checkpoint) -> None:
        self._ckpt = ckpt
        self._sources = SourceFiles()
        self._tensors = {
            t.name: TensorInfo(t.name, t.dtype.name, t.shape, t.role, len(t.pieces), t.numel, t.nbytes) for t in ckpt.tensors.values()
        }

    # Metadata --------------------------------------------------------------------------------------------

    @property
    def raw(self) -> core_model.Checkpoint:
        """The reader's own model of the checkpoint (ckpt_cli.core.model.Checkpoint): pieces, files, objects."""
        return self._ckpt

    @property
    def path(self) -> str:
        return self._ckpt.path

    @property
    def format(self) -> str:
        """'deepspeed', 'dcp', 'hf', 'safetensors' or 'torch' (a run folder: the format of its parts)."""
        return self._ckpt.format

    @property
    def tag(self) -> str | None:
        return self._ckpt.tag

    @property
    def step(self) -> int | None:
        return self._ckpt.step

    @property
    def world_size(self) -> int | None:
        return self._ckpt.world_size

    @property
    def files(self) -> list[FileInfo]:
        return list(self._ckpt.files)

    @property
    def notes(self) -> list[str]:
        """What opening chose (a run's newest checkpoint, a tag), as `inspect` prints it."""
        return list(self._ckpt.notes)

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor, by name, in the checkpoint's order."""
        return dict(self._tensors)

    @property
    def objects(self) -> dict[str, Any]:
        """The non-tensor values (step, scheduler, RNG, client state), parsed through the allow list; a value it
        refused is an `Opaque` naming the global."""
        return {o.name: o.value for o in self._ckpt.objects.values()}

    @property
    def training_state(self) -> dict[str, Any]:
        """Optimizer, lr scheduler, RNG, dataloader and client state, summarised as `inspect` shows them."""
        return roles.describe_training_state(self._ckpt)

    def summary(self, filter: str | Sequence[str] = ()) -> dict[str, Any]:
        """The `ckpt inspect --json` document (tensors matching the globs `filter`, or all)."""
        return inspect_op.summary(self._ckpt, _globs(filter))

    def tree(self, depth: int | None = None, filter: str | Sequence[str] = (), expand: Sequence[str] | None = None) -> Tree:
        """The module tree `ckpt inspect --tree` prints (`str(tree)`, `tree.markdown()`, `tree.to_json()`)."""
        return tree_view.build(self._ckpt, _globs(filter), depth, tuple(expand) if expand is not None else None)

    # Data ------------------------------------------------------------------------------------------------

    def entry(self, name: str) -> core_model.TensorEntry:
        """The reader's entry for tensor `name` (its pieces); UsageError naming close names if there is none."""
        entry = self._ckpt.tensors.get(name)
        if entry is None:
            close = difflib.get_close_matches(name, list(self._ckpt.tensors), n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise UsageError(f"{self.path}: no tensor named '{name}'{hint}")
        return entry

    def tensor(self, name: str, dtype: str | None = None) -> Any:
        """Tensor `name` as a torch.Tensor of its global shape, read piece by piece straight into it (cast to
        `dtype`, e.g. 'float32', if given). DataError when its bytes are missing or truncated."""
        return tensor_read.read_torch(self.entry(name), self._sources, by_name(dtype) if dtype else None)

    def numpy(self, name: str, dtype: str | None = None) -> Any:
        """Tensor `name` as a numpy.ndarray; without a cast and with contiguous pieces, torch is not imported.
        numpy has no bfloat16 or float8: those raise UsageError unless `dtype` casts them."""
        return tensor_read.read_numpy(self.entry(name), self._sources, by_name(dtype) if dtype else None)

    def __getitem__(self, name: str) -> Any:
        return self.tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    # Lifetime --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the files tensor reads opened (reading again reopens them)."""
        self._sources.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        step = f", step={self.step}" if self.step is not None else ""
        world = f", world_size={self.world_size}" if self.world_size else ""
        return f"<ckpt_cli.Checkpoint {self.format} {self.path!r}: {len(self)} tensors{step}{world}>"


def open(path: str | Path, *, format: str | None = None, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    """Open a checkpoint of any supported format, or a run folder (its newest complete checkpoint, or `tag`),
    reading metadata only. `format` skips detection; `trust_pickle` lets pickles name globals outside the
    allow list (this runs code from the file). UsageError when nothing readable is there."""
    return Checkpoint(open_checkpoint(path, format, tag, trust_pickle))


def inspect(
    path: str | Path, *, filter: str | Sequence[str] = (), format: str | None = None, tag: str | None = None, trust_pickle: bool = False
) -> dict[str, Any]:
    """The `ckpt inspect --json` document; for a run root, `tags` lists every checkpoint under it."""
    resolved = resolve(path, format, tag)  # once: the run root's members and the checkpoint read come from it
    runs = inspect_op.run_root(resolved) if tag is None and format is None else None
    doc = inspect_op.summary(open_checkpoint(resolved, trust_pickle=trust_pickle, layout_only=True), _globs(filter))
    if runs:
        doc["tags"] = runs
    return doc


def verify(path: str | Path, **options: Any) -> Report:
    """Check a checkpoint as `ckpt verify` does and return its Report: `ok`, `problems` (one line each, naming
    the file), `checks`, `stats`, `nonfinite`, `to_json()`. A damaged checkpoint is a report with problems, not
    an exception; a wrong call (a missing `against`, an unreadable policy) raises UsageError. The options are
    verify's flags with `_` for `-`, as its signature lists them (ops/verify.py's VerifyOptions)."""
    return verify_op(path, VerifyOptions(**options))


def diff(a: str | Path, b: str | Path, **options: Any) -> DiffReport:
    """Compare two checkpoints as `ckpt diff` does (across formats and key layouts, streamed) and return its
    DiffReport: `equal` within atol/rtol, the tensors only in A or B, renamed, reshaped or recast, per-group and
    per-tensor max |a-b|, relative L2 and cosine, training-state differences, `to_json()`. The options are diff's
    flags with `_` for `-`, as its signature lists them (ops/diff.py's DiffOptions; `filter`: one glob or several)."""
    return diff_op(a, b, DiffOptions(**options))


def parity(
    release: str | Path,
    *,
    against: str | Path | None = None,
    logits: str | Path | None = None,
    tokens: Sequence[int] | None = None,
    atol: float = 1e-5,
) -> ParityReport:
    """Run a Hugging Face release with transformers (CPU, float32) on fixed token ids and compare its logits with
    `against` (another Hugging Face folder) or `logits` (a torch.save of logits, with their token ids), as
    `ckpt parity` does: max and mean |diff|, KL, top-token agreement, `ok` within `atol`, `to_json()`."""
    from ckpt_cli.ops.parity import parity as parity_op  # (torch and transformers: imported when it runs)

    return parity_op(Path(release), _path(against), _path(logits), list(tokens) if tokens is not None else None, atol)


def _path(value: str | Path | None) -> Path | None:
    return Path(value) if value is not None else None


def _globs(value: str | Sequence[str]) -> tuple[str, ...]:
    """`filter=`: one glob or several, as the writing commands take it."""
    return (value,) if isinstance(value, str) else tuple(value)


def write(
    request: Request, *, overwrite: bool = False, dry_run: bool = False, workers: int | None = None, progress: Progress | None = None
) -> WriteReport:
    """Carry out a writing command's Request (built by convert_request, reshard_request, merge_request or split_request,
    as the CLI builds it): open and check the source, plan, and write (`dry_run=True`: plan only)."""
    prepared = prepare(request)
    if dry_run:
        return prepared.dry_run(overwrite)
    return prepared.write(overwrite, progress, workers)


# The writing commands. Their keyword options are the CLI's, named as its flags with `_` for `-` (`filter`,
# `max_shard_size`: bytes or "5GB", `all`, `write_manifest`, ...), declared once in ckpt_cli/options.py; each
# function's signature lists them (help(ckpt_cli.convert)). A name the command does not take is a UsageError.


def convert(src: str | Path, dest: str | Path, *, to: str, progress: Progress | None = None, **options: Any) -> WriteReport:
    """`ckpt convert`: write `src` as format `to` ('hf', 'safetensors', 'torch', 'dcp', 'deepspeed') at `dest`,
    streamed, and return what was written (`dry_run=True`: what would be, writing nothing). Between DeepSpeed and
    dcp the whole training state moves (`world_size` needed; `tp`: a dcp target on a (world_size / tp) x tp mesh).
    A quantized source (FP8 block-scaled, MXFP4) is dequantized by `dtype='bf16'` (or fp32, fp16); `quantize='fp8'`
    writes FP8 block-scaled weights. `preset`: a built-in name map (torchtitan-llama3, megatron-gpt, ...); `hf_config`:
    the folder whose config.json and tokenizer an hf release carries."""
    return run("convert", src, dest, to, options, progress)


def reshard(src: str | Path, dest: str | Path, *, progress: Progress | None = None, **options: Any) -> WriteReport:
    """`ckpt reshard`: the same format in a new layout, `world_size` (dcp, deepspeed, dtensor; dcp with `tp`: FSDP2 +
    tensor parallel on a (world_size / tp) x tp mesh) or `num_shards` / `max_shard_size` (hf: bytes, or '5GB').
    DeepSpeed MoE: `ep_size`, new expert-parallel sizes, 4 or {"": 2, "moe": 4} (module "": every other MoE layer);
    by default each is kept where it divides `world_size`, else the largest size that does."""
    return run("reshard", src, dest, None, options, progress)


def merge(src: str | Path, dest: str | Path, *, progress: Progress | None = None, **options: Any) -> WriteReport:
    """`ckpt merge`: every shard into one `dest` .safetensors or .pt; model weights, or everything with `all=True`
    (.pt only)."""
    return run("merge", src, dest, None, options, progress)


def split(src: str | Path, dest: str | Path, *, progress: Progress | None = None, **options: Any) -> WriteReport:
    """`ckpt split`: the model weights into a Hugging Face folder of shards (default at most 5GB each) and its index."""
    return run("split", src, dest, None, options, progress)


def convert_request(src: str | Path, dest: str | Path, *, to: str, **options: Any) -> Request:
    """The Request `convert` runs (options as convert's; `ckpt_cli.write(request)` carries it out)."""
    return request_of("convert", src, dest, to, options)


def reshard_request(src: str | Path, dest: str | Path, **options: Any) -> Request:
    """The Request `reshard` runs."""
    return request_of("reshard", src, dest, None, options)


def merge_request(src: str | Path, dest: str | Path, **options: Any) -> Request:
    """The Request `merge` runs."""
    return request_of("merge", src, dest, None, options)


def split_request(src: str | Path, dest: str | Path, **options: Any) -> Request:
    """The Request `split` runs."""
    return request_of("split", src, dest, None, options)


def _with_options(function: Callable[..., Any], declared: Iterable[Field[Any]]) -> None:
    """Show a function's keyword options in its signature (help(), IDEs' call tips), from their declarations."""
    own = [p for p in signature(function).parameters.values() if p.kind is not Parameter.VAR_KEYWORD]
    options = [Parameter(f.name, Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type) for f in declared]
    function.__signature__ = signature(function).replace(parameters=own + options)  # type: ignore[attr-defined]  # inspect's hook, not in typeshed


for _command in COMMANDS:
    _taken = [(group, f) for group, f in fields(_command) if f.name not in API_SKIPS]
    _with_options(globals()[_command], [f for _, f in _taken])
    _with_options(globals()[f"{_command}_request"], [f for group, f in _taken if group.__name__ != "RunOptions"])
_with_options(verify, dataclass_fields(VerifyOptions))
_with_options(diff, dataclass_fields(DiffOptions))
