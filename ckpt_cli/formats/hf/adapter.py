"""PEFT LoRA adapters (plain LoRA, rsLoRA, DoRA): a folder of `adapter_config.json` and `adapter_model.safetensors`
(or `adapter_model.bin`, read through the allow-listed torch reader), as peft's `save_pretrained` writes it.

Read only: an adapter is inspected and verified here, and applied to a base while it streams (`--adapter DIR`,
ops/adapters.py). The facts (key names, scale rules, DoRA), with where they come from in peft: docs/formats.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_cli.core import structured
from ckpt_cli.core.interface import ReadOptions
from ckpt_cli.core.model import Checkpoint, FileInfo, TensorEntry
from ckpt_cli.core.paths import read_regular_bytes
from ckpt_cli.errors import DataError
from ckpt_cli.formats import safetensors as st
from ckpt_cli.formats import torch_save

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
CONFIG_MAX_BYTES = 16 << 20
PREFIX = "base_model.model."  # peft's PeftModel -> LoraModel -> the base model: the saved keys' prefix
PARTS = ("lora_A", "lora_B", "lora_magnitude_vector")
# What ckpt cannot apply to a base: the config's key, when set, and why (one line each).
REFUSED = {
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights stored [in, out], GPT-2 style)",
    "lora_bias": "lora_bias (a trained bias on lora_B)",
    "modules_to_save": "modules_to_save (whole modules saved beside the LoRA weights)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "layer_replication": "layer_replication (layers duplicated at load)",
    "target_parameters": "target_parameters (LoRA on nn.Parameter, MoE experts)",
    "use_qalora": "use_qalora",
    "alora_invocation_tokens": "aLoRA (activated only after invocation tokens; it cannot be merged)",
}


def _positive(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1 << 24 or not math.isfinite(value):
        return f"must be a positive number below 2^24, not {value!r}"[:120]
    return None


def _rank(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 20:
        return f"must be a positive integer below 2^20, not {value!r}"[:120]
    return None


Opt = structured.Optional
SCHEMA = {
    "peft_type": Opt(str),
    "base_model_name_or_path": Opt(str),
    "r": _rank,
    "lora_alpha": _positive,
    "target_modules": Opt((str, list)),
    "use_rslora": Opt(bool),
    "use_dora": Opt(bool),
    "rank_pattern": Opt({str: _rank}),
    "alpha_pattern": Opt({str: _positive}),
    "bias": Opt(str),
}


@dataclass(frozen=True)
class Module:
    """One targeted module: its path in the base model and its stored tensors (names in the adapter file)."""

    name: str  # model.layers.0.self_attn.q_proj
    a: str | None
    b: str | None
    magnitude: str | None
    r: int  # the config's rank for it (rank_pattern, else r)
    alpha: float

    @property
    def weight(self) -> str:
        """The base's weight this module's merge replaces."""
        return f"{self.name}.weight"


@dataclass
class Adapter:
    """An adapter's config (what peft reads of it) and its modules, with what ckpt cannot apply."""

    path: str
    config: dict[str, Any]
    modules: dict[str, Module]
    problems: list[str] = field(default_factory=list)  # one line each: what verify reports and --adapter refuses

    @property
    def rslora(self) -> bool:
        return bool(self.config.get("use_rslora"))

    @property
    def dora(self) -> bool:
        return bool(self.config.get("use_dora"))

    def scale(self, module: Module) -> float:
        """peft's LoraLayer.update_layer: alpha / sqrt(r) with use_rslora, else alpha / r (Python floats)."""
        return module.alpha / math.sqrt(module.r) if self.rslora else module.alpha / module.r

    def refuse_problems(self, doing: str = "", verify_lists: bool = True) -> None:
        """DataError naming the first problem (and how many more) where there is any: an adapter with one is applied,
        exported or converted nowhere. `verify_lists`: the adapter is a folder `ckpt verify` lists them for."""
        if self.problems:
            more = f" (and {len(self.problems) - 1} more" if len(self.problems) > 1 else ""
            more += (f" problems; ckpt verify {self.path} lists them)" if verify_lists else ")") if more else ""
            raise DataError(f"{doing}{self.problems[0]}{more}")

    def summary(self) -> dict[str, Any]:
        c = self.config
        return {
            "peft_type": c.get("peft_type") or "LORA",
            "base_model": c.get("base_model_name_or_path"),
            "r": c["r"],
            "lora_alpha": c["lora_alpha"],
            "scale": "lora_alpha / sqrt(r)" if self.rslora else "lora_alpha / r",
            "use_rslora": self.rslora,
            "use_dora": self.dora,
            "target_modules": c.get("target_modules"),
            "rank_pattern": c.get("rank_pattern") or {},
            "alpha_pattern": c.get("alpha_pattern") or {},
            "modules": [
                {
                    "module": m.name,
                    "r": m.r,
                    "lora_alpha": m.alpha,
                    "scale": self.scale(m),
                    "lora_A": m.a,
                    "lora_B": m.b,
                    "magnitude": m.magnitude,
                }
                for m in self.modules.values()
            ],
        }


