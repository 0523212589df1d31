"""`verify`: integrity of one checkpoint, as a structured report the CLI renders.

Structure (always): files present with their recorded sizes, every tensor's pieces tile it, every
piece's bytes inside its file, plus the format's own checks. `deep`: every byte read (zip CRCs,
checksums); `finite`: NaN/Inf counts; manifests; `against`: tensor-by-tensor comparison.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpt_cli.core import atomic, remote_write, storage
from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.paths import open_regular, read_regular_text
from ckpt_cli.core.reading import SourceFiles, byte_runs, element_windows, read_elements, tensor_bytes
from ckpt_cli.core.storage import location
from ckpt_cli.errors import DataError, UnsafePickleError, UsageError
from ckpt_cli.ops import crossframework
from ckpt_cli.ops import policy as policy_mod
from ckpt_cli.ops.source import open_checkpoint
from ckpt_cli.ops.structure import file_and_tiling_problems, format_check, has_checksums
from ckpt_cli.ops.values import compare_values

MANIFEST_VERSION = 1


@dataclass
class VerifyOptions:
    format: str | None = None
    tag: str | None = None
    trust_pickle: bool = False
    deep: bool = False
    finite: bool = False
    write_manifest: Path | None = None
    overwrite: bool = False  # --write-manifest may replace a previous manifest (never any other file)
    manifest: Path | None = None
    against: Path | None = None
    atol: float = 0.0
    rtol: float = 0.0
    policy: Path | None = None


@dataclass
class Report:
    path: str
    format: str | None = None
    checks: list[str] = field(default_factory=list)  # what was checked
    problems: list[str] = field(default_factory=list)  # one line each, naming the file
    nonfinite: dict[str, dict[str, int]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    refused_pickle: str | None = None  # a pickled global outside the allow list stopped the read

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "checks": self.checks,
            "problems": self.problems,
            "nonfinite": self.nonfinite,
            "stats": self.stats,
        }


def _root(ckpt: Checkpoint) -> Path:
    p = location(ckpt.path)
    return p if p.is_dir() else p.parent


def file_sha256(path: str, block: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def tensor_sha256(t: TensorEntry, sources: SourceFiles) -> str:
    """SHA-256 of the tensor's logical little-endian bytes: the same in every format and layout."""
    digest = hashlib.sha256()
    for block in tensor_bytes(t, sources):
        digest.update(block)
    return digest.hexdigest()


def count_nonfinite(t: TensorEntry, sources: SourceFiles) -> tuple[int, int]:
    import torch

    nan = inf = 0
    for start, count in element_windows(t):
        values = read_elements(t, start, count, sources)
        wide = values if t.dtype.itemsize >= 2 else values.to(torch.float32)
        nan += int(torch.isnan(wide).sum())
        inf += int(torch.isinf(wide).sum())
    return nan, inf


def build_manifest(ckpt: Checkpoint, tensor_hashes: dict[str, str]) -> dict[str, Any]:
    root = _root(ckpt)
    return {
        "ckpt_manifest": MANIFEST_VERSION,
        "format": ckpt.format,
        "files": {os.path.relpath(f.path, root): {"bytes": f.bytes, "sha256": file_sha256(f.path)} for f in ckpt.files},
        "tensors": {
            n: {"dtype": ckpt.tensors[n].dtype.name, "shape": list(ckpt.tensors[n].shape), "sha256": h} for n, h in tensor_hashes.items()
        },
    }


