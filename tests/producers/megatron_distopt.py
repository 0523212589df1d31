"""Megatron-Core `torch_dist` checkpoints of Megatron's DistributedOptimizer, saved on the CPU (gloo).

    torchrun --nproc-per-node 2 megatron_distopt.py OUT
    torchrun --nproc-per-node N megatron_distopt.py --check OUT     (load OUT back on N ranks and compare)

Megatron's GPTModel (local layer spec as in megatron_save.py: RMSNorm, SwiGLU, rotary, 4 heads in 2 query groups,
no biases, untied output layer; 3 layers, hidden 64, vocab 128) with tensor parallel size 1 and data parallel size 2
is wrapped in Megatron's DistributedDataParallel (use_distributed_optimizer: parameters and gradients live in
contiguous buffers, one per (param dtype, grad dtype)) and trained 2 steps with Adam by the DistributedOptimizer
from `get_megatron_optimizer`: each data-parallel rank owns one contiguous half of every buffer, its fp32 main
parameters and Adam state; gradients are reduce-scattered, updated parameters all-gathered. The ranks see
different fixed random tokens. With 3 layers one parameter (layer 1's linear_fc1.weight) straddles the boundary
between the two ranks' halves. Then, as Megatron-LM's `save_checkpoint` composes it (`generate_state_dict`: the
model's sharded state dict, then `optimizer.sharded_state_dict(state_dict, metadata=...)` with the metadata of
`_build_sharded_state_dict_metadata`; saved with `content_metadata` and the fully parallel save strategy of
--ckpt-fully-parallel-save, Megatron-LM's default, which spreads the writing over the data-parallel ranks):

    OUT/dp_reshardable      float32 model, distrib_optim_sharding_type=dp_reshardable (Megatron-LM's default):
                            Adam state and main params as flat per-bucket tensors in buffer order,
                            `optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32)
                            .bucket_idx_0.{param,exp_avg,exp_avg_sq}`, one chunk per parameter (piece), and
                            ShardedObjects `optimizer.distributed.dp_group_idx_0.{optimizer,per_bucket_numel,
                            per_bucket_numel_unpadded}` (param groups with the step; bucket sizes)
    OUT/fully_reshardable   float32 model, distrib_optim_sharding_type=fully_reshardable
                            (--dist-ckpt-optim-fully-reshardable): per parameter at the model's key and shape,
                            `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`; param groups in common.pt
    OUT/bf16/dp_reshardable, OUT/bf16/fully_reshardable
                            the same with a bfloat16 model (bf16=True; main params and Adam state fp32). The
                            local spec's RMSNorm weights stay float32, so dp_reshardable has two buffers:
                            gbuf_idx_0 dtype_(torch.bfloat16, torch.float32), gbuf_idx_1 dtype_(torch.float32, ...)

OUT/reference.pt (rank 0), for each of "fp32" and "bf16":
    state     per parameter name (`named_parameters`, per layer: `decoder.layers.0.self_attention.linear_qkv.weight`)
              the full main parameter ('param', fp32), 'exp_avg', 'exp_avg_sq' at the parameter's shape and 'step',
              gathered from every rank's shard through the optimizer's own accessors
              (`_get_model_param_range_map`, `_get_main_param_and_optimizer_states`), not through the checkpoint
    model     the model parameters after training
    keys      parameter name -> (its key in the checkpoint, its index along the stacked layer dim or None)
    buffers   per DDP buffer: (param dtype, grad dtype), padded and unpadded size, and each parameter's
              (name, start, end, bucket) in it: how the dp_reshardable flat tensors are laid out
    step, iteration

Shims, for a CPU-only torch where CUDA calls raise; each only replaces a device call or a device check:
  * `torch.cuda.synchronize` -> no-op, `torch.cuda.current_device` -> "cpu" (megatron_save.cpu_shims): the save
    path's host staging barrier and failure flag; DDP's buffers (`device=torch.cuda.current_device()`).
  * A torch function mode turns `device='cuda'` in tensor factories into the CPU and `Tensor.cuda()` into the
    tensor itself: MixedPrecisionOptimizer.__init__ (found_inf, _dummy_overflow_buf, _scale_one) and clip_grads
    (the one-element total norm it all-reduces).
  * `Tensor.type()` (no argument) names a CPU tensor's CUDA type ('torch.FloatTensor' -> 'torch.cuda.FloatTensor'):
    DistributedOptimizer._build_model_and_main_param_groups and __init__ take their fp32 / bf16 branches by the
    CUDA type names only, and clip_grad_by_total_norm_fp32 asserts 'torch.cuda.FloatTensor' grads.
  * The CUDA RNG tracker's fork around attention dropout (p=0) is a no-op, as in megatron_save.
Everything that builds the buffers, the optimizer state, the sharded state dicts and the files is Megatron's code.

Loading back (the check, not the save) needs three more things, none about devices; each is a limitation of
Megatron's torch.optim.Adam fallback (no Transformer Engine / Apex) or of fp32 params, explained where it is done
(load_into_fresh, keep_torch_adam_step, compare): the fresh optimizer gets state by Megatron's own
`_init_optimizer_states_with_dummy_values`; optimizer.load_state_dict runs under no_grad; and the fully_reshardable
loader's missing torch-Adam 'step' key is filled with the optimizer's own step.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron_save import cpu_shims
from torch.overrides import TorchFunctionMode

SEQ = 16
VOCAB = 128
TYPES = ("dp_reshardable", "fully_reshardable")
ITERATION = 2


class CudaToCpu(TorchFunctionMode):
    """`device='cuda'` (or a cuda torch.device) in any torch call becomes the CPU; `Tensor.cuda()` is the tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def cuda_type_names() -> None:
    """`Tensor.type()` (no argument) names a CPU tensor's CUDA type, as Megatron's dtype checks expect."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        # (a Parameter's type() comes back through here once more via __torch_function__: rename only once)
        if not args and not kwargs and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch.") :]
        return name

    torch.Tensor.type = type_


def build(dtype: torch.dtype, seed: int):
    """GPTModel in Megatron DDP with the distributed optimizer; the same initial weights on every rank."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = dtype == torch.bfloat16
    config = TransformerConfig(
        num_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        tensor_model_parallel_size=1,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=32,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    with torch.no_grad():
        for i, (_, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(seed + 100 * i)
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.ndim == 1 else 0.0))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False)
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=1.0,
        bf16=bf16,
        params_dtype=dtype,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    return model, ddp, optimizer


