"""MLA's Triton kernels (the interpreter on CPU) against their references: the fused split + q_a / kv_a
RMSNorm on both q_lora paths, every output compared; the attention over the paged latent pool on
ragged steps with poisoned slots, whole and split over its keys; in fp32 and bf16. Then GLM on the
whole Triton backend against the reference backend."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from golden_harness import compare, engine_traces, random_chunker

from dsv4serve.attention import mla
from dsv4serve.backends import split_norm
from dsv4serve.backends.cuda import backend as triton_backend
from dsv4serve.backends.cuda import mla as mla_triton
from dsv4serve.config import EngineConfig
from dsv4serve.executor.inputs import forward_batch
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm
from tests.kernel_cases import DEVICE, on_device, step_item


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("q_lora_rank", "kv_lora_rank", "rope"), [(24, 40, 8), (None, 40, 8), (768, 512, 64)]
)
@pytest.mark.parametrize("launch", ["cuda", "plain"])
def test_split_norm_kernel_matches_reference(
    q_lora_rank: int | None, kv_lora_rank: int, rope: int, dtype: torch.dtype, launch: str
) -> None:
    """The CUDA backend's launch (PDL where the device has it) and the plain one the npu backend gives
    triton-ascend, of the same source."""
    gen = torch.Generator().manual_seed(kv_lora_rank + (q_lora_rank or 0))
    width = (q_lora_rank or 0) + kv_lora_rank + rope
    y = on_device((torch.randn(7, width, generator=gen) * 3).to(dtype))
    kv_norm = on_device(torch.rand(kv_lora_rank, generator=gen) + 0.5)
    q_norm = on_device(torch.rand(q_lora_rank, generator=gen) + 0.5) if q_lora_rank else None
    want = mla.qkv_split_norm(y, q_norm, kv_norm, q_lora_rank, kv_lora_rank, 1e-6)
    split = mla_triton.qkv_split_norm if launch == "cuda" else split_norm.qkv_split_norm
    got = split(y, q_norm, kv_norm, q_lora_rank, kv_lora_rank, 1e-6)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got.kv, want.kv, **tol)
    assert torch.equal(got.k_pe, want.k_pe) and got.k_pe.is_contiguous()
    if q_lora_rank is None:
        assert got.q is None and want.q is None
    else:
        assert got.q is not None and want.q is not None
        torch.testing.assert_close(got.q, want.q, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["prefill", "split", "per_token"])
@pytest.mark.parametrize(("heads", "lat", "rope"), [(3, 20, 6), (20, 48, 16)], ids=["tiny", "glm_heads"])
def test_attention_kernel_matches_reference(
    heads: int, lat: int, rope: int, path: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decodes at 1..150 positions, a chunk after a cached prefix, a whole prompt; every slot no
    request owns holds NaN. Each path on the whole step: prefill (blocks of 16 (token, head) rows of a
    request, crossing tokens for 3 and 20 heads; 9 and 21 tokens leave partial blocks), split (64 keys
    per split, up to 3 a token), per_token (one program per token and heads, as a captured step
    without spans)."""
    monkeypatch.setattr(mla_triton, "SPLIT_TOKENS", 1000 if path == "split" else 0)
    monkeypatch.setattr(mla_triton, "SPLIT", 64)
    monkeypatch.setattr(mla_triton, "SPLIT_MIN", 64)
    monkeypatch.setattr(mla_triton, "FOLD_L", 16)
    monkeypatch.setattr(mla_triton, "FOLD_SPLITS", 2)  # a token's 3 splits: two groups
    monkeypatch.setattr(mla_triton, "PREFILL_ROWS", 16)
    monkeypatch.setattr(mla_triton, "PREFILL_ROWS_FP32", 16)
    monkeypatch.setattr(mla_triton, "PREFILL_BLOCK_N", 16)
    dims = mla.MlaDims(heads, None, lat, 8, rope, 10, 1e-6, (8 + rope) ** -0.5)
    gen = torch.Generator().manual_seed(heads + lat + len(path))
    q, cache, kv_b, meta = attention_case(dims, dtype, gen)
    if path == "per_token":
        meta = dataclasses.replace(meta, spans=None)
    want = mla.mla_attention(q, cache, kv_b, meta, dims)
    got = mla_triton.mla_attention(q, cache, kv_b, meta, dims)
    assert torch.isfinite(got).all()
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_store_kernel_matches_reference(dtype: torch.dtype) -> None:
    """One kernel a token: q_pe (a strided view of q) rotated in place, q_nope untouched, [c | rotated
    k_pe] written at the token's slot; every other slot of the pool left as it was (NaN)."""
    dims = mla.MlaDims(20, None, 48, 16, 16, 32, 1e-6, 32**-0.5)
    gen = torch.Generator().manual_seed(11)
    _, cache, _, meta = attention_case(dims, dtype, gen)
    T = int(meta.positions.shape[0])
    q = on_device(torch.randn(T, 20, 16 + 16, generator=gen).to(dtype))
    latents = mla.QkvLatents(
        q=None,
        kv=on_device(torch.randn(T, 48, generator=gen).to(dtype)),
        k_pe=on_device(torch.randn(T, 16, generator=gen).to(dtype)),
    )
    meta = dataclasses.replace(
        meta, cos=on_device(torch.rand(T, 8, generator=gen)), sin=on_device(torch.rand(T, 8, generator=gen))
    )
    want_cache, got_cache, want, got = cache.clone(), cache.clone(), q.clone(), q.clone()
    mla.rope_store(want[..., 16:], latents, want_cache, meta)
    mla_triton.rope_store(got[..., 16:], latents, got_cache, meta)
    # bf16: one rounding less or more than the reference's ops here and there (the GPU's compiler)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_cache, want_cache, equal_nan=True, **tol)


