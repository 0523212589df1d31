"""`verify`: integrity of one checkpoint, as a structured report the CLI renders.

Structure (always): files present with their recorded sizes, every tensor's pieces tile it, every
piece's bytes inside its file, plus the format's own checks. `deep`: every byte read (zip CRCs,
checksums); `finite`: NaN/Inf counts; manifests; `against`: tensor-by-tensor comparison.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli import store
from ckpt_cli.core import meter, structured
from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.paths import is_plain, read_regular_text
from ckpt_cli.core.reading import SourceFiles, byte_runs, element_windows, read_elements, tensor_bytes
from ckpt_cli.errors import DataError, Fix, UnsafePickleError, UsageError
from ckpt_cli.ops import diff as diff_mod
from ckpt_cli.ops import policy as policy_mod
from ckpt_cli.ops import quantized
from ckpt_cli.ops.digests import Digests, file_digest, file_pass, hasher
from ckpt_cli.ops.finite import NonFinite
from ckpt_cli.ops.source import choice_notes, open_checkpoint
from ckpt_cli.ops.structure import file_and_tiling_problems, format_check, format_notes, has_checksums
from ckpt_cli.options import VerifyOptions
from ckpt_cli.store import location

MANIFEST_VERSION = 2  # 1: sha256 digests; 2: the digest named by "hash" (blake3 when ckpt writes it)
MANIFEST_VERSIONS = (1, 2)  # what --manifest checks and --overwrite may replace
MANIFEST_HASH = "blake3"  # measured, one core (AVX-512): blake3 4.5 GB/s (8.5 on 2), sha256 1.8, xxh3 18 (not cryptographic)


@dataclass
class Report:
    path: str
    format: str | None = None
    checks: list[str] = field(default_factory=list)  # what was checked
    problems: list[str] = field(default_factory=list)  # one line each, naming the file
    nonfinite: dict[str, dict[str, int]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    refused_pickle: str | None = None  # a pickled global outside the allow list stopped the read
    notes: list[str] = field(default_factory=list)  # what the checks could not see, for the user

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in ("path", "format", "ok", "checks", "problems", "nonfinite", "stats", "notes")}


def _root(ckpt: Checkpoint) -> Path:
    p = location(ckpt.path)
    return p if p.is_dir() else p.parent


def scan_tensor(t: TensorEntry, sources: SourceFiles, digests: dict[str, Digests], finite: bool) -> tuple[int, int]:
    """One read of the tensor's bytes for every digest still wanted and, with `finite`, its NaN and Inf counts
    from the bits (float8 through torch: not every float8 follows the IEEE rule)."""
    counter = NonFinite(t.dtype.name) if finite and NonFinite.handles(t.dtype.name) else None
    if digests or counter is not None:
        hashers = {algo: hasher(algo) for algo in digests}
        for block in tensor_bytes(t, sources):
            for h in hashers.values():
                h.update(block)
            if counter is not None:
                counter.update(block)
            meter.advance(len(block))
        for algo, h in hashers.items():
            digests[algo].tensors[t.name] = h.hexdigest()
    if counter is not None:
        return counter.nan, counter.inf
    if not (finite and t.dtype.is_float):
        return 0, 0
    counts = count_nonfinite(t, sources)
    meter.advance(0 if digests else t.nbytes)  # read for digests above: counted there
    return counts


def count_nonfinite(t: TensorEntry, sources: SourceFiles) -> tuple[int, int]:
    import torch

    nan = inf = 0
    for start, count in element_windows(t):
        values = read_elements(t, start, count, sources)
        wide = values if t.dtype.itemsize >= 2 else values.to(torch.float32)
        nan += int(torch.isnan(wide).sum())
        inf += int(torch.isinf(wide).sum())
    return nan, inf


def build_manifest(ckpt: Checkpoint, tensor_hashes: dict[str, str], file_hashes: dict[str, str]) -> dict[str, Any]:
    root, algo = _root(ckpt), MANIFEST_HASH

    def of_file(path: str) -> str:
        return file_hashes.get(path) or file_digest(path, algo)

    return {
        "ckpt_manifest": MANIFEST_VERSION,
        "hash": algo,
        "format": ckpt.format,
        "files": {os.path.relpath(f.path, root): {"bytes": f.bytes, algo: of_file(f.path)} for f in ckpt.files},
        "tensors": {n: {"dtype": t.dtype.name, "shape": list(t.shape), algo: tensor_hashes[n]} for n, t in ckpt.tensors.items()},
    }


def _relative_file(value: Any) -> str | None:
    parts = value.split("/") if isinstance(value, str) else []
    if not parts or value.startswith("/") or any(p in ("", ".", "..") or not is_plain(p) for p in parts):
        return "names a file outside the checkpoint folder"
    return None


def manifest_schema(algo: str) -> dict[str, Any]:
    return {
        "ckpt_manifest": int,
        "hash": structured.Optional(str),
        "format": str,
        "files": {str: {"bytes": structured.non_negative, algo: str}},
        "tensors": {str: {"dtype": str, "shape": [structured.non_negative], algo: str}},
    }


def manifest_hash(doc: dict[str, Any]) -> str:
    return doc.get("hash", "sha256") if doc.get("ckpt_manifest") == 2 else "sha256"


def load_manifest(path: Path) -> dict[str, Any]:
    try:
        text = read_regular_text(path, max_bytes=1 << 30)  # a local file or an object (s3://)
    except FileNotFoundError:
        raise UsageError(f"{path}: manifest not found") from None
    except (OSError, DataError) as exc:
        raise UsageError(f"{path}: not a readable manifest ({exc})") from exc
    doc = structured.load_json(text, str(path), UsageError)
    if not isinstance(doc, dict) or doc.get("ckpt_manifest") not in MANIFEST_VERSIONS:
        raise UsageError(f"{path}: not a ckpt manifest (written by verify --write-manifest)")
    if manifest_hash(doc) not in ("sha256", "blake3"):
        raise UsageError(f"{path}: hash {str(doc['hash'])[:40]!r}; ckpt checks sha256 and blake3 manifests")
    structured.check(doc, manifest_schema(manifest_hash(doc)), str(path), UsageError)
    for rel in doc.get("files") or {}:
        problem = _relative_file(rel)
        if problem:
            raise UsageError(f"{path}: files.{rel[:60]!r} {problem}")
    return doc


def check_manifest_destination(path: Path, overwrite: bool) -> None:
    """--write-manifest FILE writes a new file; with --overwrite it replaces a previous ckpt manifest, never another
    file (a checkpoint file named by mistake). Checked before the checkpoint is read (exit 2)."""
    store.check_writable(path)  # refuses what ckpt cannot write to (a protocol it only reads, no key under the bucket)
    if not store.lexists(path):
        return
    if not overwrite:
        raise UsageError(f"{path} already exists", Fix("overwrite", True, "to replace it"))
    try:
        doc = structured.load_json(read_regular_text(path, max_bytes=1 << 30), str(path), DataError)
    except (OSError, DataError):
        doc = None
    if not isinstance(doc, dict) or doc.get("ckpt_manifest") not in MANIFEST_VERSIONS:
        raise UsageError(f"{path} is not a ckpt manifest; --overwrite replaces only a manifest that verify wrote")


def check_manifest(ckpt: Checkpoint, manifest: dict[str, Any], digests: Digests, report: Report, where: Path, tensors: bool = True) -> None:
    """Each file's checksum against the manifest's and, with `tensors`, each tensor's (read in the scan before)."""
    root, algo, hashes = _root(ckpt), manifest_hash(manifest), digests.tensors
    if manifest.get("format") == ckpt.format:
        for rel, want in manifest.get("files", {}).items():
            path = root / rel
            if not path.exists():
                report.problems.append(f"{path}: missing (listed in manifest {where})")
            elif not path.is_file() or (digests.files.get(str(path)) or file_digest(str(path), algo)) != want[algo]:
                report.problems.append(f"{path}: checksum differs from manifest {where} (bytes changed)")
    for name, want in manifest.get("tensors", {}).items() if tensors else ():
        t = ckpt.tensors.get(name)
        if t is None:
            report.problems.append(f"{ckpt.path}: tensor '{name}' from manifest {where} is missing")
        elif hashes.get(name) != want[algo] and (t.dtype.name == want["dtype"]):
            file = t.pieces[0].data.path if t.pieces else ckpt.path
            report.problems.append(f"{file}: tensor '{name}' differs from manifest {where} (data changed)")
        elif t.dtype.name != want["dtype"] or list(t.shape) != want["shape"]:
            report.problems.append(
                f"{ckpt.path}: tensor '{name}' is {t.dtype.name}{list(t.shape)}, manifest says {want['dtype']}{want['shape']}"
            )
    report.checks.append("manifest")