def pattern_key(patterns: dict[str, Any], module: str) -> str | None:
    """peft's get_pattern_key: the first pattern key that matches the end of the module's path (as a regex)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):  # keys are checked as expressions when the config is read
            return key
    return None


def pattern_problems(config: dict[str, Any], where: str) -> list[str]:
    """A rank_pattern or alpha_pattern key that is no regular expression (peft raises on it): one problem each."""
    problems = []
    for table in ("rank_pattern", "alpha_pattern"):
        for key in config.get(table) or {}:
            try:
                re.compile(rf"(.*\.)?({key})$")
            except re.error as exc:
                problems.append(f"{where}: {table} key {key!r} is not a regular expression ({exc})")
    return problems


def split_key(key: str) -> tuple[str, str] | None:
    """(module path, part) of a saved key: `base_model.model.M.lora_A.weight` -> (M, lora_A); also the keys an
    adapter keeps under its adapter name (`M.lora_A.default.weight`, an FSDP/DCP export) and DoRA's
    `M.lora_magnitude_vector` (peft saves it without `.weight`). None: not a LoRA weight."""
    name = key.removeprefix(PREFIX)
    items = name.split(".")
    for i in range(len(items) - 1, 0, -1):
        if items[i] in PARTS:
            rest = items[i + 1 :]
            if rest in ([], ["weight"]) or (len(rest) == 2 and rest[1] == "weight"):
                return ".".join(items[:i]), items[i]
            return None
    return None


def parse_config(data: bytes, where: str) -> dict[str, Any]:
    doc = structured.load_json(data.decode("utf-8", "replace"), where, DataError)
    if not isinstance(doc, dict):
        raise DataError(f"{where}: not a JSON object")
    structured.check({k: doc.get(k) for k in SCHEMA if k in doc or k in ("r", "lora_alpha")}, SCHEMA, where, DataError)
    return doc


def _refusals(config: dict[str, Any], where: str) -> list[str]:
    out = []
    peft_type = config.get("peft_type") or "LORA"
    if peft_type != "LORA":
        out.append(f"{where}: peft_type {peft_type!r}; ckpt applies LORA adapters (LoRA, rsLoRA, DoRA) only")
    for key, what in REFUSED.items():
        if config.get(key) not in (None, False, [], {}, ""):
            out.append(f"{where}: {what} is set; ckpt cannot apply it to a base")
    if config.get("bias") not in (None, "none"):
        out.append(f"{where}: bias {config['bias']!r} (trained biases saved beside the LoRA weights); ckpt cannot apply it")
    return out


def adapter_of(config: dict[str, Any], tensors: dict[str, TensorEntry], where: str, weights: str) -> Adapter:
    """The adapter's modules from its tensor names, with every problem found: a module without A or B, shapes that
    do not fit (A [r, in], B [out, r], magnitude [out]), a rank other than the config's, tensors that are no LoRA weight."""
    problems = _refusals(config, where)
    parts: dict[str, dict[str, str]] = {}
    for key in tensors:
        found = split_key(key)
        if found is None:
            problems.append(f"{weights}: '{key}' is not a LoRA weight (lora_A, lora_B, lora_magnitude_vector); ckpt cannot apply it")
            continue
        path, part = found
        if part in parts.setdefault(path, {}):
            problems.append(f"{weights}: '{key}' and '{parts[path][part]}' are both {part} of '{path}'")
        parts[path][part] = key
    bad_patterns = pattern_problems(config, where)
    if bad_patterns:
        return Adapter(str(Path(where).parent), config, {}, problems + bad_patterns)
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules: dict[str, Module] = {}
    for name, got in parts.items():
        r_key, a_key = pattern_key(ranks, name), pattern_key(alphas, name)
        r = ranks[r_key] if r_key is not None else config["r"]
        alpha = alphas[a_key] if a_key is not None else config["lora_alpha"]
        module = Module(name, got.get("lora_A"), got.get("lora_B"), got.get("lora_magnitude_vector"), r, float(alpha))
        modules[name] = module
        problems += _module_problems(module, tensors, weights, bool(config.get("use_dora")))
    if not modules:
        problems.append(f"{weights}: holds no LoRA weight")
    return Adapter(str(Path(where).parent), config, modules, problems)


