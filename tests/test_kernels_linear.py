"""Triton GEMMs (float, W8A8 int8 and W8A16 FP8 blocks, split-K and not) and row quantization against
the reference (`layers/linear.py`; interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.backends.cuda import linear as kt
from dsv4serve.backends.cuda.triton_utils import arrival_counters
from dsv4serve.layers import linear as quant
from tests.kernel_cases import on_device


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 64), (5, 24, 2048), (16, 300, 96), (23, 48, 1000)])
def test_float_linear_matches_reference(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * n)
    x, w = on_device(torch.randn(m, k, generator=gen)), on_device(torch.randn(n, k, generator=gen) / k**0.5)
    torch.testing.assert_close(kt.linear(x, w), quant.linear(x, w), atol=1e-5, rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = kt.gemm(xb, wb, torch.bfloat16).float()
    want = xb.float() @ wb.float().T
    assert float((got - want).abs().max()) <= 0.01 * float(want.abs().max())


def test_quantize_rows_matches_reference_with_halves() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 300, generator=gen) * 3
    x[0, :4] = torch.tensor([127.0, 0.5, -0.5, 1.5])  # scale 1: exact .5 cases round to even
    x[1] = 0.0
    q, s = kt.quantize_rows(on_device(x))
    q, s = q.cpu(), s.cpu()
    rq, rs = quant.quantize_activation(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 64), (4, 24, 1024), (33, 130, 200)])
def test_int8_linear_is_exact_against_reference(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = on_device(torch.randn(m, k, generator=gen)), on_device(torch.randn(n, k, generator=gen))
    qw = quant.quantize_int8(w)
    torch.testing.assert_close(kt.linear(x, qw), quant.linear(x, qw), atol=0, rtol=1e-6)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 300, 200), (4, 130, 1024), (16, 64, 96), (40, 300, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_block_linear_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """e4m3 weights with 128 x 128 block scales (partial blocks at the edges), each weight decoded in the
    activations' dtype in the GEMV's registers (up to 16 rows; 40 rows: decoded once, then cuBLAS), against
    the reference's decode-per-call product; 1024 in-features: split over K."""
    from dsv4serve.layers.formats import quantize_fp8_block

    gen = torch.Generator().manual_seed(m + n + k)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=gen) / k**0.5)
    w = quant.Fp8BlockWeight(on_device(q), on_device(torch.exp2(s.float() - 127)))
    x = on_device(torch.randn(m, k, generator=gen).to(dtype))
    got, want = kt.linear(x, w), quant.linear(x, w)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert float((got.float() - want.float()).abs().max()) <= 0.01 * float(want.float().abs().max())


def test_linear_of_no_rows() -> None:
    w = on_device(torch.randn(8, 16))
    assert kt.linear(on_device(torch.zeros(0, 16)), w).shape == (0, 8)
    assert kt.linear(on_device(torch.zeros(0, 16)), quant.quantize_int8(w)).shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_gemm_is_repeatable_and_leaves_its_counters_at_zero(dtype: torch.dtype) -> None:
    """The last program of each tile sums the K slices (no second kernel): same bits on every call,
    also after other split GEMMs, and the arrival counters are zero again after each call."""
    gen = torch.Generator().manual_seed(3)
    x = on_device(torch.randn(3, 4096, generator=gen).to(dtype))
    w = on_device((torch.randn(40, 4096, generator=gen) / 64).to(dtype))
    other = on_device(torch.randn(70, 4096, generator=gen).to(dtype))
    assert kt._plan(3, 40, 4096, False, dtype == torch.float32)[3] > 1  # the split path
    first = kt.gemm(x, w, torch.float32)
    kt.gemm(x, other, torch.float32)
    again = kt.gemm(x, w, torch.float32)
    assert torch.equal(first, again)
    assert int(arrival_counters(first.device, 1).abs().sum()) == 0
    want = x.float() @ w.float().T
    assert float((first - want).abs().max()) <= 1e-4 * float(want.abs().max())
