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
FP8_ACT_BLOCK = 128  # FP8 linears' activations: one scale per token per 128 channels
E4M3_MAX = 448.0
FP8_ACT_AMAX_MIN = 1e-4  # an all-zero block still gets a finite scale (as DeepSeek's act_quant)
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
    if n % bn == 0 and k % bk == 0:  # whole blocks: each scale broadcast over its block, no (N, K) copy
        blocks = weight.float().view(n // bn, bn, k // bk, bk) * s[:, None, :, None].to(weight.device)
        return blocks.view(n, k).to(dtype)
    s = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]  # (N, K)
    return (weight.float() * s.to(weight.device)).to(dtype)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(v)) for positive normal fp32 v, exactly (from the exponent bits: a log2 that rounds
    a value just above a power of two down to it would give a scale one binade too small)."""
    mantissa, exponent = torch.frexp(v.float())  # v = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(mantissa), exponent - (mantissa == 0.5).to(exponent.dtype))


def quantize_fp8_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, K) activations as the FP8 linears' W8A8 reads them: per token per 128 channels (the last
    block may be shorter) the power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) (ue8m0, as the
    official checkpoints' `scale_fmt`), the values / scale rounded to nearest-even e4m3 (never past 448).
    Returns e4m3 (T, K) and fp32 scales (T, ceil(K / 128))."""
    t, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % FP8_ACT_BLOCK))
    blocks = padded.view(t, -1, FP8_ACT_BLOCK)
    scale = pow2_ceil(blocks.abs().amax(dim=-1).clamp(min=FP8_ACT_AMAX_MIN) / E4M3_MAX)
    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(t, -1)[:, :k]
    return q.contiguous(), scale


def dequantize_fp8_activation(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 (T, K) with scales (T, ceil(K / 128)) -> fp32 (T, K): exact (e4m3 times a power of two)."""
    return q.float() * scale.repeat_interleave(FP8_ACT_BLOCK, dim=1)[:, : q.shape[1]]


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


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float (..., N, K) weight as MXFP4, as the official checkpoints store experts: per 32 weights
    along K the power of two 2^e, e = ceil(log2(amax / 6)) (6: the largest e2m1 magnitude), and each
    weight / 2^e rounded to the nearest e2m1 value. Returns packed pairs (..., N, K/2) and ue8m0 scales
    (..., N, K/32), both uint8 (`dequantize_mxfp4` reads them back)."""
    *lead, n, k = w.shape
    if k % MXFP4_BLOCK or k % 2:
        raise ValueError(f"MXFP4 needs in-features a multiple of {MXFP4_BLOCK}, not {k}")
    blocks = w.float().reshape(*lead, n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = (blocks / torch.exp2(e)).reshape(*lead, n, k)
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    index = torch.bucketize(scaled.abs(), (mags[1:] + mags[:-1]) / 2)  # nearest magnitude, 0..7
    codes = (index | ((scaled < 0).to(index.dtype) << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (e.squeeze(-1) + 127).to(torch.uint8)


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float (N, K) weight as the official FP8 linears store it: per block of 128 x 128 the power of two
    2^e, e = ceil(log2(amax / 448)) (448: e4m3's largest value; amax at least 1e-4), the weights / 2^e
    cast to e4m3. Returns the e4m3 (N, K) weight and the ue8m0 scales (N / 128, K / 128) as uint8."""
    n, k = w.shape
    bn, bk = block
    padded = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    e = torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4) / 448.0))
    q = (blocks / torch.exp2(e)[:, None, :, None]).to(torch.float8_e4m3fn).view(padded.shape)[:n, :k]
    return q.contiguous(), (e + 127).to(torch.uint8)
