"""DeepSeek-V4's sparse shared-KV attention on Ascend: the custom op `npu_sparse_attn_sharedkv` (with its
tiling op `npu_sparse_attn_sharedkv_metadata`) behind the contract of `attention/dsv4.sparse_attention`.

The ops come from a custom-op library (vllm-ascend's `_C_ascend`, SGLang's `custom`; Atlas A2 / A3). The
documented contract (`../reference` notes, hicann ops-transformer's
`experimental/attention/sparse_attn_sharedkv/README.md`): one shared K=V head of 512, 64 query heads, TND
queries (`cu_seqlens_q`) right-aligned to each batch entry's `seqused_kv`; the raw K=V paged as
[blocks, block_size, 1, 512] with an int32 block table, read over the band [p - ori_win_left, p]
(`ori_mask_mode` 4; only 127 left is supported); compressed K=V (ratio 4 or 128) paged likewise, entry j
visible iff j < (p + 1) // ratio (`cmp_mask_mode` 3), at ratio 4 only the entries `cmp_sparse_indices`
(T, 1, 512) lists (-1 pads), at 128 every visible one; `sinks` (fp32, one per head) an extra logit in
the softmax's denominator; block size a multiple of 16 up to 1,024.

Each token is one batch entry here (cu_seqlens_q = 0..T, seqused_kv = its position + 1): the step's
metadata carries no per-request spans, and a token's own entry gives the op the same band and causal
limits. The block tables are the slot tables read at page starts (slot = page * page_size + offset), as
wide as the step's longest request needs; they, the entries and the metadata are built once per step
(`PerStep`), shared by every layer and by the indexer.
A call outside the contract (the tiny test models, fp32, a page size not a multiple of 16) takes the
reference.

CANN's newer generation, `cann_ops_transformer.sparse_flash_mla` with `sparse_flash_mla_metadata` (hicann
ops-transformer `attention/sparse_flash_mla/docs/torchapi_sparse_flash_mla.md`), has the same math with
`seqused_kv` renamed `seqused_ori_kv` and the pages called PA_BBND; the compressed side takes its own
length `seqused_cmp_kv` (required with `cmp_block_table`) and `cmp_residual_kv` (required with cmp_kv,
mode 3, ratio > 1), with cmp_len * ratio + residual the raw length its causal limit counts from, here
(p + 1) // ratio and (p + 1) % ratio; a window-only call is cmp_ratio 1, cmp_mask_mode 0. Its block
ids are positive only: a padding token's (page 0, the sentinel, which no request holds) become page 1,
read and discarded.
The output's rope slice is rotated back by the reference's `rope`. **Never run on an Ascend NPU.**
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from dsv4serve.attention import dsv4
from dsv4serve.attention.int8_index import Int8Rows, Quantize, rotate_quantize
from dsv4serve.attention.step import StepMeta

HEADS, HEAD_DIM, WINDOW, TOPK = 64, 512, 128, 512
MASK_BAND, MASK_CAUSAL = 4, 3


def supported(q: torch.Tensor, meta: StepMeta, ratio: int) -> bool:
    page = meta.tables.page_size
    return (
        q.dtype == torch.bfloat16
        and q.shape[1:] == (HEADS, HEAD_DIM)
        and meta.sliding_window == WINDOW
        and ratio in (0, 4, 128)
        and page > 0
        and page % 16 == 0
        and page <= 1024
    )


class PerStep:
    """What every layer of a step shares, built by its first layer (the attention's and the indexer's
    calls share one): each token as a batch entry, the block tables, the attention's metadata; and
    whether a call-time fallback has warned."""

    def __init__(self) -> None:
        self.meta: object = None  # the step's metadata (StepMeta, MlaMeta): one object a step
        self.items: dict[object, Any] = {}
        self.warned = False  # a fallback's warning given (once an engine)

    def get(self, meta: object, key: object, make: Callable[[], Any]) -> Any:
        if self.meta is not meta:  # a new step
            self.meta, self.items = meta, {}
        if key not in self.items:
            self.items[key] = make()
        return self.items[key]


def block_table(table: torch.Tensor, meta: StepMeta, indices: int) -> torch.Tensor:
    """(T, ceil(indices / page)) int32: the page of each token's request holding its indices
    [i * page, (i + 1) * page), read off the slot table at each page's first index."""
    page = meta.tables.page_size
    starts = torch.arange(0, max(indices, 1), page, device=table.device)
    return (table[meta.token_row[:, None], starts[None, :]] // page).to(torch.int32)


def token_entries(meta: StepMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token its own batch entry: cu_seqlens_q = 0..T, and its raw length (its position + 1)."""
    T = meta.positions.shape[0]
    cu = torch.arange(T + 1, dtype=torch.int32, device=meta.positions.device)
    return cu, (meta.positions + 1).to(torch.int32)


def every_entry(seqused_kv: torch.Tensor, ratio: int) -> torch.Tensor:
    """(T, 1, TOPK) int32: each token's visible compressed entries 0 .. (p + 1) // ratio - 1, -1 after
    (the picks when the indexer is skipped: no token sees more than top-k <= TOPK of them)."""
    j = torch.arange(TOPK, dtype=torch.int32, device=seqused_kv.device)
    visible = (seqused_kv // ratio)[:, None]
    return torch.where(j < visible, j, -1).to(torch.int32)[:, None, :]


def newer_lengths(seqused_kv: torch.Tensor, ratio: int) -> dict[str, torch.Tensor]:
    """`sparse_flash_mla`'s lengths: the raw ones, and with compressed entries their count (p + 1) // ratio
    and residual (p + 1) % ratio, so count * ratio + residual is the raw length (T,) int32 each."""
    lengths = {"seqused_ori_kv": seqused_kv}
    if ratio:
        lengths |= {"seqused_cmp_kv": seqused_kv // ratio, "cmp_residual_kv": seqused_kv % ratio}
    return lengths


def npu_sparse_attention(
    q: torch.Tensor,
    swa: torch.Tensor,
    compressed: torch.Tensor | None,
    indices: torch.Tensor | None,
    meta: StepMeta,
    sinks: torch.Tensor,
    scale: float,
    ratio: int,
    *,
    op: Callable[..., Any],
    metadata_op: Callable[..., Any],
    shared: PerStep,
    newer: bool = False,
) -> torch.Tensor:
    """Shared-K=V attention over each query's window and compressed entries, with sinks: (T, H, D); on
    the custom libraries' op, or CANN's newer `sparse_flash_mla` (`newer`)."""
    if not supported(q, meta, ratio):
        return dsv4.sparse_attention(q, swa, compressed, indices, meta, sinks, scale, ratio)
    T, page, longest = q.shape[0], meta.tables.page_size, meta.max_seq_len
    cu_seqlens_q, seqused_kv = shared.get(meta, "entries", lambda: token_entries(meta))
    paged = {"ori_kv": swa.view(-1, page, 1, HEAD_DIM)}
    first = int(newer)  # the newer op takes positive block ids only: padding reads page 1, not sentinel 0
    paged["ori_block_table"] = shared.get(
        meta,
        ("positive", 0) if first else 0,
        lambda: block_table(meta.tables.window, meta, longest).clamp(min=first),
    )
    cmp_topk = 0
    if ratio:
        assert compressed is not None
        table = meta.tables.entries[ratio]
        paged["cmp_kv"] = compressed.view(-1, page, 1, HEAD_DIM)
        paged["cmp_block_table"] = shared.get(
            meta,
            ("positive", ratio) if first else ratio,  # the older form shares the indexer's ratio-4 table
            lambda: block_table(table, meta, longest // ratio + 1).clamp(min=first),
        )
        if ratio == 4:
            if indices is None:  # no query sees more than top-k entries (the model skipped the indexer)
                picks = shared.get(meta, "every_entry", lambda: every_entry(seqused_kv, ratio))
            else:
                assert indices.shape[1] <= TOPK
                picks = torch.full((T, 1, TOPK), -1, dtype=torch.int32, device=q.device)
                picks[:, 0, : indices.shape[1]] = indices.to(torch.int32)
            paged["cmp_sparse_indices"] = picks
            cmp_topk = TOPK
    shape: dict[str, Any] = {"cmp_ratio": ratio, "ori_mask_mode": MASK_BAND, "cmp_mask_mode": MASK_CAUSAL}
    shape |= {"ori_win_left": WINDOW - 1, "ori_win_right": 0, "layout_q": "TND", "layout_kv": "PA_ND"}
    lengths: dict[str, Any] = {"seqused_kv": seqused_kv}
    if newer:
        shape |= {"layout_kv": "PA_BBND"} | ({} if ratio else {"cmp_ratio": 1, "cmp_mask_mode": 0})
        lengths = shared.get(meta, ("newer lengths", ratio), lambda: newer_lengths(seqused_kv, ratio))
    longest_kv = {"max_seqlen_ori_kv" if newer else "max_seqlen_kv": longest}
    metadata = shared.get(
        meta,
        ("metadata", ratio),
        lambda: metadata_op(
            HEADS, 1, HEAD_DIM, cu_seqlens_q=cu_seqlens_q, **lengths, batch_size=T, max_seqlen_q=1,
            **longest_kv, ori_topk=0, cmp_topk=cmp_topk, has_ori_kv=True, has_cmp_kv=ratio > 0,
            **({} if newer else {"device": str(q.device)}), **shape,
        ),
    )  # fmt: skip
    out, _ = op(
        q, **paged, cu_seqlens_q=cu_seqlens_q, **lengths, sinks=sinks.float(), metadata=metadata,
        softmax_scale=scale, return_softmax_lse=False, **shape,
    )  # fmt: skip
    return dsv4.rope(out, meta, ratio > 0, inverse=True)


INDEX_HEADS, INDEX_DIM, INDEX_MAX_TOPK = 64, 128, 2048
NO_INT8_INDEXER = (
    "npu backend: this torch_npu lacks npu_quant_lightning_indexer (or npu_dynamic_quant): the int8 "
    "indexer runs the reference"
)


def npu_indexer_topk(
    q: torch.Tensor,
    head_w: torch.Tensor,
    keys: torch.Tensor | Int8Rows,
    meta: StepMeta,
    topk: int,
    scale: float,
    *,
    op: Callable[..., Any],
    quant_op: Callable[..., Any] | None,
    quant: Quantize,
    shared: PerStep,
) -> torch.Tensor:
    """The lightning indexer on torch_npu's `npu_lightning_indexer` (op-plugin doc; ops-transformer's
    `attention/lightning_indexer` README): per query the `sparse_count` highest sum_h w_h relu(q_h . k)
    over the keys its causal limit allows (`sparse_mode` 3, queries right-aligned), int32 (T, 1, count),
    -1 padded; query and weights of one dtype (bf16 / fp16), 64 query heads of 128, one key head, keys
    paged [blocks, block_size, 1, 128]. Each token is one batch entry whose key length is its visible
    ratio-4 entries, (position + 1) // 4, so right-aligned causality is the engine's visibility. The
    weights are the reference's fp32 head weights times `scale`, rounded to q's dtype (the op's
    contract: picks may differ from the reference's where two scores lie within that rounding). The op
    documents no tie order; the picks come back in the contract's index order, -1 last. Outside the
    op's limits: the reference. **Never run on an Ascend NPU.**

    The int8 indexer's keys (`Int8Rows`) go to `quant_op`, `npu_quant_lightning_indexer` (ops-transformer
    `attention/quant_lightning_indexer` doc; SGLang's Ascend kernels, `custom`): the same call with an int8
    query, its fp16 per-token-head dequant scale (T, 64) and the keys' fp16 scales paged (blocks,
    block_size, 1), weights fp16; score sum_h w_h relu(sq_h sk_j (q_h . k_j)). The query is rotated and
    quantized here with `quant` (`npu_dynamic_quant`), as the keys were by the compressor."""
    page = meta.tables.page_size
    fits = q.dtype in (torch.bfloat16, torch.float16) and q.shape[1:] == (INDEX_HEADS, INDEX_DIM)
    if isinstance(keys, Int8Rows) and quant_op is None:
        if not shared.warned:  # once an engine
            shared.warned = True
            warnings.warn(NO_INT8_INDEXER, RuntimeWarning, stacklevel=2)
        return dsv4.indexer_topk(q, head_w, keys, meta, topk, scale)
    if not (fits and topk <= INDEX_MAX_TOPK and page > 0 and page % 16 == 0 and page <= 1024):
        return dsv4.indexer_topk(q, head_w, keys, meta, topk, scale)
    T = q.shape[0]
    cu_seqlens_q, seqused_kv = shared.get(meta, "entries", lambda: token_entries(meta))
    table = meta.tables.entries[4]  # the index keys share the ratio-4 entries' slots
    paged = {
        "actual_seq_lengths_query": cu_seqlens_q[1:],
        "actual_seq_lengths_key": seqused_kv // 4,  # the visible entries, (position + 1) // 4
        "block_table": shared.get(meta, 4, lambda: block_table(table, meta, meta.max_seq_len // 4 + 1)),
        "layout_query": "TND", "layout_key": "PA_BSND", "sparse_count": topk, "sparse_mode": 3,
    }  # fmt: skip
    if isinstance(keys, Int8Rows):
        assert quant_op is not None
        qi, q_scale = rotate_quantize(q, quant)  # (T, 64, 128) int8, (T, 64) fp16
        picks = quant_op(
            qi, keys.data.view(-1, page, 1, INDEX_DIM), (head_w.float() * scale).half(), q_scale,
            keys.scale.view(-1, page, 1), query_quant_mode=0, key_quant_mode=0, **paged,
        )  # fmt: skip
    else:
        w = (head_w.float() * scale).to(q.dtype)
        picks, _ = op(q, keys.view(-1, page, 1, INDEX_DIM), w, **paged)
    picks = picks.view(T, topk)
    big = torch.iinfo(torch.int32).max
    ordered = torch.where(picks >= 0, picks, big).sort(dim=-1).values[:, : min(topk, meta.num_entries[4])]
    return torch.where(ordered == big, -1, ordered).int()
