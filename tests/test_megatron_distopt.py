"""Megatron-Core's DistributedOptimizer in torch_dist checkpoints, saved by Megatron's own dist_checkpointing.save on the
CPU (tests/producers/megatron_distopt.py: GPTModel, data parallel 2, Megatron DDP + DistributedOptimizer, Adam, 2 steps;
fp32 and bf16; the two sharding types Megatron-LM saves). The reference is the optimizer's own state gathered from
every rank through its accessors, not through the checkpoint; the producer also loads each save back with Megatron's
dist_checkpointing.load on 2 processes and checks it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import torchrun

from ckpt_cli import api

pytest.importorskip("megatron.core", reason="megatron-core is installed by the test extra")

DTYPES = {"fp32": "", "bf16": "bf16/"}
KINDS = ("param", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def distopt(tmp_path_factory):
    out = tmp_path_factory.mktemp("distopt")
    torchrun(2, "megatron_distopt.py", out, timeout=600)
    return out, torch.load(out / "reference.pt", weights_only=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_reshardable_state_is_read_per_parameter(ckpt, distopt, dtype):
    """--dist-ckpt-optim-fully-reshardable: the fp32 main parameter and both Adam moments of every parameter, at the
    model's key and shape (layers stacked), equal what the optimizer held; the step is the run's."""
    out, reference = distopt
    ref = reference[dtype]
    folder = out / f"{DTYPES[dtype]}fully_reshardable"
    c = api.open(folder)
    assert c.format == "megatron" and c.step == ref["iteration"]
    for name, (key, layer) in ref["keys"].items():
        for kind in KINDS:
            got = c[f"optimizer.state.{kind}.{key}"]
            got = got if layer is None else got[layer]
            want = ref["state"][name][kind]
            assert got.dtype == torch.float32 and torch.equal(got, want), (name, kind)
    groups = c.objects["optimizer.optimizer.param_groups"]
    assert {g["step"] for g in groups} == {ref["step"]}
    assert ckpt("verify", folder, "--deep").code == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_dp_reshardable_buckets_are_read_as_saved(ckpt, distopt, dtype):
    """Megatron-LM's default (dp_reshardable): per DDP buffer and bucket, flat fp32 tensors of the main parameters and
    Adam moments in buffer order (reverse registration order, one chunk per parameter piece, the piece that
    straddles the two ranks' halves in two). Each parameter's range of each flat tensor equals the optimizer's state;
    the bucket sizes and the param groups (with the step) are read from their ShardedObjects."""
    out, reference = distopt
    ref = reference[dtype]
    folder = out / f"{DTYPES[dtype]}dp_reshardable"
    c = api.open(folder)
    flat = {n for n in c if n.startswith("optimizer.distributed.")}
    prefix = "optimizer.distributed.dp_group_idx_0"
    for index, buffer in enumerate(ref["buffers"]):
        dtypes = ", ".join(str(d) for d in buffer["dtype"])
        for kind in KINDS:
            name = f"{prefix}.gbuf_idx_{index}.dtype_({dtypes}).bucket_idx_0.{kind}"
            assert name in flat, (name, sorted(flat))
            whole = c[name]
            assert whole.shape == (buffer["numel_unpadded"],)
            for param, start, end, bucket in buffer["params"]:
                assert bucket == 0 and torch.equal(whole[start:end], ref["state"][param][kind].flatten()), (param, kind)
    assert len(flat) == 3 * len(ref["buffers"])
    groups = c.objects[f"{prefix}.optimizer/shard_0_1"]
    assert {g["step"] for g in groups[0]["param_groups"]} == {ref["step"]}
    res = ckpt("inspect", folder, "--json")
    assert json.loads(res.out)["training_state"]["optimizer"]["states"] == sorted(KINDS)
    assert ckpt("verify", folder, "--deep").code == 0
