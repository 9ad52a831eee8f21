"""GLM's op families on fresh random inputs: MLA attention against dense attention per request, the
fused split + q/kv norm, the router (GLM's, and DSV4's through the same op)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dsv4serve.attention.core import rms_norm
from dsv4serve.attention.mla import MlaDims, mla_attention, mla_meta, qkv_split_norm, rope_inv_freq
from dsv4serve.executor.inputs import forward_batch
from dsv4serve.moe.routing import gating_top_k
from tests.kernel_cases import step_item

DIMS = MlaDims(
    num_heads=3,
    q_lora_rank=16,
    kv_lora_rank=20,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    norm_eps=1e-6,
    softmax_scale=14**-0.5,
)


def _dense_spec(
    q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, kv_b: torch.Tensor, position: int
) -> torch.Tensor:
    """One token's attention in the non-absorbed form: keys and values expanded per head from the
    latents of its request's positions 0..position. rows: (n, L + rope). Returns (H, v)."""
    H, nope, lat = DIMS.num_heads, DIMS.qk_nope_head_dim, DIMS.kv_lora_rank
    w = kv_b.view(H, nope + DIMS.v_head_dim, lat)
    seen = rows[: position + 1]
    k = torch.cat(
        [torch.einsum("nl,hdl->hnd", seen[:, :lat], w[:, :nope]), seen[None, :, lat:].expand(H, -1, -1)], -1
    )
    v = torch.einsum("nl,hdl->hnd", seen[:, :lat], w[:, nope:])
    q = torch.cat([q_nope, q_pe], -1)[:, None]  # (H, 1, nope + rope)
    probs = torch.softmax((q @ k.transpose(1, 2)) * DIMS.softmax_scale, -1)
    return (probs @ v)[:, 0]