def compare(a: Checkpoint, b: Checkpoint, atol: float, rtol: float, report: Report) -> None:
    """Tensor by tensor across formats and key layouts, paired as `diff` pairs them (diff.pair: by parameter name when
    the layouts differ, tied weights stored once). A problem: a value outside the tolerance, a shape, a dtype without
    a tolerance, a weight on one side only (or renamed), state one side holds that the other holds too but not all of,
    a training-state value both sides hold that differs. What one side cannot hold (a weights export against a training
    checkpoint's optimizer state, its step) is a note, as diff states it."""
    d, mine, theirs = diff_mod.pair(a, b, diff_mod.DiffOptions(atol=atol, rtol=rtol))
    pa, pb = a.path, b.path
    if d.matched_by != "name":
        report.checks.append(f"by {d.matched_by}")
    exact = d.exact
    dtype_of = {c["name"]: c for c in d.dtype_changed}
    order = {name: i for i, name in enumerate(mine.tensors)}  # the checkpoint's own order (diff's is worst first)
    for t in sorted(d.tensors, key=lambda t: order[t.name]):
        if exact and t.name in dtype_of:
            report.problems.append(f"{pb}: tensor '{t.name}' is {t.dtype_b}, {pa} has {t.dtype_a} (give --atol/--rtol to compare values)")
        elif not t.within:
            how = "values differ" if exact else f"max |diff| {t.values.max_abs:.3g} exceeds atol={atol} rtol={rtol}"
            report.problems.append(f"{pb}: tensor '{t.name}': {how}")
    for c in d.shape_changed:
        report.problems.append(f"{pb}: tensor '{c['name']}' has shape {c['b']}, {pa} has {c['a']}")
    moved = {x: y for x, y in d.renamed}
    for x, y in d.renamed:
        if mine.tensors[x].role == "model" or theirs.tensors[y].role == "model":
            report.problems.append(f"{pb}: tensor '{x}' is missing; the same bytes are under '{y}' (renamed)")
    for only, side, other, here, there in ((d.only_in_a, mine, theirs, pa, pb), (d.only_in_b, theirs, mine, pb, pa)):
        held = {t.role for t in other.tensors.values()}
        for name in only:
            if side.tensors[name].role == "model" or side.tensors[name].role in held:
                report.problems.append(f"{there}: tensor '{name}' is missing (present in {here})")
        unheld = [n for n in only if side.tensors[n].role not in held and side.tensors[n].role != "model"]
        if unheld:
            roles = sorted({side.tensors[n].role for n in unheld})
            report.notes.append(
                f"{here} holds {len(unheld)} {'/'.join(roles)} tensor{'s' * (len(unheld) > 1)} that {there} holds none of: not compared"
            )
    renamed_state = [x for x in moved if mine.tensors[x].role != "model" and theirs.tensors[moved[x]].role != "model"]
    if renamed_state:
        report.notes.append(f"{len(renamed_state)} tensors of {pa} are under other names in {pb} with the same bytes")
    for here, which in ((pa, "b"), (pb, "a")):
        alone = [e["key"] for e in d.training_state if e[which] is None]
        if alone:
            report.notes.append(f"training state held by {here} only, not compared: {', '.join(alone)}")
    for e in d.training_state:
        if e["a"] is not None and e["b"] is not None:
            report.problems.append(f"{pb}: training state '{e['key']}' is {e['b']!r}, {pa} has {e['a']!r}")
    report.notes += [f"{t['name']} of {pa if t['side'] == 'a' else pb} is tied to {t['tied_to']} (the same data)" for t in d.tied]
    report.notes += [n.replace("A: ", f"{pa}: ", 1).replace("B: ", f"{pb}: ", 1) for n in d.notes if "not compared" in n]
    report.checks.append(f"against {pb}")


