"""The arithmetic of quantized weights, one window at a time: FP8 block-scaled and MXFP4 dequantization, FP8 block
quantization. Each function does, element for element, what the reference implementation does (transformers'
`Fp8Dequantize`, `Fp8Quantize` and `convert_moe_packed_tensors`), so a window computed here is bit-equal to the same
elements of the reference's whole-tensor result; tests/test_quant_math.py compares them.
"""

from __future__ import annotations

import math
from typing import Any

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: the DeepSeek recipe divides each block's amax by it
E8M0_BIAS = 127  # an E8M0 byte b is the scale 2 ** (b - 127) (OCP MX); 255 is NaN
# The E2M1 (FP4) values of a nibble 0..15, as transformers' gpt-oss integration and the OCP MX spec have them.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scales_as_float32(scales: Any) -> Any:
    """Stored scales as float32 multipliers: E8M0 exponents stored as uint8 are 2 ** (b - 127), as the reference
    reads them; float8_e8m0fnu, bf16, fp16 and fp32 scales are cast."""
    import torch

    if scales.dtype == torch.uint8:
        return (scales.to(torch.float32) - float(E8M0_BIAS)).exp2()
    return scales.to(torch.float32)


def dequant_fp8_rows(q: Any, scales: Any, block: tuple[int, int], row0: int, out_dtype: Any) -> Any:
    """Rows [row0, row0 + len(q)) of one FP8 matrix, dequantized: each element times the float32 scale of its
    block, in float32, then cast to `out_dtype`. `scales` are the scale rows from block row row0 // block[0] on
    (a trailing partial block has its own scale: the DeepSeek layout, ceil(rows / 128) x ceil(cols / 128))."""
    import torch

    rows, cols = q.shape
    scale = scales_as_float32(scales)
    if scale.numel() == 1:  # one scale for the whole tensor
        return (q.to(torch.float32) * scale.reshape(())).to(out_dtype)
    bm, bn = block
    # Each row's block scales by index (not repeat_interleave over the block: a block far larger than the window, as
    # a hostile config may claim, would then allocate block-sized rows), broadcast over the columns of each block;
    # the product is cast as it is stored into the output (one float32 product, one rounding, as the reference).
    per_row = scale[torch.arange(row0, row0 + rows) // bm - row0 // bm]
    values = q.to(torch.float32)
    out = torch.empty(rows, cols, dtype=out_dtype)
    whole, rest = divmod(cols, bn) if bn < cols else (0, cols)
    if whole:
        span = whole * bn
        torch.mul(values[:, :span].view(rows, whole, bn), per_row[:, :whole, None], out=out[:, :span].view(rows, whole, bn))
    if rest:
        torch.mul(values[:, whole * bn :], per_row[:, whole : whole + 1], out=out[:, whole * bn :])
    return out


def dequant_mxfp4(blocks: Any, scales: Any, out_dtype: Any) -> Any:
    """MXFP4 `blocks` (..., G, 16) uint8, two E2M1 values a byte, low nibble first, and `scales` (..., G) E8M0 bytes,
    as (..., G * 32) values of `out_dtype`: the table value in `out_dtype`, times 2 ** (scale - 127) by ldexp."""
    import torch

    *prefix, groups, width = blocks.shape
    rows = math.prod(prefix) * groups
    lut = torch.tensor(FP4_VALUES, dtype=out_dtype)
    packed = blocks.reshape(rows, width).to(torch.uint8)
    exponents = scales.reshape(rows, 1).to(torch.int32) - E8M0_BIAS
    out = torch.empty(rows, width * 2, dtype=out_dtype)
    out[:, 0::2] = lut[(packed & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(packed >> 4).to(torch.int)]
    torch.ldexp(out, exponents, out=out)
    return out.reshape(*prefix, groups * width * 2)


def quant_fp8_block(rows: Any, block: tuple[int, int]) -> tuple[Any, Any]:
    """One block row of a matrix (at most block[0] rows) as float8_e4m3fn values and their float32 inverse scales,
    one per block: amax / 448 per block, zeros kept at scale 1. A trailing partial block (columns, or rows, not a
    multiple of the block: DeepSeek's ceil(rows / 128) x ceil(cols / 128) grid) has its own scale, over the elements
    it has; it is computed as a whole block is, on the band padded with zeros (which leave every block's amax as it
    is), and cropped."""
    import torch

    fp8 = torch.float8_e4m3fn
    bn = block[1]
    height, cols = rows.shape
    tiles_n = -(-cols // bn)
    data = rows.to(torch.float32)
    if tiles_n * bn != cols:
        data = torch.nn.functional.pad(data, (0, tiles_n * bn - cols))
    tiles = data.reshape(1, height, tiles_n, bn)
    max_abs = tiles.abs().amax(dim=(-3, -1))
    safe_max_abs = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = FP8_MAX / safe_max_abs
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inverse = (1.0 / scales).to(torch.float32)
    scaled = tiles * scales.unsqueeze(-1).unsqueeze(-3)
    finfo = torch.finfo(fp8)
    values = torch.clamp(scaled, min=finfo.min, max=finfo.max).to(fp8).reshape(height, tiles_n * bn)
    return values[:, :cols].contiguous(), inverse.reshape(tiles_n)


def unpack_int_from_int32(words: Any, num_bits: int, cols: int) -> Any:
    """compressed-tensors' pack-quantized values: `num_bits` (4 or 8) a value, packed along the last dim into int32
    words low bits first, each stored as value + 2 ** (num_bits - 1); returns int8 values, `cols` of them a row."""
    import torch

    if num_bits not in (4, 8):
        raise ValueError(f"packed {num_bits}-bit values")
    rows = words.shape[0]
    data = words.contiguous().view(torch.uint8).reshape(rows, -1)  # little-endian words: their bytes low first
    if num_bits == 4:
        data = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(rows, -1)
    return (data[:, :cols].to(torch.int16) - (1 << (num_bits - 1))).to(torch.int8)


def unpack_fp4(packed: Any) -> Any:
    """NVFP4 (compressed-tensors) values: two E2M1 a byte, low nibble first, as bfloat16 (its unpack's dtype)."""
    import torch

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    rows = packed.shape[0]
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(rows, -1)
    return lut[nibbles.to(torch.long)].to(torch.bfloat16)


def dequant_scaled(values: Any, scales: Any, zero_points: Any, block: tuple[int, int], row0: int, global_scale: Any = None) -> Any:
    """compressed-tensors' `_dequantize` for rows [row0, row0 + len(values)): the scale divided by the global scale
    (NVFP4), values (and zero points) cast to the scale's dtype, the zero point subtracted, times the scale of each
    element's block; the result in the scale's dtype. `scales` and `zero_points` are the rows of scales from
    row0 // block[0] on; each covers `block` (tensor: the whole matrix; channel: a row; group: 1 x g)."""
    import torch

    if global_scale is not None:
        scales = scales / global_scale
    rows, cols = values.shape
    row_block = torch.arange(row0, row0 + rows) // block[0] - row0 // block[0]
    col_block = torch.arange(cols) // block[1]
    out = values.to(scales.dtype)
    if zero_points is not None:
        out = out - zero_points[row_block][:, col_block].to(scales.dtype)
    return out * scales[row_block][:, col_block]