def test_small_steps_split_finer() -> None:
    """Keys per split: SPLIT for steps with programs enough, else about FEW_SPLITS splits a token (a
    power of two within [SPLIT_MIN, SPLIT]); measured on the H200 (RESULTS.md, run 67)."""
    m = mla_triton
    big, small, few = m.SPLIT, m.SPLIT_MIN, m.FEW_SPLITS
    assert m.split_keys(8192, 64) == big and m.split_keys(1024, m.SPLIT_PROGRAMS) == big
    for n, rows in ((100, 1), (1024, 1), (1024, 8), (3000, 3), (8192, 1), (100_000, 2)):
        split = m.split_keys(n, rows)
        assert small <= split <= big and split & (split - 1) == 0, (n, rows, split)
        assert split in (small, big) or split <= n // few < 2 * split, (n, rows, split)


def attention_case(
    dims: mla.MlaDims, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, mla.MlaMeta]:
    """q (nope + rope), the latent pool, kv_b and the meta of one ragged step: decodes at 1..150
    positions, a chunk after a cached prefix, a whole prompt, an empty chunk; scattered slots, every
    slot no request owns NaN."""
    heads, lat, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    nope, v = dims.qk_nope_head_dim, dims.v_head_dim
    shares = [(0, 1), (40, 1), (149, 1), (70, 9), (0, 21), (63, 1), (64, 1), (30, 0)]  # (prefix, new tokens)
    width = lat + rope
    rows_table = torch.zeros(len(shares) + 1, 160, dtype=torch.int32)
    cache = torch.full((sum(p + n for p, n in shares) + 8, width), float("nan"))
    order = torch.randperm(cache.shape[0] - 1, generator=gen) + 1  # scattered slots, slot 0 left as padding
    used = 0
    for b, (prefix, new) in enumerate(shares):
        for p in range(prefix + new):
            rows_table[b + 1, p] = order[used]
            cache[order[used]] = torch.randn(width, generator=gen)
            used += 1
    items = [step_item(b + 1, prefix, [7] * new) for b, (prefix, new) in enumerate(shares)]
    batch = forward_batch(items, (), DEVICE)
    meta = mla.mla_meta(batch, on_device(rows_table), on_device(torch.ones(rope // 2)))
    T = batch.num_tokens
    q = on_device(torch.randn(T, heads, nope + rope, generator=gen).to(dtype))
    kv_b = on_device((torch.randn(heads * (nope + v), lat, generator=gen) / 4).to(dtype))
    return q, on_device(cache.to(dtype)), kv_b, meta


def reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, scale: float,
) -> torch.Tensor:  # fmt: skip
    """FlashAttention's varlen contract in plain torch (fp32): causal aligned bottom-right."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bq) - 1):
        qb, kb, vb = q[bq[b] : bq[b + 1]].float(), k[bk[b] : bk[b + 1]].float(), v[bk[b] : bk[b + 1]].float()
        n, s = qb.shape[0], kb.shape[0]
        assert n <= max_q and s <= max_k
        logits = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        seen = torch.arange(s)[None, :] <= torch.arange(n)[:, None] + (s - n)
        probs = logits.masked_fill(~seen.to(q.device), float("-inf")).softmax(-1)
        out[bq[b] : bq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, vb).to(q.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_expanded_prefill_matches_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The expanded prefill path (keys and values expanded from each request's latents, then
    FlashAttention: torch's on a GPU, its contract in plain torch on the CPU) against the absorbed
    reference, on a ragged step with prefixes, decodes, an empty chunk and poisoned slots."""
    if DEVICE == "cpu" or mla_triton.FLASH_VARLEN is None:
        monkeypatch.setattr(mla_triton, "FLASH_VARLEN", reference_varlen)
    monkeypatch.setattr(mla_triton, "SPLIT_TOKENS", 0)
    dims = mla.MlaDims(4, None, 48, 16, 16, 32, 1e-6, 32**-0.5)  # qk 16 + 16 = v 32, as FlashAttention needs
    q, cache, kv_b, meta = attention_case(dims, dtype, torch.Generator().manual_seed(3))
    calls: list[int] = []
    expanded = mla_triton.expanded_prefill
    monkeypatch.setattr(mla_triton, "expanded_prefill", lambda *a: calls.append(1) or expanded(*a))
    got = mla_triton.mla_attention(q, cache, kv_b, meta, dims)
    want = mla.mla_attention(q.float(), cache.float(), kv_b.float(), meta, dims)
    assert calls == [1] and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_glm_on_the_triton_backend_matches_the_reference_backend(tmp_path: Path) -> None:
    model_dir = make_tiny_glm(tmp_path, 6, vocab_size=512, n_group=2, topk_group=1)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 19)]
    engine = EngineConfig(device="cpu", dtype="float32", page_size=4, max_num_seqs=3, max_total_tokens=256)
    want = engine_traces(model_dir, prompts, 4, engine, chunk=random_chunker(5, 3, 9))
    on_test_device = dataclasses.replace(engine, device=DEVICE)  # the interpreter on CPU, else the GPU
    runner = ModelRunner(model_dir, on_test_device, ops=triton_backend())
    got = engine_traces(model_dir, prompts, 4, on_test_device, chunk=random_chunker(5, 3, 9), runner=runner)
    worst = max(compare(w, g) for w, g in zip(want, got, strict=True))
    assert worst <= 1e-4, worst
