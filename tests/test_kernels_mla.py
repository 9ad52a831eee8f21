"""MLA's fused split + q_a / kv_a RMSNorm in Triton (the interpreter on CPU) against its reference, on
both q_lora paths and in fp32 and bf16, every output compared; then GLM on the whole Triton backend
against the reference backend (MLA attention and the router run the reference there)."""

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
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm
from tests.kernel_cases import DEVICE, on_device


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
