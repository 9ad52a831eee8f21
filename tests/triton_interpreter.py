"""A fix for Triton's CPU interpreter (3.6 and 3.9): `tl.dot` on bf16 operands multiplies their raw
uint16 bits. The patched dot widens bf16 operands to fp32 (exactly) first, as the GPU's MMA does."""

from __future__ import annotations

import numpy as np


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
