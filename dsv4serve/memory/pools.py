"""Device buffers of the DeepSeek-V4 KV pools, in Ascend PA_ND layout [pages + 1, P, 1, dim].

Page 0 of a paged pool is the skip sentinel. A slot id addresses the same row in every layer's buffer
of its pool; `flat(t)` views a buffer as [slots, dim] for slot-indexed reads and writes.

Buffers are allocated with `torch.empty`: no value in them is relied on. Reads of rows nobody wrote
(padded window lists, masked top-k picks, sentinel slots, stale table entries) are selected out in
every backend, never multiplied by zero, so a pool full of NaN or +-inf serves the same tokens
(tests/test_pool_poison.py).
"""

from __future__ import annotations

import torch

from dsv4serve.config import EngineConfig, ModelConfig
from dsv4serve.memory.paged import PoolSizes, state_sentinels


def flat(t: torch.Tensor) -> torch.Tensor:
    """[pages, P, 1, dim] -> [pages * P, dim]: row = slot id."""
    return t.view(-1, t.shape[-1])


def _state_buffer(pages: int, page_size: int, width: int, device: torch.device) -> torch.Tensor:
    """fp32 rows [kv | score] of width `width`, uninitialised."""
    return torch.empty(pages + 1, page_size, 1, width, dtype=torch.float32, device=device)


class KVPools:
    """Per-layer device buffers of every pool.

    swa:             one [swa_pages + 1, P, 1, head_dim] per layer (all layers);
    c4 / c4_index:   ratio-4 layers, [c4_pages + 1, P, 1, head_dim | index_head_dim];
    c128:            HCA layers, [c128_pages + 1, P, 1, head_dim];
    c4_state:        ratio-4 layers, fp32 [pages + 1, P, 1, 2 * 2 * head_dim] rows [kv | score];
    c4_index_state:  ratio-4 layers, fp32 width 2 * 2 * index_head_dim (same slots as c4_state);
    c128_state:      HCA layers, fp32 width 2 * head_dim.
    state_sentinel:  per state pool of the layout, the slot padding writes/reads may use: 0 (paged)
                     or max_num_seqs * ring (ring).
    """

    def __init__(self, model: ModelConfig, sizes: PoolSizes, engine: EngineConfig) -> None:
        dev, size = torch.device(engine.device), engine.page_size
        dtype = getattr(torch, engine.torch_dtype_name)
        hca, dim, idim = model.hca_ratio, model.head_dim, model.index_head_dim
        c4_layers = model.layers_with_ratio(4)
        hca_layers = model.layers_with_ratio(hca) if hca else ()

        def kv(pages: int, width: int) -> torch.Tensor:
            return torch.empty(pages + 1, size, 1, width, dtype=dtype, device=dev)

        self.swa = [kv(sizes.swa, dim) for _ in range(model.num_layers)]
        self.c4 = {layer: kv(sizes.c4, dim) for layer in c4_layers}
        self.c4_index = {layer: kv(sizes.c4, idim) for layer in c4_layers}
        self.c128 = {layer: kv(sizes.c128, dim) for layer in hca_layers}
        self.c4_state = {layer: _state_buffer(sizes.c4_state, size, 4 * dim, dev) for layer in c4_layers}
        self.c4_index_state = {
            layer: _state_buffer(sizes.c4_state, size, 4 * idim, dev) for layer in c4_layers
        }
        self.c128_state = {layer: _state_buffer(sizes.c128_state, size, 2 * dim, dev) for layer in hca_layers}
        self.state_sentinel = state_sentinels(model.kv_layout, sizes, engine)

    def families(self) -> dict[str, list[torch.Tensor]]:
        """Every device buffer, by family (one buffer per layer that has the pool)."""
        return {
            "swa": self.swa,
            "c4": list(self.c4.values()),
            "c4_index": list(self.c4_index.values()),
            "c128": list(self.c128.values()),
            "c4_state": list(self.c4_state.values()),
            "c4_index_state": list(self.c4_index_state.values()),
            "c128_state": list(self.c128_state.values()),
        }

    def nbytes(self) -> dict[str, int]:
        """Bytes of each buffer family, summed over layers."""
        return {name: sum(t.numel() * t.element_size() for t in ts) for name, ts in self.families().items()}
