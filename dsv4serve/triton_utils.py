"""Small shared pieces of the Triton kernels: interpreter detection and launch helpers.

Under `TRITON_INTERPRET=1` (CI on the CPU) kernels run in Triton's interpreter on CPU tensors; there
every autotuned kernel gets one small config, so tests stay fast and deterministic.
"""

from __future__ import annotations

import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def configs(tuned: list[triton.Config], interpret: triton.Config) -> list[triton.Config]:
    """The autotuner's candidates on a GPU, the single `interpret` config in the interpreter."""
    return [interpret] if INTERPRET else tuned


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return max(triton.next_power_of_2(max(n, 1)), least)


def tl_dtype_is_fp32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32
