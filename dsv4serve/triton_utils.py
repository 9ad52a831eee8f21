"""Small shared pieces of the Triton kernels."""

from __future__ import annotations

import triton


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least) (a tl.arange length)."""
    return max(triton.next_power_of_2(max(n, 1)), least)