def train(ddp, optimizer, steps: int) -> None:
    from megatron.core import tensor_parallel

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1234 + rank)  # each data-parallel rank its own batch
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    position_ids = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # as in megatron_save
    ddp.train()
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens, position_ids, attention_mask=mask, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()  # reduce-scatter of the grad buffers
        ok, grad_norm, _ = optimizer.step()  # Adam on the local shard, then all-gather of the updated params
        assert ok, "optimizer step skipped"
        if rank == 0:
            print(f"loss {loss.item():.4f} grad_norm {grad_norm:.4f}", flush=True)


def distributed_optimizers(optimizer):
    return getattr(optimizer, "chained_optimizers", [optimizer])


def gathered_state(model, optimizer) -> dict:
    """Full main param / exp_avg / exp_avg_sq per parameter name, from every rank's shard (optimizer accessors)."""
    pieces = []
    names = {p: n for n, p in model.named_parameters()}
    for dopt in distributed_optimizers(optimizer):
        for p, name in names.items():
            if p not in dopt.model_param_gbuf_map:
                continue
            rng = dopt._get_model_param_range_map(p)["param"]
            if rng.size == 0:
                continue
            tensors = dopt._get_main_param_and_optimizer_states(p)
            pieces.append((name, rng.start, rng.end, {k: v.detach().clone() for k, v in tensors.items()}))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    full, covered = {}, {}
    for rank_pieces in everyone:
        for name, start, end, tensors in rank_pieces:
            for k, v in tensors.items():
                if v.ndim == 0:  # the step
                    full.setdefault(name, {})[k] = v
                    continue
                flat = full.setdefault(name, {}).setdefault(k, torch.zeros(shapes[name].numel(), dtype=v.dtype))
                flat[start:end] = v
            covered[name] = covered.get(name, 0) + end - start
    for name, shape in shapes.items():
        assert covered.get(name) == shape.numel(), (name, covered.get(name), shape)
        for k, v in full[name].items():
            if v.ndim:
                full[name][k] = v.reshape(shape)
    return full


