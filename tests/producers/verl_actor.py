"""verl (0.9.1) actor checkpoints on the CPU, under torchrun (gloo), saved by verl's own FSDPCheckpointManager and
merged by verl's own model merger.

    torchrun --nproc-per-node 2 verl_actor.py OUT

The tiny Llama (tiny_llama.py) and a tiny word-level tokenizer are written as the Hugging Face model a verl run
starts from (OUT/base_model, what actor_rollout_ref.model.path names). For each strategy the actor is built as
verl's FSDP engine builds it (verl/workers/engine/fsdp/transformer_impl.py): loaded in float32 on rank 0 and on the
meta device elsewhere (get_init_weight_context_manager), a ("fsdp",) device mesh (create_device_mesh), bfloat16
mixed precision, and then

    fsdp1   FullyShardedDataParallel(device_mesh=..., auto_wrap_policy=get_fsdp_wrap_policy, param_init_fn=init_fn,
            sync_module_states=True, FULL_SHARD, use_orig_params=False), state dict type SHARDED_STATE_DICT
    fsdp2   apply_fsdp2 (fully_shard per decoder layer, embed_tokens, lm_head and the root), then
            fsdp2_load_full_state_dict

AdamW from verl's build_optimizer, verl's constant LR schedule, 2 steps on random tokens (the driver's batch from a
torchdata StatefulDataLoader, split across the ranks), then FSDPCheckpointManager.save_checkpoint. Written:

    OUT/base_model                          the starting Hugging Face model (config, generation config, tokenizer)
    OUT/<cfg>/global_step_2/actor           the manager's save, one torch.save per rank:
      model_world_size_2_rank_R.pt          the SHARDED_STATE_DICT by Hugging Face names: DTensors, Shard(0) over the
                                            1-D ("fsdp",) mesh, float32 (both strategies)
      optim_world_size_2_rank_R.pt          optimizer.state_dict() as is ({state, param_groups}, integer ids): fsdp1
                                            holds plain 1-D tensors, this rank's slice of each FlatParameter (one per
                                            wrapped unit: the root's embed/norm/lm_head, then each decoder layer);
                                            fsdp2 holds DTensor exp_avg/exp_avg_sq per parameter, step a 0-d tensor
      extra_state_world_size_2_rank_R.pt    {"lr_scheduler": LambdaLR.state_dict(), "rng": {cpu, numpy, random}}
      fsdp_config.json                      {"FSDP_version": 1 | 2, "world_size": 2}
      huggingface/                          config.json, generation_config.json, tokenizer.json, tokenizer_config.json;
                                            fsdp2 also saves "hf_model": model.safetensors, float32, under a
                                            config.json that says bfloat16
    OUT/<cfg>/global_step_2/data.pt         the dataloader state, as verl's RayPPOTrainer._save_checkpoint writes it
    OUT/<cfg>/latest_checkpointed_iteration.txt   "2", the trainer's tracker (find_latest_ckpt_path reads it)
    OUT/<cfg>/merged_hf                     verl's model merger (python -m verl.model_merger merge --backend fsdp):
                                            config.json (dtype bfloat16), generation_config.json, model.safetensors
                                            (bfloat16: the merger casts every shard), tokenizer files; for fsdp2 the
                                            merger's `test` operation then checks it against huggingface/'s weights
    OUT/<cfg>/reference.pt                  (rank 0) the trained model's full state dict, Hugging Face names, float32
    OUT/<cfg>/optim_reference.pt            (rank 0) the optimizer's full state by parameter name (get_optimizer_state_dict)
    OUT/<cfg>/logits.pt                     (rank 0) {"tokens", "logits"}: a plain float32 LlamaForCausalLM holding
                                            reference.pt, on ids 1..16

CPU shims (verl assumes an accelerator; everything that builds, saves and merges is verl's own code): verl's platform
layer (verl.plugin.platform) falls back to CUDA when it detects none, so a "cpu" platform is registered and set
(device "cpu", torch.cpu as the device module with the empty_cache verl calls as a no-op, gloo); FSDP1's check that
sync_module_states only sees accelerator tensors is skipped (gloo broadcasts CPU tensors); transformers' hub kernels
are switched off (USE_HUB_KERNELS=0: kernelize rejects the meta-device model verl loads on ranks other than 0); and
the reference state dict is gathered without offload_to_cpu (on the CPU, FSDP1's offloading unshard frees the
storage it returns).
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

STEPS, SEQ, BATCH, LR, SEED = 2, 16, 2, 1e-2, 0
IDS = torch.arange(1, SEQ + 1).reshape(1, SEQ)
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, the rest of the vocabulary is w4..w63
SAVE_CONTENTS = {"fsdp1": ["model", "optimizer", "extra"], "fsdp2": ["model", "optimizer", "extra", "hf_model"]}


def cpu_shims() -> None:
    import torch.distributed.fsdp._init_utils as fsdp_init_utils
    from verl.plugin.platform import PlatformRegistry, set_platform
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class CpuDevice(types.ModuleType):
        """torch.cpu, plus the empty_cache and set_rng_state verl calls on its device module."""

        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cpu, name)

        @staticmethod
        def empty_cache() -> None:
            pass

        @staticmethod
        def set_rng_state(state: torch.Tensor) -> None:  # what verl's load_rng_state restores as the device's
            torch.set_rng_state(state)

    device = CpuDevice("verl_cpu_device")

    @PlatformRegistry.register("cpu")
    class PlatformCPU(PlatformCUDA):
        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return device

        def is_available(self) -> bool:
            return True

        def current_device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cpu")

        def empty_cache(self) -> None:
            pass

        def communication_backend_name(self) -> str:
            return "gloo"

    set_platform(PlatformCPU())
    # FSDP1 refuses sync_module_states with CPU tensors (a guard for NCCL); gloo broadcasts them.
    fsdp_init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    # transformers kernelizes every from_pretrained model with the `kernels` package when it is installed, which
    # fails on the meta-device copies verl loads on ranks other than 0.
    os.environ["USE_HUB_KERNELS"] = "0"


def tokenizer() -> PreTrainedTokenizerFast:
    from tiny_llama import config as tiny_config
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + [f"w{i}" for i in range(len(SPECIAL), tiny_config().vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def write_base_model(path: Path) -> None:
    from tiny_llama import config as tiny_config
    from transformers import LlamaForCausalLM

    config = tiny_config()
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)


def build_actor(strategy: str, base: Path) -> torch.nn.Module:
    """The actor module as FSDPEngine._build_module / _build_fsdp_module build it (engine defaults)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardedStateDictConfig, StateDictType
    from transformers import AutoModelForCausalLM
    from verl.utils.device import get_device_id
    from verl.utils.fsdp_utils import (
        apply_fsdp2,
        fsdp2_load_full_state_dict,
        get_fsdp_wrap_policy,
        get_init_weight_context_manager,
        init_fn,
    )
    from verl.workers.engine.fsdp.utils import create_device_mesh, get_sharding_strategy

    mesh = create_device_mesh(world_size=dist.get_world_size(), fsdp_size=-1)
    with get_init_weight_context_manager(use_meta_tensor=True, mesh=mesh)():  # untied: rank 0 real, the rest meta
        module = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    module.to(torch.float32)
    param_dtype, reduce_dtype, buffer_dtype = torch.bfloat16, torch.float32, torch.float32
    if strategy == "fsdp1":
        module = FSDP(
            module,
            param_init_fn=init_fn,
            auto_wrap_policy=get_fsdp_wrap_policy(module=module, config=None, is_lora=False),
            device_id=get_device_id(),
            sharding_strategy=get_sharding_strategy(mesh, zero3_enable=True),
            mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype),
            sync_module_states=True,
            device_mesh=mesh,
            forward_prefetch=False,
            use_orig_params=False,
        )
        FSDP.set_state_dict_type(module, state_dict_type=StateDictType.SHARDED_STATE_DICT, state_dict_config=ShardedStateDictConfig())
    else:
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=True)
        fsdp_kwargs = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": None, "reshard_after_forward": True}
        full_state = module.state_dict()
        apply_fsdp2(module, fsdp_kwargs, {})
        fsdp2_load_full_state_dict(module, full_state, mesh, None)
    return module


