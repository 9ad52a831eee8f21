"""Host -> device copies that never wait for the device.

A plain `.to("cuda")` of a pageable tensor waits for the work already queued on the stream; a step
planned while the previous one runs must not. Staged through pinned memory (the caching host
allocator keeps a block until its copy has run) and copied asynchronously, in stream order.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
