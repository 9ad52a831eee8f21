"""The linear op family and the weight formats the model math is agnostic of: every projection goes
through `linear(x, w)`.

A weight is a plain tensor (bf16 / fp16 / fp32; official FP8 blocks are dequantized at load), an
`Int8Weight`: W8A8 dynamic int8 with a symmetric per-output-channel weight scale and a symmetric
per-token activation scale, as compressed-tensors and msModelSlim checkpoints store it, or an
`Mxfp4Weight`: the official checkpoints' packed MXFP4 routed experts kept as stored, W4A16 (the
activations stay in their dtype; every decoded weight is exact in bf16, so the product equals the
float product of the decoded weight), or an `Fp8BlockWeight`: an official FP8 linear kept as stored
(e4m3, one scale per 128 x 128 block), W8A8 as DeepSeek's own inference runs it: the activations
quantized per token per 128 channels to e4m3 with a power-of-two scale
(`formats.quantize_fp8_activation`), the result the fp32 product of both dequantized operands (every
dequantized value is exact in bf16 and fp32).
This module holds the pure-PyTorch reference; device backends replace `linear` with fused kernels of
the same signature (e.g. torch_npu's quantized matmul).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv4serve.layers.formats import (
    FP8_BLOCK,
    MXFP4_BLOCK,
    dequantize_fp8_activation,
    dequantize_fp8_block,
    dequantize_mxfp4,
    quantize_fp8_activation,
)

INT8_MAX = 127.0


@dataclass(frozen=True)
class Int8Weight:
    """int8 weight (..., out, in) with fp32 scale (..., out); stacked experts index like a tensor."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __getitem__(self, index: int) -> Int8Weight:
        return Int8Weight(self.qweight[index], self.scale[index])

    def to(self, device: str | torch.device) -> Int8Weight:
        return Int8Weight(self.qweight.to(device), self.scale.to(device))

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape


