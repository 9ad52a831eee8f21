"""The W8A8 linear on Ascend through torch_npu (the `npu` backend's `linear`).

Written against the documented torch_npu API (op-plugin docs `torch_npu-npu_dynamic_quant.md`,
`torch_npu-npu_quant_matmul.md`).
**This code has never run on an Ascend NPU**; the tests check its argument plumbing against a fake
`torch_npu` that implements the documented semantics in plain PyTorch.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from dsv4serve.layers.linear import Fp8BlockWeight, Int8Weight, Mxfp4Weight, Weight
from dsv4serve.layers.linear import linear as reference_linear

# npu_dynamic_quant takes float16 / bfloat16 only, and npu_quant_matmul's per-token rows produce
# float16 / bfloat16 only (A2/A3 dtype table); other activations take the reference.
NPU_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
# "x1 and x2's last dimension must not exceed 65535" (npu_quant_matmul constraints).
MAX_INNER_DIM = 65535


def npu_linear(x: torch.Tensor, w: Weight, *, npu: ModuleType) -> torch.Tensor:
    """Same contract as `layers.linear.linear`: x (..., in) @ w^T -> (..., out) in x's dtype.

    Plain weights use torch's own matmul. `Int8Weight` with fp16 / bf16 activations runs
    `npu_dynamic_quant` (per-token symmetric int8, scale = rowmax|x| / 127) and `npu_quant_matmul`
    (x1 int8 (T, in), x2 = the (out, in) weight as its transposed view (in, out), fp32 per-channel
    scale, fp32 per-token scale, output in x's dtype). Unlike the reference, the documented dynamic
    quant does not guard all-zero rows (their scale is 0).
    """
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    if isinstance(w, Mxfp4Weight | Fp8BlockWeight) or x.dtype not in NPU_ACTIVATION_DTYPES:
        return reference_linear(x, w)  # MXFP4 / FP8 blocks: decoded per call
    _check_int8_linear(x, w)
    flat = x.reshape(-1, x.shape[-1])  # (T, in)
    xq, xs = npu.npu_dynamic_quant(flat)  # (T, in) int8, (T,) fp32
    out = npu.npu_quant_matmul(
        xq, w.qweight.t(), w.scale, pertoken_scale=xs, output_dtype=x.dtype
    )  # (T, out)
    return out.reshape(*x.shape[:-1], -1)


def _check_int8_linear(x: torch.Tensor, w: Int8Weight) -> None:
    out_features, in_features = w.qweight.shape
    assert w.qweight.dtype == torch.int8, w.qweight.dtype
    assert w.scale.dtype == torch.float32 and w.scale.shape == (out_features,), w.scale.shape
    assert x.shape[-1] == in_features, (x.shape, w.qweight.shape)
    assert in_features <= MAX_INNER_DIM and out_features <= MAX_INNER_DIM, w.qweight.shape
