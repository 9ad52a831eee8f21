"""The linear op family and the weight formats the model math is agnostic of: every projection goes
through `linear(x, w)`.

A weight is either a plain tensor (bf16 / fp16 / fp32; official FP8 blocks are dequantized at load)
or an `Int8Weight`: W8A8 dynamic int8 with a symmetric per-output-channel weight scale and a
symmetric per-token activation scale, as compressed-tensors and msModelSlim checkpoints store it.
This module holds the pure-PyTorch reference; device backends replace `linear` with fused kernels of
the same signature (e.g. torch_npu's quantized matmul).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT8_MAX = 127.0


@dataclass(frozen=True)
class Int8Weight:
    """int8 weight (..., out, in) with fp32 scale (..., out); stacked experts index like a tensor."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __getitem__(self, index: int) -> Int8Weight:
        return Int8Weight(self.qweight[index], self.scale[index])

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape


Weight = torch.Tensor | Int8Weight
Weights = dict[str, Weight]  # a model's tensors by name, as the loader hands them to its builder


def plain(w: Weights, name: str) -> torch.Tensor:
    """A tensor that is never quantized (norms, mHC, sinks, compressor, router, embeddings, head)."""
    value = w[name]
    assert isinstance(value, torch.Tensor), f"{name} must stay a plain tensor"
    return value


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 quantization of a (..., out, in) weight."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / INT8_MAX  # (..., out)
    q = torch.round(w.float() / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: (int8 values (T, in), fp32 scale (T,))."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-12) / INT8_MAX
    return torch.round(x.float() / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x (..., in) @ w^T -> (..., out) in x's dtype."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    flat = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_activation(flat)
    # int8 x int8 products summed in fp32: exact while |sum| < 2**24, i.e. for in-features <= 1040
    # (127 * 127 * 1040); beyond that the reference rounds like any fp32 accumulation.
    acc = xq.float() @ w.qweight.float().T  # (T, out)
    out = acc * xs[:, None] * w.scale[None, :]
    return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def quantize_weights_int8(weights: Mapping[str, Weight], names: Collection[str]) -> dict[str, Weight]:
    """Quantize the float weights named in `names` (the W8A8 projections of a loaded checkpoint) at
    load time; weights already `Int8Weight` (loaded from an int8 checkpoint) are kept as they are."""
    return {
        name: quantize_int8(w) if isinstance(w, torch.Tensor) and name in names else w
        for name, w in weights.items()
    }
