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
def test_split_norm_kernel_matches_reference(
    q_lora_rank: int | None, kv_lora_rank: int, rope: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(kv_lora_rank + (q_lora_rank or 0))
    width = (q_lora_rank or 0) + kv_lora_rank + rope
    y = on_device((torch.randn(7, width, generator=gen) * 3).to(dtype))
    kv_norm = on_device(torch.rand(kv_lora_rank, generator=gen) + 0.5)
    q_norm = on_device(torch.rand(q_lora_rank, generator=gen) + 0.5) if q_lora_rank else None
    want = mla.qkv_split_norm(y, q_norm, kv_norm, q_lora_rank, kv_lora_rank, 1e-6)
    got = mla_triton.qkv_split_norm(y, q_norm, kv_norm, q_lora_rank, kv_lora_rank, 1e-6)
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
    request owns holds NaN. Each path on the whole step: prefill (blocks of 4 tokens of a request x 16
    heads, 9 and 21 tokens leaving partial blocks), split (64 keys per split, up to 3 a token),
    per_token (one program per token and heads, as a captured step without spans)."""
    monkeypatch.setattr(mla_triton, "SPLIT_TOKENS", 1000 if path == "split" else 0)
    monkeypatch.setattr(mla_triton, "SPLIT", 64)
    monkeypatch.setattr(mla_triton, "PREFILL_TOKENS_HEADS", (4, 16))
    monkeypatch.setattr(mla_triton, "PREFILL_TOKENS_HEADS_FP32", (4, 16))
    dims = mla.MlaDims(heads, None, lat, 8, rope, 10, 1e-6, (8 + rope) ** -0.5)
    gen = torch.Generator().manual_seed(heads + lat + len(path))
    shares = [(0, 1), (40, 1), (149, 1), (70, 9), (0, 21), (63, 1), (64, 1)]  # (prefix, new tokens)
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
    if path == "per_token":
        meta = dataclasses.replace(meta, spans=None)
    T = batch.num_tokens
    q_nope = on_device(torch.randn(T, heads, 8, generator=gen).to(dtype))
    q_pe = on_device(torch.randn(T, heads, rope, generator=gen).to(dtype))
    kv_b = on_device((torch.randn(heads * 18, lat, generator=gen) / 4).to(dtype))
    cache = on_device(cache.to(dtype))
    want = mla.mla_attention(q_nope, q_pe, cache, kv_b, meta, dims)
    got = mla_triton.mla_attention(q_nope, q_pe, cache, kv_b, meta, dims)
    assert torch.isfinite(got).all()
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)


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