def verify(path: str | Path, options: VerifyOptions) -> Report:
    if not (0 <= options.atol < float("inf") and 0 <= options.rtol < float("inf")):
        raise UsageError("--atol and --rtol take finite values >= 0")
    if (options.atol or options.rtol) and options.against is None:
        raise UsageError("--atol and --rtol are tolerances of --against; give --against CKPT, or leave them out")
    report = Report(str(path))
    given = (options.write_manifest, options.manifest, options.policy)  # as Locations: Path would spell s3:// as s3:/
    write_manifest, manifest_file, policy_file = (location(value) if value is not None else None for value in given)
    if write_manifest:
        check_manifest_destination(write_manifest, options.overwrite)
    manifest = load_manifest(manifest_file) if manifest_file else None  # the user's files: exit 2 before any work
    rules = policy_mod.load(policy_file) if policy_file else None
    try:
        ckpt = open_checkpoint(path, options.format, options.tag, options.trust_pickle)
    except DataError as exc:
        report.problems.append(str(exc))
        report.refused_pickle = exc.global_name if isinstance(exc, UnsafePickleError) else None
        return report
    report.path, report.format = ckpt.path, ckpt.format
    report.notes += choice_notes(ckpt)  # which checkpoint of a run root, as every command says
    report.stats = {"tensors": len(ckpt.tensors), "files": len(ckpt.files), "bytes": sum(f.bytes for f in ckpt.files)}
    report.problems += file_and_tiling_problems(ckpt)
    report.checks.append("structure")
    # temporary siblings that an interrupted or killed ckpt write left; in object storage, uploads never completed
    report.problems += store.unfinished(location(ckpt.path))
    report.problems += quantized.problems(ckpt, options.deep)
    if options.deep and has_checksums(ckpt):
        meter.stage("checking CRCs", sum(f.bytes for f in ckpt.files))
    try:
        report.problems += format_check(ckpt, options.deep)
    except DataError as exc:
        report.problems.append(str(exc))
    report.notes += format_notes(ckpt)  # what the checks suspect and cannot decide (file times): never a problem
    if options.deep:
        report.checks.append("deep")
        if not has_checksums(ckpt) and manifest is None and not write_manifest:
            report.notes.append(
                f"{ckpt.format} stores no checksums: --deep read every byte and the structure is whole, but a changed byte "
                "inside a tensor cannot be seen; record a manifest (--write-manifest FILE) and check later with --manifest FILE"
            )
    if report.problems:  # reading data of a broken checkpoint would only repeat the problems
        return report
    finite = options.finite or bool(rules and rules.finite)
    # Tensor checksums serve manifests; --deep alone reads every byte once: the format's CRC check,
    # or (formats without checksums) the tensors themselves.
    algorithms = {manifest_hash(manifest)} if manifest else set()
    algorithms |= {MANIFEST_HASH} if write_manifest else set()
    want_hash = bool(algorithms)
    read_all = options.deep and not has_checksums(ckpt)
    if read_all and not algorithms:
        algorithms = {MANIFEST_HASH}  # reading every byte once; the fastest digest on the way
    # With a manifest: files, and the tensors stored whole in them, read once; --deep alone needs only the tensors.
    hashes = {a: file_pass(ckpt, a) if want_hash else Digests(a) for a in algorithms}
    if want_hash or read_all or finite:
        sources = SourceFiles()
        try:
            if (want_hash or read_all) and not all(store.mappable(f.path) for f in ckpt.files):
                # in object storage: fetched ahead in large ranges, not one round trip per tensor (a list of every
                # chunk's run: made only there, 75 MB for 581,160 local chunks)
                sources.expect([run for t in ckpt.tensors.values() for run in byte_runs(t, t.dtype) or []])
            wanted = {t.name: [a for a in algorithms if t.name not in hashes[a].tensors] for t in ckpt.tensors.values()}
            meter.stage("reading tensors", sum(t.nbytes for t in ckpt.tensors.values() if wanted[t.name] or finite))
            for t in ckpt.tensors.values():
                nan, inf = scan_tensor(t, sources, {a: hashes[a] for a in wanted[t.name]}, finite)
                if nan or inf:
                    report.nonfinite[t.name] = {"nan": nan, "inf": inf}
        except DataError as exc:
            report.problems.append(str(exc))
            if manifest is not None and manifest_file is not None:  # its file checksums still name the file that changed
                check_manifest(ckpt, manifest, hashes[manifest_hash(manifest)], report, manifest_file, tensors=False)
            return report
        finally:
            sources.close()
        report.checks += ["finite"] if finite else []
        if finite:
            for name, counts in report.nonfinite.items():
                report.problems.append(
                    f"{ckpt.tensors[name].pieces[0].data.path}: tensor '{name}' has {counts['nan']} NaN and {counts['inf']} Inf values"
                )
    if manifest is not None and manifest_file is not None:
        check_manifest(ckpt, manifest, hashes[manifest_hash(manifest)], report, manifest_file)
    if options.against:
        other = open_checkpoint(options.against, None, None, options.trust_pickle)
        atol, rtol = options.atol, options.rtol
        if rules and rules.atol is not None and not atol:
            atol = rules.atol
        if rules and rules.rtol is not None and not rtol:
            rtol = rules.rtol
        compare(ckpt, other, atol, rtol, report)  # one run in two frameworks: by parameter name, as diff pairs them
    if rules:
        report.problems += policy_mod.check(ckpt, rules)
        report.checks.append(f"policy {policy_file}")
    if write_manifest and report.ok:
        record = build_manifest(ckpt, hashes[MANIFEST_HASH].tensors, hashes[MANIFEST_HASH].files)
        # atomically: a temporary sibling, then one os.replace; in object storage one PUT (an object appears whole or not at all)
        store.put(write_manifest, (json.dumps(record, indent=2) + "\n").encode())
        report.checks.append(f"wrote manifest {write_manifest}")
    report.stats["dtype_names"] = sorted({t.dtype.name for t in ckpt.tensors.values()})
    return report
