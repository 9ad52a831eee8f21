"""DeepSeek-V4's attention op families over the pools: reference implementations (the executable spec).

Each op reads and writes the pools through the slot tables, as a fused kernel does; this version
gathers through the step's `StepGeometry` and computes with the plain math of `core.py`. Fused
backends (Triton, torch_npu) implement the same signatures and are tested against these.

Masked keys are selected out, never multiplied by zero: a pool holding NaN in rows nobody wrote
gives the same output.
"""

from __future__ import annotations

import torch

from dsv4serve.attention import core
from dsv4serve.attention.compressor import CompressorWeights, compress_step
from dsv4serve.attention.geometry import StepGeometry
from dsv4serve.attention.int8_index import Int8Rows, int8_scores, rotate_quantize
from dsv4serve.attention.rope import apply_rope
from dsv4serve.attention.step import StepMeta


def _geometry(meta: StepMeta) -> StepGeometry:
    assert meta.geometry is not None, "the reference ops need a step prepared with its geometry"
    return meta.geometry


def rope(x: torch.Tensor, meta: StepMeta, compress: bool, inverse: bool = False) -> torch.Tensor:
    """Interleaved rope of each token's position on the trailing dims of x (T, ..., D)."""
    cos, sin = meta.rope[compress]
    return apply_rope(x, cos, -sin if inverse else sin)


def q_norm_rope(q: torch.Tensor, meta: StepMeta, compress: bool, eps: float) -> torch.Tensor:
    """Per-head unweighted RMSNorm, then rope. q: (T, H, D)."""
    return rope(core.unweighted_rms_norm(q, eps), meta, compress)


def swa_slots(meta: StepMeta) -> torch.Tensor:
    """(T,) the SWA slot each token's K=V row is written to."""
    return _geometry(meta).swa_write


def kv_norm_rope_store(
    kv: torch.Tensor, weight: torch.Tensor, swa: torch.Tensor, meta: StepMeta, compress: bool, eps: float
) -> None:
    """RMSNorm, rope, then write each token's K=V row into its SWA slot. kv: (T, D); swa: (slots, D)."""
    normed = rope(core.rms_norm(kv, weight, eps), meta, compress)
    swa.index_copy_(0, swa_slots(meta), normed.to(swa.dtype))


def compressor(
    x: torch.Tensor,
    w: CompressorWeights,
    state: torch.Tensor,
    out: torch.Tensor | Int8Rows,
    meta: StepMeta,
    ratio: int,
    eps: float,
) -> None:
    """Project, close this step's windows into `out` and persist the state rows later steps need."""
    compress_step(x, w, state, out, _geometry(meta).compress[ratio], ratio, eps)


def indexer_topk(
    q: torch.Tensor,
    head_w: torch.Tensor,
    keys: torch.Tensor | Int8Rows,
    meta: StepMeta,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """The lightning indexer's choice of ratio-4 entries per query.

    q: (T, Hi, Di) roped index queries; head_w: (T, Hi) fp32; keys: (slots, Di) the index-key pool (or
    its int8 rows: attention/int8_index.py).
    Returns (T, min(topk, J)) int32 compressed indices of the `topk` highest scores (exact ties to the
    lowest index), in index order, -1 (last) where fewer entries are visible.
    """
    cg = _geometry(meta).compress[4]
    if isinstance(keys, Int8Rows):  # the int8 indexer: q rotated and quantized as the keys were
        qi, q_scale = rotate_quantize(q)
        slots = cg.entry_slots
        scores = int8_scores(qi, q_scale, keys.data[slots], keys.scale[slots, 0], head_w * scale)
    else:
        scores = core.indexer_scores(q, keys[cg.entry_slots], head_w, scale)  # (T, J)
    scores = scores.masked_fill(~cg.entry_visible, float("-inf"))
    chosen = core.topk_lowest_ties(scores, min(topk, scores.shape[1]))  # (T, K)
    return core.in_index_order(chosen, cg.entry_visible.gather(1, chosen))


def sparse_attention(
    q: torch.Tensor,
    swa: torch.Tensor,
    compressed: torch.Tensor | None,
    indices: torch.Tensor | None,
    meta: StepMeta,
    sinks: torch.Tensor,
    scale: float,
    ratio: int,
) -> torch.Tensor:
    """Shared-K=V attention of each query over its sliding window plus compressed entries, with sinks.

    q: (T, H, D) roped; swa / compressed: (slots, D) pools; indices: (T, K) int32 distinct visible
    entries chosen by the indexer, packed before the padding (-1 = none), or None to take every
    visible entry (heavily compressed layers, or no compressor when ratio is 0). Returns (T, H, D)
    with the rope slice rotated back by -position (K=V carried the keys' rope into the values).
    """
    geo = _geometry(meta)
    keys, visible = swa[geo.window_slots], geo.window_visible  # (T, W, D), (T, W)
    if ratio:
        assert compressed is not None
        cg = geo.compress[ratio]
        if indices is None:
            slots, chosen = cg.entry_slots, cg.entry_visible
        else:
            idx = indices.long()
            slots, chosen = cg.entry_slots.gather(1, idx.clamp(min=0)), idx >= 0
        keys = torch.cat([keys, compressed[slots].to(keys.dtype)], dim=1)
        visible = torch.cat([visible, chosen], dim=1)
    keys = keys.masked_fill(~visible[..., None], 0)  # select: unwritten rows never reach the output
    out = core.sink_attention(q, keys.to(q.dtype), visible, sinks, scale)
    return rope(out, meta, ratio > 0, inverse=True)
