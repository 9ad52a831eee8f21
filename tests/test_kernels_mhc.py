"""Triton mHC kernels against the reference (mhc.py) on random streams (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.backends.cuda import mhc as kt
from dsv4serve.backends.cuda.triton_utils import launch_options
from dsv4serve.layers import mhc
from tests.kernel_cases import on_device

PARAMS = mhc.HcParams(mult=4, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)


def _hc(dim: int, gen: torch.Generator) -> mhc.HyperConnection:
    n = PARAMS.mult
    return mhc.HyperConnection(
        fn=on_device(torch.randn((2 + n) * n, n * dim, generator=gen) * 0.1),
        base=on_device(torch.randn((2 + n) * n, generator=gen)),
        scale=on_device(torch.rand(3, generator=gen) + 0.5),
    )


@pytest.mark.parametrize("tokens", [1, 5, 19])
@pytest.mark.parametrize("dim", [48, 200])
def test_hc_pre_matches_reference_fp32(tokens: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens * dim)
    h = on_device(torch.randn(tokens, 4, dim, generator=gen) * 2)
    hc, norm = _hc(dim, gen), on_device(torch.randn(dim, generator=gen))
    want = mhc.hc_pre(h, hc, norm, PARAMS)
    got = kt.hc_pre(h, hc, norm, PARAMS)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


def test_hc_pre_prefill_sized_step_uses_few_long_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill-sized step whose K-slices span several BLOCK_K chunks (8 slices of 128 of K = 1024)."""
    monkeypatch.setattr(kt, "LARGE_STEP", 64)
    T = 100
    gen = torch.Generator().manual_seed(17)
    h = on_device(torch.randn(T, 4, 256, generator=gen))
    hc, norm = _hc(256, gen), on_device(torch.randn(256, generator=gen))
    want = mhc.hc_pre(h, hc, norm, PARAMS)
    got = kt.hc_pre(h, hc, norm, PARAMS)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("tokens", [7, 40])
def test_hc_pre_bf16_close(tokens: int) -> None:
    """bf16 streams: the mixes as three exact bf16 products (fn cut in three bf16 pieces) are
    fp32-accurate, so post and comb match the fp32 reference closely."""
    gen = torch.Generator().manual_seed(3 + tokens)
    h = on_device((torch.randn(tokens, 4, 64, generator=gen) * 2).bfloat16())
    hc, norm = _hc(64, gen), on_device(torch.randn(64, generator=gen).bfloat16())
    want = mhc.hc_pre(h, hc, norm, PARAMS)
    got = kt.hc_pre(h, hc, norm, PARAMS)
    torch.testing.assert_close(got[1], want[1], atol=4e-6, rtol=4e-6)
    torch.testing.assert_close(got[2], want[2], atol=4e-6, rtol=4e-6)
    assert float((got[0].float() - want[0].float()).abs().max()) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    h = on_device(torch.randn(6, 4, 80, generator=gen).to(dtype))
    out = on_device(torch.randn(6, 80, generator=gen).to(dtype))
    post = on_device(torch.rand(6, 4, generator=gen) * 2)
    comb = on_device(torch.rand(6, 4, 4, generator=gen))
    want = mhc.hc_post(out, h, post, comb)
    got = kt.hc_post(out, h, post, comb)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # the same rounding steps, but the two rounded terms may differ by one ulp (up to 1/16 here)
        torch.testing.assert_close(got.float(), want.float(), atol=0.07, rtol=0.02)


@pytest.mark.parametrize("tokens", [1, 6, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_matches_reference(tokens: int, dtype: torch.dtype) -> None:
    """The head's collapse + last norm: hc_pre's kernels with the pre weights only (n rows of fn, one
    scale), against `mhc.hc_head_norm`."""
    gen = torch.Generator().manual_seed(tokens + 100)
    n, dim = PARAMS.mult, 96
    h = on_device((torch.randn(tokens, n, dim, generator=gen) * 2).to(dtype))
    head = mhc.HyperConnection(
        fn=on_device(torch.randn(n, n * dim, generator=gen) * 0.1),
        base=on_device(torch.randn(n, generator=gen)),
        scale=on_device(torch.rand(1, generator=gen) + 0.5),
    )
    norm = on_device(torch.randn(dim, generator=gen).to(dtype))
    want = mhc.hc_head_norm(h, head, norm, PARAMS)
    got = kt.hc_head(h, head, norm, PARAMS)
    assert got.shape == want.shape == (tokens, dim) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:  # one bf16 rounding of the collapse apart at most
        assert float((got.float() - want.float()).abs().max()) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixes_are_fp32_accurate(dtype: torch.dtype) -> None:
    """The mixes kernel alone against float64: fp32-level error for fp32 streams (tf32x3) and bf16
    ones (three bf16 pieces of fn; two pieces would be ~1e-5 off)."""
    gen = torch.Generator().manual_seed(31)
    T, K, rows = 20, 512, 24
    h = on_device(torch.randn(T, K, generator=gen).to(dtype))
    fn = on_device(torch.randn(rows, K, generator=gen))
    ws = on_device(torch.empty(1, T, kt.MIX_ROWS))
    kt._mix_partials_kernel[(2, 1)](
        h, fn, ws, T, K, K, rows, h.stride(0), BLOCK_T=16, BLOCK_K=128, MIX_ROWS=kt.MIX_ROWS,
        BF16=dtype == torch.bfloat16, num_warps=4, **launch_options(h),
    )  # fmt: skip
    want = h.double() @ fn.double().T
    err = (ws[0, :, :rows].double() - want).abs().max() / want.abs().max()
    assert float(err) < 1e-6, float(err)  # ~2.5e-7 here; two pieces (or fn's low piece lost) ~2.3e-6
    sumsq = (h.double() ** 2).sum(1)
    torch.testing.assert_close(ws[0, :, -1].double(), sumsq, rtol=1e-6, atol=0)