def _module_problems(m: Module, tensors: dict[str, TensorEntry], weights: str, dora: bool) -> list[str]:
    for part, key in (("lora_A", m.a), ("lora_B", m.b)):
        if key is None:
            return [f"{weights}: '{m.name}' has no {part} weight; a LoRA module needs both lora_A and lora_B"]
    a, b = tensors[m.a], tensors[m.b]  # type: ignore[index]
    if len(a.shape) != 2 or len(b.shape) != 2:
        return [f"{weights}: '{m.name}': lora_A {list(a.shape)} and lora_B {list(b.shape)} are not matrices (Linear LoRA only)"]
    if a.shape[0] != b.shape[1]:
        return [f"{weights}: '{m.name}': lora_A {list(a.shape)} [r, in] and lora_B {list(b.shape)} [out, r] have different ranks"]
    if a.shape[0] != m.r:
        return [f"{weights}: '{m.name}' has rank {a.shape[0]}, the config says r={m.r} (r, rank_pattern)"]
    out = []
    if dora and m.magnitude is None:
        out.append(f"{weights}: '{m.name}' has no lora_magnitude_vector, and use_dora is set")
    if m.magnitude is not None:
        mag = tensors[m.magnitude]
        if not dora:
            out.append(f"{weights}: '{m.name}' has a DoRA magnitude, and use_dora is not set")
        elif mag.shape != (b.shape[0],):
            out.append(f"{weights}: '{m.name}': lora_magnitude_vector {list(mag.shape)} is not [out] = [{b.shape[0]}]")
    for key in (m.a, m.b, m.magnitude):
        if key is not None and not tensors[key].dtype.is_float:
            out.append(f"{weights}: '{key}' is {tensors[key].dtype.name}, not a float")
    return out


def _weights_file(path: Path) -> Path | None:
    return next((path / n for n in WEIGHTS if (path / n).is_file()), None)


class AdapterReader:
    name = "adapter"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / CONFIG).is_file() and _weights_file(path) is not None

    def read(self, path: Path, options: ReadOptions) -> Checkpoint:
        config_path = path / CONFIG
        config = parse_config(read_regular_bytes(config_path, max_bytes=CONFIG_MAX_BYTES), str(config_path))
        weights = _weights_file(path)
        if weights is None:
            raise DataError(f"{path}: holds {CONFIG} and no {' or '.join(WEIGHTS)}")
        inner = (st.READER if weights.suffix == ".safetensors" else torch_save.READER).read(weights, options)
        if inner.objects:
            raise DataError(f"{weights}: holds non-tensor values ({next(iter(inner.objects))}); an adapter holds tensors only")
        adapter = adapter_of(config, inner.tensors, str(config_path), str(weights))
        files = [FileInfo(str(config_path), config_path.stat().st_size), *inner.files]
        return Checkpoint(
            format=self.name, path=str(path), tensors=inner.tensors, files=files, details={"adapter": adapter.summary()}, source=adapter
        )

    def check(self, ckpt: Checkpoint, deep: bool) -> list[str]:
        adapter: Adapter = ckpt.source
        inner = st.READER if ckpt.files[-1].path.endswith(".safetensors") else torch_save.READER
        shell = Checkpoint(format=inner.name, path=ckpt.files[-1].path, tensors=ckpt.tensors, files=ckpt.files[1:])
        return [*adapter.problems, *inner.check(shell, deep)]


READER = AdapterReader()
