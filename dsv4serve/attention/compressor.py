"""The DeepSeek-V4 compressor over paged pools (attention's and the indexer's).

Per token: `kv = x Wkv`, `score = x Wgate + ape[pos % r]`, both `coff * d` wide. Window k pools
`r` rows (ratio > 4) or, for ratio 4, half A of window k-1's rows plus half B of window k's rows;
softmax over rows per channel, weighted sum, RMSNorm, RoPE at the window's first position.

Rows of positions before this step come from the state pool (via the state table); rows of this
step's tokens come straight from the projection. After the windows are read, the rows a later step
needs are written to the state pool (tokens that need none write the sentinel slot). Every read of
a layer's state happens before any write to it: the allocator relies on that (see memory/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4serve.attention.core import rms_norm
from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables, apply_rope

if TYPE_CHECKING:
    from dsv4serve.backend import Backend


@dataclass(frozen=True)
class CompressorWeights:
    wkv: torch.Tensor  # (coff*d, hidden)
    wgate: torch.Tensor  # (coff*d, hidden)
    ape: torch.Tensor  # (r, coff*d) fp32
    norm: torch.Tensor  # (d,)


@dataclass(frozen=True)
class CompressorCache:
    state: torch.Tensor  # (slots, 2*coff*d) fp32 rows [kv | score], flat view of the pool
    state_table: torch.Tensor  # (rows, max_len) raw position -> state slot
    state_sentinel: int
    out: torch.Tensor  # (slots, d) compressed entries, flat view of the pool
    out_table: torch.Tensor  # (rows, max_len // r + 1) compressed index -> slot


def keep_start(ratio: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """First raw position whose state row must outlive a step that ends at seq_lens."""
    coff = 2 if ratio == 4 else 1
    return ((seq_lens // ratio - (coff - 1)) * ratio).clamp(min=0)


def compress_step(
    x: torch.Tensor,
    w: CompressorWeights,
    cache: CompressorCache,
    batch: ForwardBatch,
    ratio: int,
    rope: RopeTables,
    eps: float,
    ops: Backend,
) -> None:
    """Close this step's windows into `cache.out` and persist the state rows later steps need."""
    coff = 2 if ratio == 4 else 1
    kv = torch.nn.functional.linear(x, w.wkv)  # (T, coff*d)
    score = torch.nn.functional.linear(x, w.wgate) + w.ape[batch.positions % ratio]  # (T, coff*d) fp32
    windows = batch.windows[ratio]
    if windows.index.numel():
        compressed, slots = _close_windows(kv, score, w, cache, batch, ratio, coff, rope, eps, ops)
        cache.out.index_copy_(0, slots, compressed.to(cache.out.dtype))
    rows = batch.rows[batch.token_req]
    slots = cache.state_table[rows, batch.positions].long()
    start = torch.maximum(batch.prefix_lens, keep_start(ratio, batch.seq_lens))[batch.token_req]
    slots = torch.where(batch.positions >= start, slots, cache.state_sentinel)
    cache.state.index_copy_(0, slots, torch.cat([kv.float(), score.float()], dim=-1))


def _close_windows(
    kv: torch.Tensor,
    score: torch.Tensor,
    w: CompressorWeights,
    cache: CompressorCache,
    batch: ForwardBatch,
    ratio: int,
    coff: int,
    rope: RopeTables,
    eps: float,
    ops: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    windows = batch.windows[ratio]
    valid = windows.index >= 0
    k = windows.index.clamp(min=0)  # (NW,)
    b = windows.req
    width = kv.shape[-1]
    pos = ((k - (coff - 1)) * ratio)[:, None] + torch.arange(coff * ratio, device=k.device)  # (NW, coff*r)
    prefix = batch.prefix_lens[b][:, None]
    fresh = pos >= prefix
    fresh_idx = (batch.cu_seqlens[b][:, None] + pos - prefix).clamp(0, kv.shape[0] - 1)
    state_slot = cache.state_table[batch.rows[b][:, None], pos.clamp(min=0)].long()
    stored = cache.state[state_slot]  # (NW, coff*r, 2*width)
    rows_kv = torch.where(fresh[..., None], kv[fresh_idx].to(stored.dtype), stored[..., :width])
    rows_score = torch.where(fresh[..., None], score[fresh_idx].float(), stored[..., width:])
    if coff == 2:  # window k = half A of window k-1's rows + half B of its own rows
        d = width // 2
        rows_kv = torch.cat([rows_kv[:, :ratio, :d], rows_kv[:, ratio:, d:]], dim=1)  # (NW, 2r, d)
        rows_score = torch.cat([rows_score[:, :ratio, :d], rows_score[:, ratio:, d:]], dim=1)
    missing = (pos < 0)[..., None]  # window 0 has no previous window: weight 0
    rows_kv = rows_kv.masked_fill(missing, 0.0).to(kv.dtype)
    rows_score = rows_score.masked_fill(missing, float("-inf"))
    compressed = rms_norm(ops.pool_windows(rows_kv, rows_score), w.norm, eps)  # (NW, d)
    cos, sin = rope.lookup(k * ratio, compress=True)
    compressed = apply_rope(compressed, cos, sin)
    slots = cache.out_table[batch.rows[b], k].long()
    return compressed, torch.where(valid, slots, 0)
