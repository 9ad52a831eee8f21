"""DeepSeek-V4's lightning indexer in int8 (`indexer_quant="int8"`), as Ascend serves it: the index keys
and queries go through the normalized Hadamard rotation, then are quantized per row (per token, per
head for the queries) to int8 with one scale each, rowmax|x| / 127, kept in fp16 (the dequant scales
Ascend's quantized indexer takes). A score is sum_h w_h relu(sq_h sk_j (q_h . k_j)) * softmax scale, the
int8 dot products exact in fp32 (|sum| <= 127^2 * 128 < 2^24).

The rotation is orthonormal, so the unquantized scores are unchanged by it; it spreads outliers over
the row before the rounding. The picks differ from the model-dtype indexer's where two scores lie within
the quantization error; the rest of the model is unchanged. The key pool is a quarter of the bf16 one
plus a 2-byte scale per entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4serve.attention.hadamard import hadamard_transform

INT8_MAX = 127.0


@dataclass(frozen=True)
class Int8Rows:
    """A pool of rows kept as int8 with one fp16 dequant scale each (flat views, one row per slot)."""

    data: torch.Tensor  # (slots, D) int8
    scale: torch.Tensor  # (slots, 1) fp16

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 (as `npu_dynamic_quant`): q = round(x / s), s = rowmax|x| / 127 (fp32).
    x (..., D) -> q (..., D) int8, s (...) fp32; an all-zero row gives q = 0, s = 0."""
    xf = x.float()
    scale = xf.abs().amax(-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, 1.0)[..., None]
    return torch.round(xf / safe).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x -> (int8, fp32 scale a row)


def rotate_quantize(x: torch.Tensor, quant: Quantize = quantize_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation (in x's dtype, as the model computes it), then `quant` (`quantize_rows`, or a
    device's op of the same contract: `npu_dynamic_quant`); the scale in fp16."""
    q, scale = quant(hadamard_transform(x))
    return q, scale.half()


def store_rows(
    out: torch.Tensor | Int8Rows, slots: torch.Tensor, rows: torch.Tensor, quant: Quantize = quantize_rows
) -> None:
    """rows (N, D) written at `slots` of `out`: as they are, or rotated and quantized into int8 rows."""
    if isinstance(out, Int8Rows):
        q, scale = rotate_quantize(rows, quant)
        out.data.index_copy_(0, slots, q)
        out.scale.index_copy_(0, slots, scale[:, None])
    else:
        out.index_copy_(0, slots, rows.to(out.dtype))


def int8_scores(
    q: torch.Tensor, q_scale: torch.Tensor, keys: torch.Tensor, k_scale: torch.Tensor, head_w: torch.Tensor
) -> torch.Tensor:
    """sum_h head_w[t, h] relu(q_scale[t, h] k_scale[t, j] (q[t, h] . keys[t, j])): (T, J) fp32.

    q (T, Hi, Di) int8, q_scale (T, Hi) fp16; keys (T, J, Di) int8, k_scale (T, J) fp16; head_w (T, Hi)
    fp32 (the softmax scale folded in)."""
    dots = torch.einsum("thd,tjd->thj", q.float(), keys.float())  # exact integers in fp32
    scaled = dots * q_scale.float()[:, :, None] * k_scale.float()[:, None, :]
    return (torch.relu(scaled) * head_w.float()[:, :, None]).sum(dim=1)
