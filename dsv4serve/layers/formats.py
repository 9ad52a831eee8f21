"""The official checkpoints' low-precision weight formats, decoded: FP8 blocks and MXFP4.

FP8 (DeepSeek-V4's linears): e4m3 values with one scale per 128x128 block, a ue8m0 exponent byte
(or an fp32 value): `W[n, k] = float(Wq[n, k]) * S[n // 128, k // 128]`.
MXFP4 (DeepSeek-V4's routed experts): `X.weight` int8 [N, K/2] holds two e2m1 codes per byte, the low
nibble being element 2j and the high nibble element 2j+1 along K; `X.scale` ue8m0 [N, K/32] holds one
power-of-two exponent per 32 weights: `W[n, k] = E2M1[code] * 2^(S[n, k // 32] - 127)`. Every such
value is exact in bf16 and fp32, so decoding loses nothing. A scale of the wrong shape is a ValueError.
"""

from __future__ import annotations

import math

import torch

FP8_BLOCK = (128, 128)  # official FP8 linears: one scale per 128x128 block
MXFP4_BLOCK = 32  # weights per ue8m0 scale along K
# e2m1 code -> value; bit 3 is the sign, bits 2-1 the exponent, bit 0 the mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponent bytes (float8_e8m0fnu or uint8) -> fp32 2^(e-127); 0xFF -> NaN."""
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    assert raw.dtype == torch.uint8, raw.dtype
    ones = torch.ones(raw.shape, dtype=torch.float32, device=raw.device)
    out = torch.ldexp(ones, raw.to(torch.int32) - 127)
    return out.masked_fill(raw == 0xFF, math.nan)


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """W[n, k] = float(Wq[n, k]) * S[n // bn, k // bk]; S is ue8m0 or fp32, one entry per block."""
    n, k = weight.shape
    bn, bk = block
    grid = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale.shape) != grid:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match {grid} blocks of {block}")
    s = decode_e8m0(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float()
    s = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]  # (N, K)
    return (weight.float() * s).to(dtype)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed e2m1 pairs (N, K/2) int8/uint8 with ue8m0 scales (N, K/32) -> (N, K) in `dtype`."""
    assert packed.dtype in (torch.int8, torch.uint8) and packed.dim() == 2, packed.dtype
    n, half = packed.shape
    k = 2 * half
    if tuple(scale.shape) != (n, k // MXFP4_BLOCK) or k % MXFP4_BLOCK:
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match {n} rows of {k} weights in "
            f"blocks of {MXFP4_BLOCK}"
        )
    raw = packed.view(torch.uint8)
    codes = torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(n, k)  # (N, K): low nibble first
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=raw.device)[codes.long()]  # (N, K)
    s = decode_e8m0(scale.view(torch.uint8)).repeat_interleave(MXFP4_BLOCK, dim=1)  # (N, K)
    return (values * s).to(dtype)
