"""Device buffers of any KV layout (`layout.py`), in Ascend PA_ND layout [pages + 1, P, 1, width].

One buffer per (buffer spec, layer); page 0 of every pool is the skip sentinel. A slot id addresses
the same row in every layer's buffer of its pool (`flat(name)` views each as [slots, width]).

Buffers are allocated with `torch.empty`: no value in them is relied on. Reads of rows nobody wrote
(padded window lists, masked top-k picks, sentinel slots, stale table entries, state rows) are
selected out in every backend, never multiplied by zero, so a pool full of NaN or +-inf serves the
same tokens (tests/test_pool_poison.py). `state_sentinel` gives each state pool's padding slot.
"""

from __future__ import annotations

import torch

from dsv4serve.config import EngineConfig
from dsv4serve.memory.layout import KVLayout
from dsv4serve.memory.paged import PoolSizes, state_sentinels


class LayoutBuffers:
    """buffers[name][layer] for every buffer of every pool of `layout`, sized by `sizes`."""

    def __init__(self, layout: KVLayout, sizes: PoolSizes, engine: EngineConfig) -> None:
        dev, size = torch.device(engine.device), engine.page_size
        dtype = getattr(torch, engine.torch_dtype_name)
        self.buffers: dict[str, dict[int, torch.Tensor]] = {}
        for pool in layout.pools:
            pages = sizes.pages(pool.name)
            for b in pool.buffers:
                kind = dtype if b.dtype is None else getattr(torch, b.dtype)
                self.buffers[b.name] = {
                    layer: torch.empty(pages + 1, size, 1, b.width, dtype=kind, device=dev)
                    for layer in b.layers
                }
        self.state_sentinel = state_sentinels(layout, sizes, engine)

    def flat(self, name: str) -> dict[int, torch.Tensor]:
        """Each layer's buffer of `name` as [slots, width]: row = slot id."""
        return {layer: t.view(-1, t.shape[-1]) for layer, t in self.buffers[name].items()}

    def nbytes(self) -> dict[str, int]:
        return {n: sum(t.numel() * t.element_size() for t in ts.values()) for n, ts in self.buffers.items()}
