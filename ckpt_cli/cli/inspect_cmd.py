"""`ckpt inspect SRC`."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from ckpt_cli.cli import output
from ckpt_cli.cli.options import Format, Json, Quiet, Source, Tag, TrustPickle
from ckpt_cli.core.sizes import human_bytes
from ckpt_cli.errors import UsageError


def inspect(
    src: Source,
    json_: Json = False,
    yaml_: Annotated[bool, typer.Option("--yaml", help="YAML on stdout.")] = False,
    tensors: Annotated[bool, typer.Option("--tensors", help="Add the table of tensors (name, dtype, shape, role).")] = False,
    filter_: Annotated[
        Optional[list[str]], typer.Option("--filter", metavar="GLOB", help="Only tensors matching this glob (repeatable).")
    ] = None,
    tree: Annotated[
        bool,
        typer.Option(
            "--tree",
            help="The module tree: parameters, bytes and dtypes per module, repeated blocks folded (layers.{0..31} ×32); "
            "model weights, optimizer and other state one line each (--filter opens them).",
        ),
    ] = False,
    depth: Annotated[Optional[int], typer.Option("--depth", metavar="N", help="--tree: show N levels below each role.", min=0)] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="--tree as a Markdown table, for a model card.")] = False,
    format_: Format = None,
    tag: Tag = None,
    trust_pickle: TrustPickle = False,
    quiet: Quiet = False,
) -> None:
    """Summarise a checkpoint: format, world size, step, tensors, parameters, bytes, training state."""
    from ckpt_cli import api  # imported when a command runs (`ckpt --help` imports no format)

    _refuse_conflicts(json_, yaml_, tensors, tree or depth is not None or markdown, markdown)
    if tree or depth is not None or markdown:
        with (
            output.reading(f"inspect {output.last_name(src)}", quiet),
            api.open(src, format=format_, tag=tag, trust_pickle=trust_pickle) as ckpt,
        ):
            view = ckpt.tree(depth, filter_ or ())
        if json_ or yaml_:
            output.emit_json(view.to_json()) if json_ else output.emit_yaml(view.to_json())
            return
        opened = [note for role, note in view.notes if not role]  # which checkpoint of a run: stderr, as every note
        view.notes = [(role, note) for role, note in view.notes if role]
        output.emit(view.markdown() if markdown else view.text())
        for note in opened:
            output.info(f"note: {note}", quiet)
        return
    with output.reading(f"inspect {output.last_name(src)}", quiet):
        doc = api.inspect(src, filter=filter_ or (), format=format_, tag=tag, trust_pickle=trust_pickle)
    if json_:
        output.emit_json(doc)
    elif yaml_:
        output.emit_yaml(doc)
    else:
        output.emit(render(doc, tensors))
        for line in notes(doc):
            output.info(line, quiet)


def notes(doc: dict[str, Any], shown: int = 10) -> list[str]:
    """What inspect says beside its report, on stderr (hidden by --quiet): the checkpoints under a run root, the notes."""
    lines = []
    if doc.get("tags"):
        lines.append(f"checkpoints under this folder ({len(doc['tags'])}):")
        width = max(len(t["tag"]) for t in doc["tags"][:shown])
        lines += [f"  {t['tag']:<{width}}  {t['framework'] or '-':<11} {t['format']}" for t in doc["tags"][:shown]]
        lines += [f"  ... and {len(doc['tags']) - shown} more (ckpt ls lists them all)"] if len(doc["tags"]) > shown else []
    return lines + [f"note: {n}" for n in doc.get("notes", [])]


def _refuse_conflicts(json_: bool, yaml_: bool, tensors: bool, tree: bool, markdown: bool) -> None:
    """Options that ask for two outputs at once: exit 2 naming them (the first would silently win)."""
    pairs = [("--json", json_, "--yaml", yaml_), ("--tree", tree, "--tensors", tensors), ("--markdown", markdown, "--json", json_)]
    pairs.append(("--markdown", markdown, "--yaml", yaml_))
    for a, on_a, b, on_b in pairs:
        if on_a and on_b:
            raise UsageError(f"{a} and {b} ask for two different outputs; give one")


def _state_line(value: Any) -> str:
    if not value:
        return "-"
    if isinstance(value, dict):
        # a list shows its first items (Lightning's loop counters run to dozens)
        return ", ".join(f"{k}={v}" if not isinstance(v, list) else f"{k}=[{output.few(v, 8)}]" for k, v in value.items())
    return str(value)


def render(doc: dict[str, Any], with_tensors: bool) -> str:
    """The report on stdout; its notes go to stderr (notes())."""
    roles: dict[str, int] = {}
    for t in doc["tensors"]:
        roles[t["role"]] = roles.get(t["role"], 0) + 1
    lines = []
    rows = [
        ("path", doc["path"]),
        ("format", doc["format"]),
        ("tag", doc["tag"] or "-"),
        ("step", doc["step"] if doc["step"] is not None else "-"),
        ("world size", doc["world_size"] or "-"),
        ("tensors", f"{doc['num_tensors']} (" + ", ".join(f"{r} {n}" for r, n in roles.items()) + ")"),
        ("parameters", f"{doc['num_params']:,}"),
        ("bytes", f"{human_bytes(doc['total_bytes'])} (" + ", ".join(f"{k} {human_bytes(v)}" for k, v in doc["dtypes"].items()) + ")"),
        ("files", f"{len(doc['files'])} ({human_bytes(sum(f['bytes'] for f in doc['files']))})"),
    ]
    lines += [f"{k:<12} {v}" for k, v in rows]
    details = {k: v for k, v in doc["details"].items() if isinstance(v, (int, str)) and not isinstance(v, bool) and v != ""}
    if details:
        lines.append(f"{'details':<12} " + ", ".join(f"{k}={v}" for k, v in details.items()))
    if doc["details"].get("tied"):
        lines.append(f"{'tied':<12} " + "; ".join(" = ".join(g) for g in doc["details"]["tied"]))
    if quant := doc["details"].get("quantization"):
        block = f" in blocks of {'x'.join(map(str, quant['block_size']))}" if quant["block_size"] else ""
        what = f"{quant['method']} ({', '.join(quant['formats'])})" if quant["formats"] != [quant["method"]] else quant["method"]
        count = f"{quant['quantized_tensors']} weights (e.g. {quant['example']})"
        lines.append(f"{'quantized':<12} {what}{block}: {count}, from {quant['from']}")
    if adapter := doc["details"].get("adapter"):
        lines += adapter_lines(adapter)
    if doc["format"] == "gguf":
        lines += gguf_lines(doc["details"])
    lines.append("training state")
    lines += [f"  {k:<14} {_state_line(v)}" for k, v in doc["training_state"].items()]
    for u in doc.get("unread", []):
        refused = f"is a pickle that needs global '{u['refused_global']}' (not on the allow list; not loaded)"
        lines.append(f"refused: '{u['name']}' {refused}" if u["refused_global"] else f"unread: '{u['name']}': {u['reason']}")
    if with_tensors:
        width = max([len(t["name"]) for t in doc["tensors"]] + [4])
        lines.append("")
        lines.append(f"{'name':<{width}}  {'dtype':<10} {'shape':<18} {'role':<10} pieces")
        lines += [f"{t['name']:<{width}}  {t['dtype']:<10} {str(t['shape']):<18} {t['role']:<10} {t['pieces']}" for t in doc["tensors"]]
    return "\n".join(lines)


def gguf_lines(d: dict[str, Any]) -> list[str]:
    """A GGUF file's architecture hyper-parameters, tokenizer and tensor types (stored, before dequantizing)."""
    tok = d.get("tokenizer", {})
    hyper = ", ".join(f"{k}={v}" for k, v in d.get("hyperparameters", {}).items())
    extra = "".join(f", {k}={v}" for k, v in tok.items() if k not in ("model", "vocab_size"))
    return [
        f"{'hparams':<12} {hyper or '-'}",
        f"{'tokenizer':<12} {tok.get('model', '-')}, {tok.get('vocab_size', '?')} tokens{extra}",
        f"{'gguf types':<12} "
        + ", ".join(f"{k} x{v}" for k, v in d.get("tensor_types", {}).items())
        + f" ({human_bytes(d.get('stored_bytes', 0))} stored)",
    ]


def adapter_lines(a: dict[str, Any]) -> list[str]:
    """A PEFT adapter: its kind, base, rank, alpha and scale rule, targets; each module's rank and alpha when the
    config's rank_pattern or alpha_pattern gives some their own."""
    kind = "DoRA" if a["use_dora"] else "rsLoRA" if a["use_rslora"] else "LoRA"
    targets = a["target_modules"] if isinstance(a["target_modules"], str) else ", ".join(a["target_modules"] or [])
    lines = [
        f"{'adapter':<12} {kind} of base '{a['base_model'] or '-'}': r={a['r']}, lora_alpha={a['lora_alpha']}, scale = {a['scale']}; "
        f"{len(a['modules'])} modules (target_modules: {targets or '-'})"
    ]
    if a["rank_pattern"] or a["alpha_pattern"]:
        lines += [f"  {m['module']:<40} r={m['r']} lora_alpha={m['lora_alpha']:g} scale={m['scale']:g}" for m in a["modules"]]
    return lines