def checkpoint_keys(model) -> dict:
    """Parameter name -> (its key in the model's sharded state dict, its index along the stacked layer dim or None)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    by_data = {}
    for sh in nested_values(model.sharded_state_dict()):
        if isinstance(getattr(sh, "data", None), torch.Tensor):
            by_data[id(sh.data)] = sh.key
    keys = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        layer = int(parts[2]) if parts[:2] == ["decoder", "layers"] else None
        keys[name] = (by_data[id(p)], layer)
    return keys


def buffer_layout(model, optimizer) -> list:
    """Per grad buffer of the DDP wrapper (one per (param dtype, grad dtype)), as the dp_reshardable checkpoint lays
    its flat tensors out: each parameter's [start, end) in the buffer (reverse registration order, starts padded
    to 64 elements, the bucket to a multiple of lcm(DP, 128)), the padded and unpadded size."""
    names = {p: n for n, p in model.named_parameters()}
    layout = []
    for dopt in distributed_optimizers(optimizer):
        for buffer in dopt.buffers:
            params = sorted(((names[p], s, e, b) for p, (s, e, b) in buffer.param_index_map.items()), key=lambda t: t[1])
            layout.append(
                {
                    "dtype": (buffer.param_dtype, buffer.grad_dtype),
                    "numel": buffer.numel,
                    "numel_unpadded": buffer.numel_unpadded,
                    "params": params,
                }
            )
    return layout


def metadata_for(sharding_type: str) -> dict:
    """Megatron-LM's _build_sharded_state_dict_metadata (torch_dist, mcore >= 0.14)."""
    from megatron.core import parallel_state as ps

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    metadata["distrib_optim_sharding_type"] = sharding_type
    if sharding_type == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return metadata


def state_dict(model, optimizer, sharding_type: str, is_loading: bool = False) -> dict:
    """Megatron-LM's generate_state_dict for one model chunk (no args / rng / scheduler)."""
    metadata = metadata_for(sharding_type)
    state = {"checkpoint_version": 3.0, "iteration": ITERATION, "model": model.sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    return state


def save_all(out: Path, model, optimizer, sharding_types=TYPES) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    for sharding_type in sharding_types:
        folder = out / sharding_type
        if dist.get_rank() == 0:
            folder.mkdir(parents=True)
        dist.barrier()
        metadata = metadata_for(sharding_type)
        # --ckpt-fully-parallel-save (Megatron-LM's default): the data-parallel ranks share the writing
        strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), metadata["dp_cp_group"])
        dist_checkpointing.save(
            state_dict(model, optimizer, sharding_type),
            str(folder),
            strategy,
            content_metadata=_clean_metadata_for_serialization(metadata),
        )


