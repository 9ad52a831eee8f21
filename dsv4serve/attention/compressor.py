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

import torch

from dsv4serve.attention.core import pool_windows, rms_norm
from dsv4serve.attention.geometry import CompressGeometry
from dsv4serve.attention.int8_index import Int8Rows, store_rows
from dsv4serve.attention.rope import apply_rope


@dataclass(frozen=True)
class CompressorWeights:
    wkv_gate: torch.Tensor  # (2*coff*d, hidden): [Wkv; Wgate], one GEMM for both
    ape: torch.Tensor  # (r, coff*d) fp32
    norm: torch.Tensor  # (d,)

    @property
    def wkv(self) -> torch.Tensor:
        return self.wkv_gate[: self.wkv_gate.shape[0] // 2]  # (coff*d, hidden)

    @property
    def wgate(self) -> torch.Tensor:
        return self.wkv_gate[self.wkv_gate.shape[0] // 2 :]


def compress_step(
    x: torch.Tensor,
    w: CompressorWeights,
    state: torch.Tensor,
    out: torch.Tensor | Int8Rows,
    geo: CompressGeometry,
    ratio: int,
    eps: float,
) -> None:
    """Close this step's windows into `out` and persist the state rows later steps need.

    state: (slots, 2*coff*d) fp32 rows [kv | score]; out: (slots, d) compressed entries (flat views;
    the int8 indexer's keys as int8 rows).
    """
    kv = torch.nn.functional.linear(x, w.wkv)  # (T, coff*d)
    score = torch.nn.functional.linear(x, w.wgate) + w.ape[geo.ape_row]  # (T, coff*d) fp32
    if geo.out_slots.numel():
        compressed = _close_windows(kv, score, w, state, geo, ratio, eps)
        store_rows(out, geo.out_slots, compressed)
    state.index_copy_(0, geo.state_write, torch.cat([kv.float(), score.float()], dim=-1))


def _close_windows(
    kv: torch.Tensor,
    score: torch.Tensor,
    w: CompressorWeights,
    state: torch.Tensor,
    geo: CompressGeometry,
    ratio: int,
    eps: float,
) -> torch.Tensor:
    """The entries of the windows closing this step: (NW, d)."""
    width = kv.shape[-1]
    stored = state[geo.state_read]  # (NW, coff*r, 2*width)
    fresh = geo.fresh[..., None]
    rows_kv = torch.where(fresh, kv[geo.fresh_index].to(stored.dtype), stored[..., :width])
    rows_score = torch.where(fresh, score[geo.fresh_index].float(), stored[..., width:])
    if ratio == 4:  # window k = half A of window k-1's rows + half B of its own rows
        d = width // 2
        rows_kv = torch.cat([rows_kv[:, :ratio, :d], rows_kv[:, ratio:, d:]], dim=1)  # (NW, 2r, d)
        rows_score = torch.cat([rows_score[:, :ratio, :d], rows_score[:, ratio:, d:]], dim=1)
    missing = (geo.window_pos < 0)[..., None]  # window 0 has no previous window: weight 0
    rows_kv = rows_kv.masked_fill(missing, 0.0).to(kv.dtype)
    rows_score = rows_score.masked_fill(missing, float("-inf"))
    compressed = rms_norm(pool_windows(rows_kv, rows_score), w.norm, eps)  # (NW, d)
    return apply_rope(compressed, geo.window_cos, geo.window_sin)
