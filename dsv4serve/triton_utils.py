"""Small shared pieces of the Triton kernels."""

from __future__ import annotations

import torch
import triton

COUNTER_SLOTS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least) (a tl.arange length)."""
    return max(triton.next_power_of_2(max(n, 1)), least)


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's arrival counters (int32, zero between kernels): a kernel whose programs split one
    output's work counts arrivals per output and lets the last program finish it, then puts the
    counter back to zero. Allocated once per device (the first use is an eager warm-up, never inside
    a graph capture); kernels on one stream never use them at the same time."""
    assert needed <= COUNTER_SLOTS, needed
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[device]