@contextlib.contextmanager
def keep_torch_adam_step():
    """Load only, not a device shim: torch.optim.Adam keeps a per-parameter 'step' in its state;
    load_parameter_state_from_fully_reshardable leaves 'step' out of the tensors it hands to
    _set_main_param_and_optimizer_states ("Handle torch Adam "step" state separately", distrib_optimizer.py:2101;
    load_state_dict has just set it from the param groups), which then copies every key of the optimizer's state
    and raises KeyError: 'step' (distrib_optimizer.py:940). With TE's FusedAdam there is no such key. Here the
    missing 'step' is the optimizer's own, so the copy leaves it as load_state_dict set it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"].clone()}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def load_into_fresh(folder: Path, dtype: torch.dtype, sharding_type: str):
    """Megatron-LM's load path: a fresh model + optimizer, the sharded state dict with is_loading, then
    model.load_state_dict and optimizer.load_state_dict."""
    from megatron.core import dist_checkpointing

    model, ddp, optimizer = build(dtype, seed=999)  # other initial weights than the saved run
    # torch.optim.Adam (Megatron's fallback without Transformer Engine / Apex) has no state, and no 'step', before
    # its first step, and DistributedOptimizer.state_dict() then fails its `len(steps) == 1` assertion
    # (distrib_optimizer.py:642; with TE's FusedAdam the step is in param_groups). Megatron's own remedy, as its
    # fsdp_dtensor load path does: a zero-gradient step to create the state the load overwrites in place.
    for dopt in distributed_optimizers(optimizer):
        dopt._init_optimizer_states_with_dummy_values()
    request = state_dict(model, optimizer, sharding_type, is_loading=True)
    loaded = dist_checkpointing.load(request, str(folder))
    model.load_state_dict(loaded["model"])
    # no_grad: with fp32 parameters the optimizer's main parameters are views of the model parameters (leaves that
    # require grad), and load_parameter_state_from_dp_reshardable, unlike the other loaders, is not @torch.no_grad
    # (its copy_ raises "a view of a leaf Variable ... in-place"); with bf16 they are separate fp32 tensors.
    with torch.no_grad(), keep_torch_adam_step():
        optimizer.load_state_dict(loaded["optimizer"])
    return model, optimizer, loaded


def compare(expected: dict, actual: dict, loaded: dict, what: str) -> None:
    """Main params and Adam moments equal; the step as loaded (the param groups' 'step', which
    DistributedOptimizer.state_dict() saves for torch's Adam). The restored optimizer's own per-parameter 'step'
    is not compared: dp_reshardable keeps each 'step' as a LocalNonpersistentObject of the load template
    (distrib_optimizer.py:1663) and load_parameter_state_from_dp_reshardable copies it back over the step
    load_state_dict just set from the param groups, i.e. the fresh optimizer's dummy step."""
    steps = {g["step"] for g in loaded["optimizer"]["optimizer"]["param_groups"]}
    expected_steps = {v["step"].item() for v in expected.values()}
    assert steps == expected_steps, f"{what}: step {steps} != {expected_steps}"
    for name, tensors in expected.items():
        for k, v in tensors.items():
            if k == "step":
                continue
            assert torch.equal(v, actual[name][k]), f"{what}: {name}.{k} differs"


def main(out: Path) -> None:
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo")
    cpu_shims()
    CudaToCpu().__enter__()
    cuda_type_names()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = {}
    for label, dtype, sub in (("fp32", torch.float32, out), ("bf16", torch.bfloat16, out / "bf16")):
        t0 = time.time()
        model, ddp, optimizer = build(dtype, seed=0)
        train(ddp, optimizer, ITERATION)
        t1 = time.time()
        state = gathered_state(model, optimizer)
        save_all(sub, model, optimizer)
        t2 = time.time()
        reference[label] = {
            "state": state,
            "model": {n: p.detach().clone() for n, p in model.named_parameters()},
            "keys": checkpoint_keys(model),
            "buffers": buffer_layout(model, optimizer),
            "step": float(next(iter(state.values()))["step"]),
            "iteration": ITERATION,
        }
        for sharding_type in TYPES:  # Megatron's own load into a fresh model and optimizer, same world size
            fresh_model, fresh_opt, loaded = load_into_fresh(sub / sharding_type, dtype, sharding_type)
            compare(state, gathered_state(fresh_model, fresh_opt), loaded, f"{label}/{sharding_type} reload")
            for n, p in fresh_model.named_parameters():
                assert torch.equal(p, reference[label]["model"][n]), f"{label}/{sharding_type} model {n}"
        if rank == 0:
            print(f"{label}: train {t1 - t0:.1f}s save {t2 - t1:.1f}s reload-check {time.time() - t2:.1f}s", flush=True)
    if rank == 0:
        torch.save(reference, out / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


def check(out: Path) -> None:
    """Load every checkpoint in OUT on this world size (resharding over data parallel) and compare."""
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo")
    cpu_shims()
    CudaToCpu().__enter__()
    cuda_type_names()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    reference = torch.load(out / "reference.pt", weights_only=False)
    for label, dtype, sub in (("fp32", torch.float32, out), ("bf16", torch.bfloat16, out / "bf16")):
        for sharding_type in TYPES:
            model, optimizer, loaded = load_into_fresh(sub / sharding_type, dtype, sharding_type)
            compare(reference[label]["state"], gathered_state(model, optimizer), loaded, f"{label}/{sharding_type}")
            for n, p in model.named_parameters():
                assert torch.equal(p, reference[label]["model"][n]), f"{label}/{sharding_type} model {n}"
            if dist.get_rank() == 0:
                print(f"{label}/{sharding_type}: equal on {dist.get_world_size()} ranks", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # Megatron's writer starts a multiprocessing Manager (spawn): the module is imported again
    if sys.argv[1] == "--check":
        check(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