@pytest.mark.parametrize("per_request", [True, False], ids=["eager", "captured"])
@pytest.mark.parametrize("gather", [1 << 25, 200], ids=["one_chunk", "small_chunks"])
def test_attention_is_dense_attention_per_request_and_skips_poisoned_rows(
    gather: int, per_request: bool
) -> None:
    """A ragged step: decodes, a prefill after a cached prefix, a whole prompt, an empty-prefix single
    token; every slot no request owns holds NaN. Each token equals dense attention over its request's
    rows 0..its position (the non-absorbed form): with the requests' spans known (an eager step) or
    not (a captured step), the tokens taken at once or in chunks (a gather bound of 200: one token
    at a time gathering 14 positions x 26; 4 or 5 tokens at a time scoring 13-14 positions x 3 heads)."""
    gen = torch.Generator().manual_seed(0)
    shares = [(0, 1), (4, 1), (11, 1), (5, 9), (0, 13), (2, 1)]  # (prefix, new tokens) per request
    rows_table = torch.zeros(len(shares) + 1, 16, dtype=torch.int32)
    cache = torch.full((120, DIMS.latent_width), float("nan"))
    slot = 1
    for b, (prefix, new) in enumerate(shares):
        for p in range(prefix + new):
            rows_table[b + 1, p] = slot
            cache[slot] = torch.randn(DIMS.latent_width, generator=gen)
            slot += 1
    items = [step_item(b + 1, prefix, [7] * new) for b, (prefix, new) in enumerate(shares)]
    batch = forward_batch(items, (), "cpu")
    meta = mla_meta(batch, rows_table, rope_inv_freq(DIMS.qk_rope_head_dim, 10000.0, "cpu"))
    assert meta.spans == ((0, 1, 1), (1, 1, 5), (2, 1, 12), (3, 9, 14), (12, 13, 13), (25, 1, 3))
    if not per_request:
        meta = dataclasses.replace(meta, spans=None)
    T = batch.num_tokens
    q_nope = torch.randn(T, 3, 8, generator=gen)
    q_pe = torch.randn(T, 3, 6, generator=gen)
    kv_b = torch.randn(3 * 18, 20, generator=gen) / 4
    got = mla_attention(torch.cat([q_nope, q_pe], -1), cache, kv_b, meta, DIMS, bound=gather)
    assert torch.isfinite(got).all()
    for t in range(T):
        b, position = int(batch.token_req[t]), int(batch.positions[t])
        rows = cache[rows_table[b + 1, : shares[b][0] + shares[b][1]].long()]
        want = _dense_spec(q_nope[t], q_pe[t], rows, kv_b, position)
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q_lora", "no_q_lora"])
def test_fused_split_norm_gives_every_output_of_the_unfused_path(q_lora_rank: int | None) -> None:
    """One GEMM on q_a_proj | kv_a_proj_with_mqa then the fused op == the reference model's separate
    projections and norms: q latent (when there is one), kv latent and the rope key k_pe."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 32, generator=gen)
    kv_a = torch.randn(26, 32, generator=gen)
    kv_norm = torch.rand(20, generator=gen) + 0.5
    q_a = torch.randn(16, 32, generator=gen) if q_lora_rank else None
    q_norm = torch.rand(16, generator=gen) + 0.5 if q_lora_rank else None
    fused_w = torch.cat([q_a, kv_a]) if q_a is not None else kv_a
    got = qkv_split_norm(F.linear(x, fused_w), q_norm, kv_norm, q_lora_rank, 20, 1e-6)
    kv_out = F.linear(x, kv_a)
    torch.testing.assert_close(got.kv, rms_norm(kv_out[:, :20], kv_norm, 1e-6))
    torch.testing.assert_close(got.k_pe, kv_out[:, 20:])
    assert got.k_pe.shape == (9, 6)
    if q_a is None:
        assert got.q is None
    else:
        assert q_norm is not None and got.q is not None
        torch.testing.assert_close(got.q, rms_norm(F.linear(x, q_a), q_norm, 1e-6))


def test_gating_top_k_matches_glm_router_grouped() -> None:
    from transformers import Glm4MoeLiteConfig
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteTopkRouter

    cfg = Glm4MoeLiteConfig(
        hidden_size=24,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.8,
        num_hidden_layers=2,
    )
    router = Glm4MoeLiteTopkRouter(cfg)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 24, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.3)
    x = torch.randn(50, 24, generator=gen)
    _, ref_w, ref_ids = router(x)
    w, ids = gating_top_k(
        F.linear(x, router.weight),
        4,
        bias=router.e_score_correction_bias,
        k_group=2,
        group_count=4,
        group_select_mode=1,
        norm_type=1,
        routed_scaling_factor=1.8,
    )
    order, ref_order = ids.long().sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices))


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.long().sort(-1)
    return order.values, weights.gather(1, order.indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gating_top_k_is_transformers_dsv4_router_bit_for_bit(dtype: torch.dtype) -> None:
    """DSV4's call (logits in the activation dtype, norm_type 2): transformers' DeepseekV4 top-k and
    hash routers' experts exactly and their weights bit for bit in bf16 (the contract's fp32 scoring
    of bf16 logits is not); in fp32 to the last bits, the k weights being summed in another order."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HashRouter,
        DeepseekV4TopKRouter,
    )

    cfg = DeepseekV4Config(
        hidden_size=64, num_local_experts=256, num_experts_per_tok=6, vocab_size=100, num_hidden_layers=2
    )
    topk, hashed = DeepseekV4TopKRouter(cfg), DeepseekV4HashRouter(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        weight = torch.randn(256, 64, generator=gen) / 8
        topk.weight.copy_(weight), hashed.weight.copy_(weight)
        topk.e_score_correction_bias.copy_(torch.randn(256, generator=gen) * 0.1)
        hashed.tid2eid.copy_(torch.rand(100, 256, generator=gen).argsort(1)[:, :6])
    topk.weight.data, hashed.weight.data = topk.weight.data.to(dtype), hashed.weight.data.to(dtype)
    x = torch.randn(512, 64, generator=gen).to(dtype)
    input_ids = torch.randint(0, 100, (512,), generator=gen)
    logits = F.linear(x, topk.weight).detach()
    common = {"norm_type": 2, "routed_scaling_factor": cfg.routed_scaling_factor}
    with torch.no_grad():
        _, ref_w, ref_ids = topk(x)
        got = _by_expert(*gating_top_k(logits, 6, bias=topk.e_score_correction_bias, **common))
        want = _by_expert(ref_w, ref_ids)
        _, ref_w, ref_ids = hashed(x, input_ids)
        w, ids = gating_top_k(logits, 6, input_ids=input_ids, tid2eid=hashed.tid2eid, **common)
    assert torch.equal(got[0], want[0]) and torch.equal(ids.long(), ref_ids)
    tol = {"rtol": 0.0, "atol": 0.0} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 0.0}
    torch.testing.assert_close(got[1], want[1], **tol)
    torch.testing.assert_close(w, ref_w, **tol)
