"""`--to adapter`: the LoRA weights of a fine-tune saved whole (an FSDP/DCP or DeepSpeed training checkpoint, a full
state dict) written as the PEFT adapter folder peft's `save_pretrained` writes: `adapter_model.safetensors` under
peft's saved names and the run's `adapter_config.json` (from --hf-config DIR), the config last.

peft's `get_peft_model_state_dict` keeps the adapter's tensors and drops its name from their keys
(`base_model.model.M.lora_A.default.weight` -> `base_model.model.M.lora_A.weight`; DoRA's
`M.lora_magnitude_vector.default.weight` -> `M.lora_magnitude_vector`); the frozen base weights and the optimizer state
stay behind. What a wrapper put before `base_model.model.` (DCP's `model.` of `{"model": ...}`) is cut.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ckpt_cli.core.interface import WriteOptions
from ckpt_cli.core.model import Checkpoint, TensorEntry
from ckpt_cli.core.paths import read_regular_bytes
from ckpt_cli.core.write.plan import Literal, OutputFile, WritePlan
from ckpt_cli.errors import DataError, UsageError
from ckpt_cli.formats import safetensors as st
from ckpt_cli.formats.hf.adapter import CONFIG, CONFIG_MAX_BYTES, PREFIX, adapter_of, parse_config

WEIGHTS = "adapter_model.safetensors"
# M.lora_A.NAME.weight, M.lora_B.NAME.weight, M.lora_magnitude_vector.NAME.weight: a LoRA layer's parameters under
# the adapter's name, as a PeftModel's state dict holds them
TRAINED = re.compile(r"(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_magnitude_vector)\.(?P<adapter>[^.]+)\.weight")


def saved_name(name: str) -> tuple[str, str] | None:
    """(peft's saved key, the adapter's name) of a PeftModel state-dict key; None: not a LoRA parameter."""
    found = TRAINED.fullmatch(name)
    if found is None:
        return None
    module, part, adapter = found["module"], found["part"], found["adapter"]
    at = module.find(PREFIX)
    module = module[at:] if at >= 0 else PREFIX + module
    return f"{module}.{part}" + ("" if part == "lora_magnitude_vector" else ".weight"), adapter


class AdapterWriter:
    name = "adapter"
    dest_is_dir = True

    def plan(self, ckpt: Checkpoint, dest: Path, options: WriteOptions) -> WritePlan:
        config_at = ckpt.companions.get(CONFIG)
        if config_at is None:
            raise UsageError(
                f"a PEFT adapter folder needs its {CONFIG} (r, lora_alpha, target_modules): pass --hf-config DIR, "
                "the folder peft's save_pretrained or the trainer wrote it to"
            )
        where = config_at if isinstance(config_at, str) else CONFIG
        data = config_at if isinstance(config_at, bytes) else read_regular_bytes(config_at, max_bytes=CONFIG_MAX_BYTES)
        config = parse_config(data, where)
        lora, adapters = _lora_tensors(ckpt)
        if not lora:
            raise DataError(f"{ckpt.path}: holds no LoRA weight (M.lora_A.NAME.weight as a PeftModel saves it)")
        adapter = adapter_of(config, lora, where, WEIGHTS)
        adapter.refuse_problems(verify_lists=False)  # its weights are the source's, not a folder's
        left = len(ckpt.tensors) - len(lora)
        notes = [f"adapter '{adapters.pop()}': {len(lora)} LoRA weights of {len(adapter.modules)} modules under peft's names"]
        if left:
            notes.append(f"left out {left} tensors that are no LoRA weight (the frozen base, optimizer state)")
        files = [
            OutputFile(WEIGHTS, st.file_segments(list(lora.values()), {"format": "pt"})),
            OutputFile(CONFIG, [Literal(data)], commit_marker=True),
        ]
        return WritePlan(self.name, dest, True, files, notes)


def _lora_tensors(ckpt: Checkpoint) -> tuple[dict[str, TensorEntry], set[str]]:
    """The LoRA parameters under peft's saved names, and the adapter name they were held under (one)."""
    found = [(t, *saved) for t in ckpt.tensors.values() if t.role == "model" and (saved := saved_name(t.name))]
    adapters = {adapter for _, _, adapter in found}
    if len(adapters) > 1:
        raise UsageError(
            f"{ckpt.path} holds {len(adapters)} adapters ({', '.join(sorted(adapters))}); write one: --select '*.{min(adapters)}.*'"
        )
    lora: dict[str, TensorEntry] = {}
    stored: dict[str, str] = {}  # saved key -> the name it had
    for t, key, _ in found:
        if key in lora:
            raise DataError(f"{ckpt.path}: '{t.name}' and '{stored[key]}' are both saved as '{key}'")
        stored[key] = t.name
        lora[key] = dataclasses.replace(t, name=key, path=(key,))
    return lora, adapters


WRITER = AdapterWriter()