def load_manifest(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(read_regular_text(path, max_bytes=1 << 30))  # a local file or an object (s3://)
    except FileNotFoundError:
        raise UsageError(f"{path}: manifest not found") from None
    except (OSError, DataError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable manifest ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("ckpt_manifest") != MANIFEST_VERSION:
        raise UsageError(f"{path}: not a ckpt manifest (written by verify --write-manifest)")
    return doc


def check_manifest_destination(path: Path, overwrite: bool) -> None:
    """--write-manifest FILE writes a new file; with --overwrite it replaces a previous ckpt manifest, never another
    file (a checkpoint file named by mistake). Checked before the checkpoint is read (exit 2)."""
    if storage.is_remote(path):
        where = storage.location(path)
        remote_write.bucket_and_key(where)  # type: ignore[arg-type]  # refuses what ckpt cannot write to (not s3://, no key)
        if not where.exists():
            return
    elif not os.path.lexists(path):
        return
    if not overwrite:
        raise UsageError(f"{path} already exists; pass --overwrite to replace it")
    try:
        doc = json.loads(read_regular_text(path, max_bytes=1 << 30))
    except (OSError, DataError, json.JSONDecodeError):
        doc = None
    if not isinstance(doc, dict) or doc.get("ckpt_manifest") != MANIFEST_VERSION:
        raise UsageError(f"{path} is not a ckpt manifest; --overwrite replaces only a manifest that verify wrote")


def write_manifest_file(path: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest atomically: a temporary sibling, then one os.replace; in object storage one PUT (an object
    appears whole or not at all)."""
    if storage.is_remote(path):
        data = (json.dumps(manifest, indent=2) + "\n").encode()
        with remote_write.ObjectWriter(storage.location(path), len(data)) as out:  # type: ignore[arg-type]
            out.write(data)
            out.commit()
        return
    with atomic.staged(path, is_dir=False, overwrite=True) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")


def leftover_problems(ckpt: Checkpoint) -> list[str]:
    """Temporary siblings of the checkpoint that an interrupted or killed ckpt write left behind; in object storage,
    multipart uploads under it that were neither completed nor aborted."""
    root = location(ckpt.path)
    if storage.is_remote(root):
        return [
            f"{root.protocol}://{root.parts[1]}/{key}: an upload that never completed (a write killed outright, "
            "or one running now); ckpt's next --overwrite of this prefix aborts it, as a lifecycle rule would"
            for key in remote_write.unfinished_uploads(root)  # type: ignore[arg-type]
        ]
    return [
        f"{p}: temporary output of a ckpt write that did not finish (its process is gone, or a torchrun job); remove it"
        for p in atomic.leftovers(location(ckpt.path))
    ]


def check_manifest(ckpt: Checkpoint, manifest: dict[str, Any], hashes: dict[str, str], report: Report, where: Path) -> None:
    root = _root(ckpt)
    if manifest.get("format") == ckpt.format:
        for rel, want in manifest.get("files", {}).items():
            path = root / rel
            if not path.exists():
                report.problems.append(f"{path}: missing (listed in manifest {where})")
            elif file_sha256(str(path)) != want["sha256"]:
                report.problems.append(f"{path}: checksum differs from manifest {where} (bytes changed)")
    for name, want in manifest.get("tensors", {}).items():
        t = ckpt.tensors.get(name)
        if t is None:
            report.problems.append(f"{ckpt.path}: tensor '{name}' from manifest {where} is missing")
        elif hashes.get(name) != want["sha256"] and (t.dtype.name == want["dtype"]):
            file = t.pieces[0].data.path if t.pieces else ckpt.path
            report.problems.append(f"{file}: tensor '{name}' differs from manifest {where} (data changed)")
        elif t.dtype.name != want["dtype"] or list(t.shape) != want["shape"]:
            report.problems.append(
                f"{ckpt.path}: tensor '{name}' is {t.dtype.name}{list(t.shape)}, manifest says {want['dtype']}{want['shape']}"
            )
    report.checks.append("manifest")


def compare(a: Checkpoint, b: Checkpoint, atol: float, rtol: float, report: Report) -> None:
    """Tensor-by-tensor comparison across formats (names, dtypes, shapes, values)."""
    sources_a, sources_b = SourceFiles(), SourceFiles()
    try:
        for name in a.tensors.keys() - b.tensors.keys():
            report.problems.append(f"{b.path}: tensor '{name}' is missing (present in {a.path})")
        for name in b.tensors.keys() - a.tensors.keys():
            report.problems.append(f"{a.path}: tensor '{name}' is missing (present in {b.path})")
        exact = atol == 0 and rtol == 0
        for name in [n for n in a.tensors if n in b.tensors]:
            x, y = a.tensors[name], b.tensors[name]
            if x.shape != y.shape:
                report.problems.append(f"{b.path}: tensor '{name}' has shape {list(y.shape)}, {a.path} has {list(x.shape)}")
                continue
            if x.dtype != y.dtype and exact:
                report.problems.append(
                    f"{b.path}: tensor '{name}' is {y.dtype}, {a.path} has {x.dtype} (give --atol/--rtol to compare values)"
                )
                continue
            diff = compare_values(x, y, atol, rtol, sources_a, sources_b)
            if not diff.within(atol, rtol):
                how = "values differ" if exact else f"max |diff| {diff.max_abs:.3g} exceeds atol={atol} rtol={rtol}"
                report.problems.append(f"{b.path}: tensor '{name}': {how}")
    finally:
        sources_a.close()
        sources_b.close()
    report.checks.append(f"against {b.path}")


def verify(path: str | Path, options: VerifyOptions) -> Report:
    report = Report(str(path))
    for name in ("write_manifest", "manifest", "policy"):  # an s3:// URL, which Path spells s3:/, names an object
        value = getattr(options, name)
        if value is not None and storage.is_remote(value):
            options = replace(options, **{name: location(value)})
    if options.write_manifest:
        check_manifest_destination(options.write_manifest, options.overwrite)
    try:
        ckpt = open_checkpoint(path, options.format, options.tag, options.trust_pickle)
    except DataError as exc:
        report.problems.append(str(exc))
        report.refused_pickle = exc.global_name if isinstance(exc, UnsafePickleError) else None
        return report
    report.path, report.format = ckpt.path, ckpt.format
    report.stats = {"tensors": len(ckpt.tensors), "files": len(ckpt.files), "bytes": sum(f.bytes for f in ckpt.files)}
    report.problems += file_and_tiling_problems(ckpt)
    report.checks.append("structure")
    report.problems += leftover_problems(ckpt)
    try:
        report.problems += format_check(ckpt, options.deep)
    except DataError as exc:
        report.problems.append(str(exc))
    if options.deep:
        report.checks.append("deep")
    if report.problems:  # reading data of a broken checkpoint would only repeat the problems
        return report
    rules = policy_mod.load(options.policy) if options.policy else None
    finite = options.finite or bool(rules and rules.finite)
    # Tensor checksums serve manifests; --deep alone reads every byte once: the format's CRC check,
    # or (formats without checksums) the tensors themselves.
    want_hash = options.manifest is not None or options.write_manifest is not None
    read_all = options.deep and not has_checksums(ckpt)
    hashes: dict[str, str] = {}
    if want_hash or read_all or finite:
        sources = SourceFiles()
        try:
            if want_hash or read_all:  # in object storage: fetched ahead in large ranges, not one round trip per tensor
                sources.expect([run for t in ckpt.tensors.values() for run in byte_runs(t, t.dtype) or []])
            for t in ckpt.tensors.values():
                if want_hash or read_all:
                    hashes[t.name] = tensor_sha256(t, sources)
                if finite and t.dtype.is_float:
                    nan, inf = count_nonfinite(t, sources)
                    if nan or inf:
                        report.nonfinite[t.name] = {"nan": nan, "inf": inf}
        except DataError as exc:
            report.problems.append(str(exc))
            return report
        finally:
            sources.close()
        report.checks += ["finite"] if finite else []
        if finite:
            for name, counts in report.nonfinite.items():
                report.problems.append(
                    f"{ckpt.tensors[name].pieces[0].data.path}: tensor '{name}' has {counts['nan']} NaN and {counts['inf']} Inf values"
                )
    if options.manifest:
        check_manifest(ckpt, load_manifest(options.manifest), hashes, report, options.manifest)
    if options.against:
        other = open_checkpoint(options.against, None, None, options.trust_pickle)
        atol, rtol = options.atol, options.rtol
        if rules and rules.atol is not None and not atol:
            atol = rules.atol
        if rules and rules.rtol is not None and not rtol:
            rtol = rules.rtol
        mine, theirs, matched = crossframework.comparable(ckpt, other)  # one run in two frameworks: by parameter name
        if matched:
            report.checks.append(matched)
        compare(mine, theirs, atol, rtol, report)
    if rules:
        report.problems += policy_mod.check(ckpt, rules)
        report.checks.append(f"policy {options.policy}")
    if options.write_manifest and report.ok:
        write_manifest_file(options.write_manifest, build_manifest(ckpt, hashes))
        report.checks.append(f"wrote manifest {options.write_manifest}")
    report.stats["dtype_names"] = sorted({t.dtype.name for t in ckpt.tensors.values()})
    return report
