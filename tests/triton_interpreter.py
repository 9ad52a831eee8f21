"""Fixes for Triton's CPU interpreter (3.6 and 3.9), so it rounds as the GPU does:
- `tl.dot` on bf16 operands multiplies their raw uint16 bits. The patched dot widens bf16 operands
  to fp32 (exactly) first, as the GPU's MMA does.
- `x.to(tl.bfloat16)` from fp32 truncates the mantissa; the GPU (and torch) round to nearest even.
  The patched cast rounds through torch.
- `x.to(tl.float8e4nv)` from fp32 drops the carry of a mantissa rounded up (7.84 -> 4, not 8); the
  GPU's cvt.rn.satfinite and torch round to nearest even. The patched cast rounds through torch."""

from __future__ import annotations

import numpy as np
import torch


def patch_bf16_dot() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_bf16_dot_patched", False):
        return
    original = builder.create_dot

    def widen(h: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    builder._bf16_dot_patched = True


def _as_float32(h: object) -> np.ndarray:
    import triton.language as tl

    data = h.data  # type: ignore[attr-defined]
    if h.dtype.scalar == tl.bfloat16:  # type: ignore[attr-defined]
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data


def patch_bf16_cast() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_bf16_cast_patched", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        if src.dtype.scalar in (tl.float32, tl.bfloat16) and dst_type.scalar == tl.float8e4nv:
            wide = torch.from_numpy(np.ascontiguousarray(_as_float32(src), dtype=np.float32))
            raw = wide.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(raw, tl.float8e4nv)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl  # create_fp_trunc and the other casts call it
    to_fp = builder.create_fp_to_fp  # fp32 -> fp8 goes here, not through cast_impl

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.bfloat16):
            return cast_impl(self, src, dst_type)
        return to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp
    builder._bf16_cast_patched = True
