"""Calls every op of the Triton backend on synthetic inputs of the served shapes (decode and prefill
at DeepSeek-V4-Flash dimensions, with few experts, or tiny ones). Used by compile_kernels.py."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.backends.cuda import backend as triton_backend
from dsv4serve.backends.cuda.experts import grouped_mm_experts
from dsv4serve.layers import mhc
from dsv4serve.layers.formats import quantize_fp8_block
from dsv4serve.layers.linear import Fp8BlockWeight, Mxfp4Weight, quantize_int8
from tests.kernel_cases import kernel_model, make_case, pool_of

FLASH = {
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "sliding_window": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "compress_ratios": [0, 4, 128],
    "max_position_embeddings": 8192,
}


def exercise_backend(tiny: bool) -> list[str]:
    failures: list[str] = []
    shapes: list[tuple[dict[str, Any], list[tuple[int, int]]]] = [
        ({}, [(0, 9), (20, 1), (47, 1)]),  # a small step: attention splits the keys
        ({}, [(0, 30), (5, 1)]),  # a larger one: one program per token
    ]
    if not tiny:
        shapes += [(FLASH, [(1000, 1)]), (FLASH, [(1000, 1)] * 8), (FLASH, [(0, 300), (500, 1)])]
    for dtype in ("bfloat16", "float32"):
        for changes, steps in shapes:
            try:
                _one(changes, steps, dtype)
            except Exception:  # report every failing shape, keep going
                failures.append(f"{dtype} {steps[:2]}: {traceback.format_exc(limit=3)}")
    return failures


def _one(changes: dict[str, Any], steps: list[tuple[int, int]], dtype: str) -> None:
    cfg = kernel_model(**changes)
    case = make_case(0, steps, page_size=64 if changes else 8, dtype=dtype, cfg=cfg)
    ops = triton_backend()
    tdt = getattr(torch, dtype)
    T, H, D, hidden = case.batch.num_tokens, cfg.num_heads, cfg.head_dim, cfg.hidden_size
    dsv4 = ops.dsv4
    meta = dsv4.prepare(case.batch, case.step_tables(), case.rope, cfg.sliding_window)
    x = torch.randn(T, hidden).to(tdt)
    ops.rms_norm(x, torch.ones(hidden, dtype=tdt), 1e-6)
    ops.add_rms_norm(x, torch.randn_like(x), torch.ones(hidden, dtype=tdt), 1e-6)
    for q_lora in (768, None):  # GLM-4.7-Flash's fused split + q_a / kv_a norm
        q_norm = torch.ones(q_lora) if q_lora else None
        ops.mla.qkv_split_norm(
            torch.randn(T, (q_lora or 0) + 576).to(tdt), q_norm, torch.ones(512), q_lora, 512, 1e-6
        )
    _mla_attention(ops, tdt)
    q = dsv4.q_norm_rope(torch.randn(T, H, D).to(tdt), meta, True, 1e-6)
    dsv4.rope(q, meta, True, True)
    layer4, layer128 = cfg.compress_ratios.index(4), cfg.compress_ratios.index(cfg.hca_ratio)
    swa = case.buffer("swa", layer4)
    dsv4.kv_norm_rope_store(torch.randn(T, D).to(tdt), torch.ones(D, dtype=tdt), swa, meta, True, 1e-6)
    for ratio, layer, d in ((4, layer4, D), (4, layer4, cfg.index_head_dim), (cfg.hca_ratio, layer128, D)):
        coff = 2 if ratio == 4 else 1
        w = CompressorWeights(
            torch.randn(2 * coff * d, hidden).to(tdt), torch.randn(ratio, coff * d), torch.ones(d, dtype=tdt)
        )
        name = pool_of(ratio) + ("_index" if ratio == 4 and d != D else "")
        dsv4.compressor(
            x, w, case.buffer(f"{name}_state", layer), case.buffer(name, layer), meta, ratio, 1e-6
        )
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    keys = case.buffer("c4_index", layer4)
    idx = dsv4.indexer_topk(
        torch.randn(T, Hi, Di).to(tdt), torch.randn(T, Hi), keys, meta, cfg.index_topk, 0.1
    )
    sinks = torch.randn(H)
    dsv4.sparse_attention(q, swa, case.buffer("c4", layer4), idx, meta, sinks, 0.04, 4)
    dsv4.sparse_attention(q, swa, case.buffer("c128", layer128), None, meta, sinks, 0.04, cfg.hca_ratio)
    dsv4.sparse_attention(q, swa, None, None, meta, sinks, 0.04, 0)
    n = cfg.hc_mult
    hc = mhc.HyperConnection(torch.randn((2 + n) * n, n * hidden), torch.randn((2 + n) * n), torch.rand(3))
    h = torch.randn(T, n, hidden).to(tdt)
    xn, post, comb = dsv4.hc_pre(h, hc, torch.ones(hidden, dtype=tdt), mhc.HcParams(n, 20, 1e-6, 1e-6))
    dsv4.hc_post(xn, h, post, comb)
    head = mhc.HyperConnection(torch.randn(n, n * hidden), torch.randn(n), torch.rand(1))
    dsv4.hc_head(h, head, torch.ones(hidden, dtype=tdt), mhc.HcParams(n, 20, 1e-6, 1e-6))
    for n_out, k_in in (
        (cfg.q_lora_rank, hidden),
        (H * D // cfg.o_groups, cfg.o_lora_rank),
        (hidden, 8 * 1024),
    ):
        w_lin = torch.randn(n_out, k_in).to(tdt)
        ops.linear(torch.randn(T, k_in).to(tdt), w_lin)
        if dtype == "bfloat16":
            ops.linear(torch.randn(T, k_in).to(tdt), quantize_int8(w_lin.float()))
        q8, s8 = quantize_fp8_block(w_lin.float())  # official FP8 linears kept as stored (W8A8)
        ops.linear(torch.randn(T, k_in).to(tdt), Fp8BlockWeight(q8, torch.exp2(s8.float() - 127)))
    E, I_, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k).to(tdt)
    w1, w2, w3 = (
        torch.randn(E, I_, hidden).to(tdt),
        torch.randn(E, hidden, I_).to(tdt),
        torch.randn(E, I_, hidden).to(tdt),
    )
    ops.routed_experts(x, weights, ids, w1, w2, w3, 10.0)
    shared = (w1[0], w2[0], w3[0])
    ops.routed_experts(x, weights, ids, w1, w2, w3, 10.0, shared)
    logits = ops.linear(x, torch.randn(E, hidden).to(tdt))  # (T, E)
    for norm_type in (0, 1, 2):
        ops.gating_top_k(logits, k, bias=torch.randn(E), norm_type=norm_type, routed_scaling_factor=1.5)
    table = torch.stack([torch.randperm(E)[:k] for _ in range(cfg.vocab_size)])
    ops.gating_top_k(logits, k, input_ids=case.batch.input_ids, tid2eid=table, norm_type=2)
    groups = {"k_group": 2, "group_count": 2, "group_select_mode": 1}  # GLM's grouped routing, fp32 logits
    ops.gating_top_k(logits.float(), 2, bias=torch.randn(E), norm_type=1, **groups)
    if dtype == "bfloat16":
        q1, q2, q3 = (quantize_int8(w.float()) for w in (w1, w2, w3))
        ops.routed_experts(x, weights, ids, q1, q2, q3, 10.0)
        hf, inf = -(-hidden // 32) * 32, -(-I_ // 32) * 32  # MXFP4 rows: multiples of 32
        f1, f2, f3 = (  # packed MXFP4 (official experts), W4A16, with the shared expert in bf16
            Mxfp4Weight(torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8),
                        torch.full((E, n, k // 32), 120, dtype=torch.uint8))
            for n, k in ((inf, hf), (hf, inf), (inf, hf))
        )  # fmt: skip
        plain = tuple(torch.randn(n, k).to(tdt) for n, k in ((inf, hf), (hf, inf), (inf, hf)))
        ops.routed_experts(torch.randn(T, hf).to(tdt), weights, ids, f1, f2, f3, 10.0, plain)
        if hasattr(torch, "_grouped_mm"):  # the prefill path's kernels around torch's grouped GEMM
            grouped_mm_experts(x, weights, ids, w1, w2, w3, 10.0)


def _mla_attention(ops: Any, tdt: torch.dtype) -> None:
    """GLM-4.7-Flash's latent attention (20 heads, latent 512 + rope 64) on each of its paths: small
    steps split over their keys (SPLIT_MIN keys a split for two tokens, SPLIT for 64), a prefill of
    two requests (blocks of a request's tokens), and the same tokens without spans (one program per
    token, as a large captured step)."""
    import dataclasses

    from dsv4serve.attention.mla import MlaDims, QkvLatents, mla_meta
    from dsv4serve.backends.cuda import mla
    from dsv4serve.executor.inputs import forward_batch
    from tests.kernel_cases import step_item

    dims = MlaDims(20, 768, 512, 192, 64, 256, 1e-6, 256**-0.5)
    short = [step_item(1, mla.SPLIT_MIN + 40, [5]), step_item(2, 3, [5])]
    wide = [step_item(b + 1, mla.SPLIT + 40, [5]) for b in range(64)]
    prefill = [step_item(1, 10, [5] * 40), step_item(2, 0, [5] * (mla.SPLIT_TOKENS + 10))]
    for items, n in ((short, mla.SPLIT_MIN + 80), (wide, mla.SPLIT + 80), (prefill, 200)):
        table = torch.arange((len(items) + 1) * n, dtype=torch.int32).view(len(items) + 1, n)
        cache = torch.randn(table.numel(), 576).to(tdt)
        meta = mla_meta(forward_batch(items, (), "cpu"), table, torch.ones(32))
        T = int(meta.positions.shape[0])
        latents = QkvLatents(None, torch.randn(T, 512).to(tdt), torch.randn(T, 64).to(tdt))
        ops.mla.rope_store(torch.randn(T, 20, 256).to(tdt)[..., 192:], latents, cache, meta)  # in place
        for m in (meta, dataclasses.replace(meta, spans=None)) if items is prefill else (meta,):
            T = int(m.positions.shape[0])
            q = torch.randn(T, 20, 192 + 64).to(tdt)
            ops.mla.attention(q, cache, torch.randn(20 * 448, 512).to(tdt), m, dims)
