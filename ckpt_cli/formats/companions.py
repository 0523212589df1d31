"""A release's companion files: what save_pretrained and tokenizers keep beside the weights (config.json, the
tokenizer, the generation config), found in a source folder and carried into outputs; config.json read as a dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_cli import store
from ckpt_cli.core import structured
from ckpt_cli.core.model import Checkpoint
from ckpt_cli.core.paths import plain_component, read_regular_bytes
from ckpt_cli.core.write.plan import Literal, OutputFile
from ckpt_cli.errors import DataError

# Files save_pretrained and tokenizers keep beside the weights: a release carries them (config.json rewritten where
# a conversion changes what it says: dtype, quantization).
COMPANIONS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
COMPANION_MAX_BYTES = 256 << 20


def companions_in(folder: Path, names: tuple[str, ...] = COMPANIONS) -> tuple[dict[str, str | bytes], list[str]]:
    """The companion files present in the folder (in object storage: found in one listing). A link is followed only
    inside the folder, or into the blobs of a Hugging Face cache snapshot (`snapshots/REV/x -> ../../blobs/SHA`):
    a release must never carry a file from elsewhere on the machine (a key the folder's author linked to)."""
    if not store.renames(folder):  # object storage: no links to follow
        listed = {p.name for p in folder.iterdir()}
        return {name: str(folder / name) for name in names if name in listed}, []
    found: dict[str, str | bytes] = {}
    notes = []
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        if _inside_source(path, folder):
            found[name] = str(path)
        else:
            notes.append(f"{path} links outside the checkpoint ({path.resolve()}); it is not carried into outputs")
    return found, notes


def _inside_source(path: Path, folder: Path) -> bool:
    if not path.is_symlink():
        return True
    root = folder.resolve()
    target = path.resolve()
    cache = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    return target.is_relative_to(root) or (cache is not None and target.is_relative_to(cache))


def companion_files(ckpt: Checkpoint) -> list[OutputFile]:
    """The companions as output files: rewritten bytes, or the source file's bytes (small files, read now)."""
    out = []
    for name, value in ckpt.companions.items():
        data = value if isinstance(value, bytes) else read_regular_bytes(value, max_bytes=COMPANION_MAX_BYTES)
        out.append(OutputFile(plain_component(name, "companion file"), [Literal(data)]))
    return out


def companion_config(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The checkpoint's config.json (a companion: the source's own, or --hf-config's) as a dict; None without one."""
    source = ckpt.companions.get("config.json")
    if source is None:
        return None
    where = source if isinstance(source, str) else "config.json"
    data = source if isinstance(source, bytes) else read_regular_bytes(source, max_bytes=COMPANION_MAX_BYTES)
    config = structured.load_json(data.decode("utf-8", "replace"), where, DataError)
    if not isinstance(config, dict):
        raise DataError(f"{where}: not a JSON object")
    return config
