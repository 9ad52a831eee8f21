"""Fixes for Triton's CPU interpreter (3.6 and 3.9), so it rounds as the GPU does:
- `tl.dot` on bf16 operands multiplies their raw uint16 bits. The patched dot widens bf16 operands
  to fp32 (exactly) first, as the GPU's MMA does.
- `x.to(tl.bfloat16)` from fp32 truncates the mantissa; the GPU (and torch) round to nearest even.
  The patched cast rounds through torch."""

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
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl  # create_fp_trunc and the other casts call it
    builder._bf16_cast_patched = True
