"""Triton norm / rope kernels against the reference ops, on random ragged steps (interpreter on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4serve.attention import core
from dsv4serve.attention import dsv4 as reference
from dsv4serve.backends.cuda import norm_rope as kt
from tests.kernel_cases import DEVICE, kernel_model, make_case, on_device

STEPS = [(0, 7), (5, 1), (13, 3), (30, 1)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_matches_reference(dtype: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for rows, n in ((1, 48), (9, 64), (5, 100)):
        x = on_device((torch.randn(rows, n, generator=gen) * 3).to(getattr(torch, dtype)))
        w = on_device(torch.randn(n, generator=gen).to(x.dtype))
        got, ref = kt.rms_norm(x, w, 1e-6), core.rms_norm(x, w, 1e-6)
        assert got.dtype == ref.dtype
        torch.testing.assert_close(
            got.float(), ref.float(), atol=1e-5, rtol=1e-2 if dtype != "float32" else 1e-5
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_add_rms_norm_matches_reference(dtype: str) -> None:
    """The sum bit for bit (torch's add rounds the same way); its norm as `rms_norm`'s; a delta
    with a row stride of its own."""
    gen = torch.Generator().manual_seed(1)
    for rows, n in ((1, 48), (9, 64), (5, 100)):
        x = on_device((torch.randn(rows, n, generator=gen) * 3).to(getattr(torch, dtype)))
        delta = on_device(torch.randn(rows, 2 * n, generator=gen).to(x.dtype))[:, :n]
        w = on_device(torch.randn(n, generator=gen).to(x.dtype))
        (total, normed), (want_total, want_normed) = (
            kt.add_rms_norm(x, delta, w, 1e-6),
            core.add_rms_norm(x, delta, w, 1e-6),
        )
        assert torch.equal(total, want_total) and normed.dtype == want_normed.dtype
        torch.testing.assert_close(normed, kt.rms_norm(want_total, w, 1e-6), atol=0, rtol=0)
        torch.testing.assert_close(
            normed.float(), want_normed.float(), atol=1e-5, rtol=1e-2 if dtype != "float32" else 1e-5
        )


# (heads, head_dim, rope dim): one program per token; a rope half and a head dim that are not powers of
# two; two programs per token, the second's rows partly masked; Flash's 64 x 512 (8 programs of 8 heads)
SHAPES = [(4, 64, 16), (6, 40, 12), (6, 1024, 64), (64, 512, 64)]


def _same(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel rounds where the reference does: bit for bit on the CPU in 16-bit dtypes; on a GPU
    (another order of the fp32 sum of squares) all but a few values, and those by an ulp."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    elif got.device.type == "cpu":
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert float((got != ref).float().mean()) < 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_q_norm_rope_and_inverse_rope_match_reference(
    dtype: str, compress: bool, shape: tuple[int, int, int]
) -> None:
    heads, head_dim, rope_dim = shape
    cfg = kernel_model(num_attention_heads=heads, head_dim=head_dim, qk_rope_head_dim=rope_dim)
    case = make_case(1, STEPS, dtype=dtype, cfg=cfg)
    T, H, D = case.batch.num_tokens, case.cfg.num_heads, case.cfg.head_dim
    q = on_device(torch.randn(T, H, D, generator=torch.Generator().manual_seed(2)).to(getattr(torch, dtype)))
    _same(kt.q_norm_rope(q, case.fused, compress, 1e-6), reference.q_norm_rope(q, case.ref, compress, 1e-6))
    for inverse in (False, True):
        _same(kt.rope(q, case.fused, compress, inverse), reference.rope(q, case.ref, compress, inverse))


@pytest.mark.parametrize("state_mode", ["paged", "ring"])
@pytest.mark.parametrize(("dtype", "head_dim"), [("float32", 64), ("bfloat16", 64), ("bfloat16", 512)])
def test_kv_norm_rope_store_writes_the_same_slots(state_mode: str, dtype: str, head_dim: int) -> None:
    case = make_case(
        3, STEPS, state_mode=state_mode, page_size=8, dtype=dtype, cfg=kernel_model(head_dim=head_dim)
    )
    T, D = case.batch.num_tokens, case.cfg.head_dim
    gen = torch.Generator().manual_seed(4)
    kv = on_device(torch.randn(T, D, generator=gen).to(getattr(torch, dtype)))
    w = on_device(torch.randn(D, generator=gen).to(kv.dtype))
    pool = case.buffer("swa", 0)
    want = pool.clone()
    reference.kv_norm_rope_store(kv, w, want, case.ref, True, 1e-6)
    kt.kv_norm_rope_store(kv, w, pool, case.fused, True, 1e-6)
    _same(pool, want)


def test_glm_through_the_norm_kernels_is_the_references(tmp_path: Path) -> None:
    """A tiny GLM in bf16 with the CUDA backend's norm kernels (its residual adds fused into them) in
    place of the reference's, on the test device: the reference's greedy tokens, its logits within
    bf16's rounding."""
    from dataclasses import replace

    from golden_harness import compare, engine_traces, random_chunker

    from dsv4serve.backends import reference
    from dsv4serve.config import EngineConfig
    from dsv4serve.executor.runner import ModelRunner
    from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm

    model_dir = make_tiny_glm(tmp_path, 3, dtype="bfloat16", vocab_size=512)
    prompts = [[(7 * i + 3) % 509 + 3 for i in range(n)] for n in (3, 40)]
    engine = EngineConfig(
        device=DEVICE, dtype="bfloat16", page_size=16, max_num_seqs=2, max_total_tokens=512, graphs=False
    )
    traces = []
    for ops in (
        reference.backend(),
        replace(reference.backend(), rms_norm=kt.rms_norm, add_rms_norm=kt.add_rms_norm),
    ):
        runner = ModelRunner(model_dir, engine, ops=ops)
        traces.append(engine_traces(model_dir, prompts, 4, engine, random_chunker(5, 3, 24), runner))
    worst = max(compare(w, g) for w, g in zip(*traces, strict=True))  # asserts the same tokens
    assert worst < 0.25, worst