def train(strategy: str, module: torch.nn.Module, dataloader: Any) -> tuple[torch.optim.Optimizer, Any]:
    from verl.utils.fsdp_utils import fsdp2_clip_grad_norm_
    from verl.utils.torch_functional import get_constant_schedule_with_warmup
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    optimizer = build_optimizer(module.parameters(), FSDPOptimizerConfig(lr=LR, total_training_steps=STEPS))
    lr_scheduler = get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    module.train()
    batches = iter(dataloader)
    for _ in range(STEPS):
        ids = next(batches).chunk(world)[rank]  # the driver's batch, dispatched across the ranks
        optimizer.zero_grad()
        loss = module(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if strategy == "fsdp1":
            module.clip_grad_norm_(max_norm=1.0)
        else:
            fsdp2_clip_grad_norm_(module.parameters(), max_norm=1.0)
        optimizer.step()
        lr_scheduler.step()
    return optimizer, lr_scheduler


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state by parameter name, whole (torch's get_optimizer_state_dict; collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))


def write_reference(root: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, base: Path) -> None:
    from transformers import AutoConfig, LlamaForCausalLM
    from verl.utils.fsdp_utils import get_fsdp_full_state_dict

    # offload_to_cpu=False: on the CPU, FSDP1's offloading unshard frees the very storage it hands back
    state = get_fsdp_full_state_dict(module, offload_to_cpu=False, rank0_only=True)
    optim = full_optimizer_state(module, optimizer)
    if dist.get_rank() != 0:
        return
    reference = {name: value.detach().float().clone() for name, value in state.items()}
    torch.save(reference, root / "reference.pt")
    torch.save(optim, root / "optim_reference.pt")
    model = LlamaForCausalLM(AutoConfig.from_pretrained(base)).float().eval()
    model.load_state_dict(reference)
    with torch.no_grad():
        logits = model(input_ids=IDS, use_cache=False).logits.float()
    torch.save({"tokens": IDS, "logits": logits}, root / "logits.pt")


def run(strategy: str, out: Path, base: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    root = out / strategy
    torch.manual_seed(SEED)
    module = build_actor(strategy, base)
    vocab = module.config.vocab_size
    data = torch.randint(len(SPECIAL), vocab, (STEPS * BATCH * dist.get_world_size(), SEQ), generator=torch.Generator().manual_seed(SEED))
    sampler = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(SEED))
    dataloader = StatefulDataLoader(data, batch_size=BATCH * dist.get_world_size(), sampler=sampler, drop_last=True)
    optimizer, lr_scheduler = train(strategy, module, dataloader)

    step_folder = root / f"global_step_{STEPS}"
    manager = FSDPCheckpointManager(
        model=module,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        processing_class=tokenizer(),
        checkpoint_config=CheckpointConfig(save_contents=SAVE_CONTENTS[strategy]),
    )
    manager.save_checkpoint(local_path=str(step_folder / "actor"), global_step=STEPS, max_ckpt_to_keep=None)
    if dist.get_rank() == 0:  # what RayPPOTrainer._save_checkpoint writes beside the workers' saves
        torch.save(dataloader.state_dict(), step_folder / "data.pt")
        (root / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    write_reference(root, module, optimizer, base)
    dist.barrier()


def merge(root: Path, test_hf_dir: Path | None) -> None:
    """What `python -m verl.model_merger merge --backend fsdp --local_dir ACTOR --target_dir MERGED` runs; and, where
    the actor saved an hf_model, `... test --test_hf_dir`: verl's own check of the merged weights against it."""
    from verl.model_merger.base_model_merger import generate_config_from_args
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    actor = root / f"global_step_{STEPS}" / "actor"
    common = {"backend": "fsdp", "local_dir": str(actor), "tie_word_embedding": False, "trust_remote_code": False}
    common |= {"is_value_model": False, "use_cpu_initialization": False}
    jobs = [argparse.Namespace(operation="merge", target_dir=str(root / "merged_hf"), hf_upload_path=None, private=False, **common)]
    if test_hf_dir is not None:
        jobs.append(argparse.Namespace(operation="test", test_hf_dir=str(test_hf_dir), **common))
    for args in jobs:
        merger = FSDPModelMerger(generate_config_from_args(args))
        merger.merge_and_save()
        merger.cleanup()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    cpu_shims()
    base = out / "base_model"
    if dist.get_rank() == 0:
        write_base_model(base)
    dist.barrier()
    for strategy in SAVE_CONTENTS:
        run(strategy, out, base)
    if dist.get_rank() == 0:
        for strategy, contents in SAVE_CONTENTS.items():
            root = out / strategy
            merge(root, root / f"global_step_{STEPS}" / "actor" / "huggingface" if "hf_model" in contents else None)
    dist.barrier()
    # Leave without tearing down gloo (see fsdp2.py).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
