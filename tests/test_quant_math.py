"""core/quant_math.py against the reference implementations in transformers, on numbers: each window ckpt computes
is bit-equal to the same elements of the reference's whole-tensor result."""

from __future__ import annotations

import pytest
import torch

from ckpt_cli.core import quant_math

fp8_module = pytest.importorskip("transformers.integrations.finegrained_fp8")
mxfp4_module = pytest.importorskip("transformers.integrations.mxfp4")


class _Quantizer:
    """What transformers' FP8 ops read from their quantizer: its config."""

    def __init__(self, block: tuple[int, int]) -> None:
        from transformers import FineGrainedFP8Config

        self.quantization_config = FineGrainedFP8Config(weight_block_size=list(block))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN included), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def random_fp8(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)


def reference_dequant(q: torch.Tensor, scales: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    op = fp8_module.Fp8Dequantize(_Quantizer((128, 128)))
    return op._dequantize_one(q, scales, output_dtype=out)


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_fp8_dequant_windows_equal_the_reference(out: torch.dtype, scale_dtype: torch.dtype) -> None:
    block, rows, cols = (16, 32), 64, 96
    q = random_fp8(rows, cols, 1)
    gen = torch.Generator().manual_seed(2)
    if scale_dtype == torch.uint8:  # E8M0 exponents, the extremes included
        scales = torch.randint(100, 150, (rows // 16, cols // 32), dtype=torch.uint8, generator=gen)
        scales[0, 0], scales[-1, -1] = 0, 254
    else:
        scales = (torch.rand(rows // 16, cols // 32, generator=gen) * 4 + 1e-3).to(scale_dtype)
    want = reference_dequant(q, scales, out)
    for cuts in ([0, rows], [0, 5, 16, 17, 40, rows], [0, 1, 2, rows]):  # windows that start and end inside blocks
        parts = []
        for r0, r1 in zip(cuts, cuts[1:]):
            s0, s1 = r0 // block[0], -(-r1 // block[0])
            parts.append(quant_math.dequant_fp8_rows(q[r0:r1], scales[s0:s1], block, r0, out))
        assert same_bits(torch.cat(parts), want)


def test_fp8_dequant_partial_blocks_equal_the_reference_on_the_padded_weight() -> None:
    """A trailing partial block (DeepSeek's 576 x 7168 in blocks of 128) has its own scale: the same values as the
    reference gives for the weight padded to whole blocks, cropped."""
    block, rows, cols = (16, 16), 40, 50
    q = random_fp8(rows, cols, 3)
    scales = torch.rand(3, 4, generator=torch.Generator().manual_seed(4)) + 0.5
    padded = torch.zeros(48, 64, dtype=torch.uint8).view(torch.float8_e4m3fn)
    padded[:rows, :cols] = q
    want = reference_dequant(padded, scales, torch.bfloat16)[:rows, :cols]
    got = torch.cat([quant_math.dequant_fp8_rows(q[:20], scales[:2], block, 0, torch.bfloat16),
                     quant_math.dequant_fp8_rows(q[20:], scales[1:], block, 20, torch.bfloat16)])  # fmt: skip
    assert same_bits(got, want)


def test_mxfp4_dequant_per_expert_equals_the_reference_with_extreme_exponents() -> None:
    experts, rows, groups = 3, 8, 4
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (experts, rows, groups), dtype=torch.uint8, generator=gen)
    scales[0, 0, 0], scales[1, 2, 3], scales[2, 7, 1] = 0, 254, 127  # 2**-127, 2**127 (6.0 * 2**127 is inf), 1
    for out in (torch.bfloat16, torch.float32):
        want = mxfp4_module.convert_moe_packed_tensors(blocks, scales, dtype=out)
        got = torch.cat([quant_math.dequant_mxfp4(blocks[e : e + 1], scales[e : e + 1], out).transpose(1, 2) for e in range(experts)])
        assert same_bits(got, want)
    assert torch.isinf(want).any()  # the 254 row reaches past bf16's range, as the reference has it


def test_fp8_quant_per_block_row_equals_the_reference() -> None:
    block, rows, cols = (128, 128), 256, 384
    weight = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(6)) * 3).to(torch.bfloat16)
    weight[:128, :128] = 0  # an all-zero block keeps scale 1
    ref = fp8_module.Fp8Quantize(_Quantizer(block))._quantize_one("layer.weight", weight)
    values, inverse = zip(*(quant_math.quant_fp8_block(weight[r : r + 128], block) for r in range(0, rows, 128)))
    assert same_bits(torch.cat(values), ref["layer.weight"])
    assert same_bits(torch.stack(inverse), ref["layer.weight_scale_inv"])
    assert float(ref["layer.weight_scale_inv"][0, 0]) == 1.0
    # the round trip: ckpt's dequantization of ckpt's quantization is the reference's of the reference's
    mine = quant_math.dequant_fp8_rows(torch.cat(values), torch.stack(inverse), block, 0, torch.bfloat16)
    assert same_bits(mine, reference_dequant(ref["layer.weight"], ref["layer.weight_scale_inv"], torch.bfloat16))


def test_e8m0_bytes_are_powers_of_two_with_bias_127() -> None:
    got = quant_math.scales_as_float32(torch.tensor([0, 127, 128, 254], dtype=torch.uint8))
    assert got.tolist() == [2.0**-127, 1.0, 2.0, 2.0**127]


def test_a_block_far_larger_than_the_weight_costs_no_memory() -> None:
    """A config may claim blocks of 2**30: the scale of each element is found by index, not by expanding blocks."""
    q = random_fp8(4, 6, 7)
    scale = torch.tensor([[0.5]])
    got = quant_math.dequant_fp8_rows(q, scale, (1 << 30, 1 << 30), 0, torch.float32)
    assert same_bits(got, q.to(torch.float32) * 0.5)


# DeepSeek's scale grid is ceil(rows / 128) x ceil(cols / 128) (V3's kv_a_proj_with_mqa: [576, 7168], scales [5, 56]).
# The references are transformers' own code, run here: its `Fp8Quantize` leaves a weight the block does not tile
# unquantized, so it is run on the weight padded with zeros to whole blocks and cropped (zeros change no block's amax,
# so each edge block's scale is the one over the elements it has); DeepSeek-V3's repository has no weight quantizer
# (inference/kernel.py quantizes activations and dequantizes weights). Dequantization is compared with transformers'
# `_dequantize_fp8_weight`, which takes the ceil grid as it is (one float32 product, as DeepSeek's weight_dequant).
PARTIAL_SHAPES = [(72, 112), (40, 100), (48, 96), (96, 40), (9, 10), (1, 128), (130, 300), (2, 36, 50)]
PARTIAL_IDS = ["576x7168-like", "rows-and-cols", "cols-partial", "rows-partial", "under-one-block", "one-row", "one-over", "stacked"]


def reference_quant_padded(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(*lead, grid[0] * block[0], grid[1] * block[1], dtype=weight.dtype)
    padded[..., :rows, :cols] = weight
    ref = fp8_module.Fp8Quantize(_Quantizer(block))._quantize_one("layer.weight", padded)
    return ref["layer.weight"][..., :rows, :cols].contiguous(), ref["layer.weight_scale_inv"]


@pytest.mark.parametrize("shape", PARTIAL_SHAPES, ids=PARTIAL_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_quant_of_partial_blocks_equals_the_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    block = (16, 32)
    gen = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(*shape, generator=gen) * 5).to(dtype)
    weight[..., -1:, -1:] = 0  # an edge block with a zero
    if shape[-2] > 16 and shape[-1] > 32:
        weight[..., 16:, 32:] = 0  # a wholly zero edge block keeps scale 1
    want_values, want_scales = reference_quant_padded(weight, block)
    *lead, rows, cols = shape
    values, scales = [], []
    for m in range(lead[0] if lead else 1):
        matrix = weight[m] if lead else weight
        for r in range(0, rows, block[0]):
            v, s = quant_math.quant_fp8_block(matrix[r : r + block[0]], block)
            values.append(v)
            scales.append(s)
    got_values = torch.cat(values).reshape(shape)
    got_scales = torch.stack(scales).reshape(want_scales.shape)
    assert got_scales.shape[-2:] == (-(-rows // block[0]), -(-cols // block[1]))
    assert same_bits(got_values, want_values) and same_bits(got_scales, want_scales)
    # dequantized, with the ceil grid as it is, it is what transformers' own dequantization of it gives
    ref_dequant = fp8_module._dequantize_fp8_weight(want_values, want_scales, list(block), torch.float32)
    mats = [(got_values[m], got_scales[m]) for m in range(lead[0])] if lead else [(got_values, got_scales)]
    mine = torch.stack([quant_math.dequant_fp8_rows(v, s, block, 0, torch.float32) for v, s in mats]).reshape(shape)
    assert same_bits(mine, ref_dequant)