@dataclass(frozen=True)
class Mxfp4Weight:
    """Packed e2m1 pairs (..., out, in / 2) uint8 (the low nibble the even element) with ue8m0 scales
    (..., out, in / 32) uint8, as the official checkpoints store routed experts; stacked experts index
    like a tensor. `shape` is the logical (..., out, in)."""

    packed: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        p, s = self.packed, self.scale
        if p.dtype != torch.uint8 or s.dtype != torch.uint8:
            raise ValueError(f"MXFP4 weight as uint8 packed values and scales, not {p.dtype} / {s.dtype}")
        if p.shape[:-1] != s.shape[:-1] or 2 * p.shape[-1] != MXFP4_BLOCK * s.shape[-1]:
            raise ValueError(f"MXFP4 packed {tuple(p.shape)} with scales {tuple(s.shape)}")

    def __getitem__(self, index: int) -> Mxfp4Weight:
        return Mxfp4Weight(self.packed[index], self.scale[index])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The decoded (..., out, in) weight (exact in bf16 and fp32)."""
        rows = self.packed.reshape(-1, self.packed.shape[-1])
        flat = dequantize_mxfp4(rows, self.scale.reshape(-1, self.scale.shape[-1]), dtype)
        return flat.view(self.shape)

    def to(self, device: str | torch.device) -> Mxfp4Weight:
        return Mxfp4Weight(self.packed.to(device), self.scale.to(device))


@dataclass(frozen=True)
class Fp8BlockWeight:
    """e4m3 weight (out, in) with fp32 block scales (ceil(out / 128), ceil(in / 128)), as the official
    FP8 linears store them (the ue8m0 exponents decoded once at load)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        q, s = self.qweight, self.scale
        grid = tuple(-(-d // b) for d, b in zip(q.shape, FP8_BLOCK, strict=True))
        if q.dtype != torch.float8_e4m3fn or s.dtype != torch.float32 or tuple(s.shape) != grid:
            shapes = f"{q.dtype} {tuple(q.shape)} with scales {s.dtype} {tuple(s.shape)}"
            raise ValueError(f"FP8 block weight {shapes} (expected e4m3 and fp32 {grid})")

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_block(self.qweight, self.scale, dtype)

    def to(self, device: str | torch.device) -> Fp8BlockWeight:
        return Fp8BlockWeight(self.qweight.to(device), self.scale.to(device))

    def rows(self, start: int, stop: int) -> Fp8BlockWeight:
        """Output rows start..stop (both multiples of the 128-row block) as a weight of their own."""
        assert start % FP8_BLOCK[0] == 0 and (stop % FP8_BLOCK[0] == 0 or stop == self.shape[0])
        b = FP8_BLOCK[0]
        return Fp8BlockWeight(self.qweight[start:stop], self.scale[start // b : -(-stop // b)])


Weight = torch.Tensor | Int8Weight | Mxfp4Weight | Fp8BlockWeight
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
    if isinstance(w, Mxfp4Weight):  # decoded per call: the weights stay as stored
        return F.linear(x, w.dequantized(x.dtype))
    if isinstance(w, Fp8BlockWeight):  # W8A8: the fp32 product of the dequantized operands
        rows = x.reshape(-1, x.shape[-1])
        a = dequantize_fp8_activation(*quantize_fp8_activation(rows))
        out = a @ w.dequantized(torch.float32).T
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)
    flat = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_activation(flat)
    # int8 x int8 products summed in fp32: exact while |sum| < 2**24, i.e. for in-features <= 1040
    # (127 * 127 * 1040); beyond that the reference rounds like any fp32 accumulation.
    acc = xq.float() @ w.qweight.float().T  # (T, out)
    out = acc * xs[:, None] * w.scale[None, :]
    return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def grouped_linear(
    x: torch.Tensor, w: Weight, groups: int, matmul: Callable[[torch.Tensor, Weight], torch.Tensor] = linear
) -> torch.Tensor:
    """Group g's slice of x's columns times group g's rows of w: x (T, groups * in), w (groups * R, in)
    -> (T, groups * R), out[:, g R:(g + 1) R] = x[:, g in:(g + 1) in] @ w[g R:(g + 1) R]^T, in x's dtype
    (DeepSeek-V4's grouped output projection `wo_a`). FP8 blocks (R a multiple of 128): each group a
    W8A8 `matmul` of its own rows; float: one batched product."""
    T, R = x.shape[0], w.shape[0] // groups
    if isinstance(w, Fp8BlockWeight):
        parts = x.reshape(T, groups, -1)
        return torch.cat([matmul(parts[:, g], w.rows(g * R, (g + 1) * R)) for g in range(groups)], dim=-1)
    assert isinstance(w, torch.Tensor), "grouped linear: float or FP8 blocks"
    grouped = x.reshape(T, groups, -1).transpose(0, 1)  # (G, T, in), a view
    per_group = w.view(groups, R, -1).transpose(1, 2)  # (G, in, R)
    # the bmm writes straight into (T, G, R) order: torch copies back itself where a device's bmm
    # takes no strided output
    out = torch.empty(T, groups * R, dtype=x.dtype, device=x.device)
    torch.bmm(grouped, per_group, out=out.view(T, groups, R).transpose(0, 1))
    return out


def quantize_weights_int8(weights: Mapping[str, Weight], names: Collection[str]) -> dict[str, Weight]:
    """Quantize the float weights named in `names` (the W8A8 projections of a loaded checkpoint) at
    load time; weights already `Int8Weight` (loaded from an int8 checkpoint) are kept as they are."""
    return {
        name: quantize_int8(w) if isinstance(w, torch.Tensor) and name in names else w
        for name, w in weights.items()
    }


def resident_bytes(weights: Mapping[str, Weight]) -> dict[str, int]:
    """Device bytes of a model's weights by format: `int8` (values and scales), `mxfp4` (packed values
    and scales), else the tensor's dtype name; a tensor held under two names (tied) counted once."""
    seen: set[tuple[int, int, torch.dtype]] = set()
    out: dict[str, int] = {}
    for w in weights.values():
        parts: tuple[torch.Tensor, ...]
        if isinstance(w, Int8Weight):
            fmt, parts = "int8", (w.qweight, w.scale)
        elif isinstance(w, Mxfp4Weight):
            fmt, parts = "mxfp4", (w.packed, w.scale)
        elif isinstance(w, Fp8BlockWeight):
            fmt, parts = "fp8", (w.qweight, w.scale)
        else:
            fmt, parts = str(w.dtype).removeprefix("torch."), (w,)
        for t in parts:
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in seen or t.numel() == 0:
                seen.add(key)
                out[fmt] = out.get(fmt, 0) + t.numel() * t.element_size()
    return dict(sorted(out.items()))
