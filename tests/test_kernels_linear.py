"""Triton GEMMs (float, W8A8 int8 and W8A8 FP8 blocks, split-K and not) and row quantization against
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


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 300, 200), (4, 130, 1024), (16, 64, 96), (40, 300, 200), (48, 256, 512), (37, 384, 1024)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_block_linear_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """W8A8: e4m3 weights with 128 x 128 block scales (partial blocks at the edges), the activations
    quantized per row per 128 in the GEMM's prologue, against the reference's fp32 product of both
    dequantized operands; 1024 in-features: split over K; 48 x 256 x 512 and 37 x 384 x 1024 (rows
    padded to 16 for cuBLAS) in bf16 on a GPU: `torch._scaled_mm`. Every dequantized operand is exact
    in bf16, so only the order of the fp32 sums and the output's rounding differ."""
    from dsv4serve.layers.formats import quantize_fp8_block

    gen = torch.Generator().manual_seed(m + n + k)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=gen) / k**0.5)
    w = quant.Fp8BlockWeight(on_device(q), on_device(torch.exp2(s.float() - 127)))
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, : min(k, 128)] = 0.0  # an all-zero block: the floor of the scale
    x = on_device(x.to(dtype))
    got, want = kt.linear(x, w).float(), quant.linear(x, w).float()
    exact = quant.linear(x.float(), w.dequantized(torch.float32))  # unquantized activations
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert float((got - want).abs().max()) <= 2**-7 * float(want.abs().max())
    # the activations really are quantized: the error against the unquantized product is e4m3's
    quant_err = float((want - exact).abs().max() / exact.abs().max())
    assert 1e-4 < quant_err < 2**-4


@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("m", [1, 5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_fp8_linear_matches_reference(
    m: int, dtype: torch.dtype, one_launch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wo_a's grouped product: 3 groups of 256 rows over 200 in-features each (a partial 128-block),
    up to 16 rows as one launch whose tiles read their group's columns (`GROUPED_FP8_LAUNCH`) or one
    W8A8 linear a group: the reference's per-group products; a float weight: the batched product."""
    from dsv4serve.layers.formats import quantize_fp8_block

    monkeypatch.setattr(kt, "GROUPED_FP8_LAUNCH", one_launch)
    groups, rows, k = 3, 256, 200
    gen = torch.Generator().manual_seed(m)
    q, s = quantize_fp8_block(torch.randn(groups * rows, k, generator=gen) / k**0.5)
    w = quant.Fp8BlockWeight(on_device(q), on_device(torch.exp2(s.float() - 127)))
    x = on_device((torch.randn(m, groups * k, generator=gen) * 2).to(dtype))
    got, want = kt.grouped_linear(x, w, groups).float(), quant.grouped_linear(x, w, groups).float()
    for g in range(groups):  # the reference itself: group g's columns times group g's rows
        alone = quant.linear(x[:, g * k : (g + 1) * k], w.rows(g * rows, (g + 1) * rows)).float()
        assert torch.equal(want[:, g * rows : (g + 1) * rows], alone)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert float((got - want).abs().max()) <= 2**-7 * float(want.abs().max())
    plain = on_device(torch.randn(groups * rows, k, generator=gen) / k**0.5)
    torch.testing.assert_close(
        kt.grouped_linear(x.float(), plain, groups), quant.grouped_linear(x.float(), plain, groups)
    )
    torch.testing.assert_close(
        quant.grouped_linear(x.float(), plain, groups)[:, rows : 2 * rows],
        x.float()[:, k : 2 * k] @ plain[rows : 2 * rows].T,
        atol=1e-5,
        rtol=1e-5,
    )


def test_fp8_activation_quantization_matches_reference() -> None:
    """The kernel's per-row per-128 quantization equals the reference bit for bit: values at and just
    past a power of two times 448 (the scale's binade edge), ties of e4m3's rounding, a zero row, a
    short last block."""
    from dsv4serve.layers.formats import dequantize_fp8_activation, quantize_fp8_activation

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 300, generator=gen) * 3
    x[0, 0] = 448.0 * 2.0**-3  # amax exactly a power of two times 448: scale 2^-3
    x[1, 0] = 448.0 * 2.0**-3 * (1 + 2**-23)  # just past it: scale 2^-2
    x[2, :8] = torch.tensor([1.0, 1.0625, 1.1875, -1.0625, 9.0, 13.0, 0.5, 0.0]) * 2.0**-6
    x[3] = 0.0
    q, s = kt.quantize_fp8_rows(on_device(x))
    rq, rs = quantize_fp8_activation(x)
    assert torch.equal(s.cpu(), rs) and torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert float(rs[0, 0]) == 2.0**-3 and float(rs[1, 0]) == 2.0**-2
    back = dequantize_fp8_activation(rq, rs)
    assert float(back.abs().max()) <= float(x.abs().max()) * (1 + 2**-4)
    assert float((back - x).abs().max() / x.abs().max()) <= 2**-4
    pq, ps = kt.quantize_fp8_rows(on_device(x), 16)  # rows padded for cuBLAS: zeros, the floor scale
    assert pq.shape == (16, 300) and ps.shape == (16, 3) and torch.equal(ps[:5].cpu(), rs)
    assert torch.equal(pq[:5].cpu().view(torch.uint8), rq.view(torch.uint8)) and not pq[5:].float().any()
    assert torch.equal(ps[5:].cpu(), torch.full((11, 3), rs[3, 0].item()))


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
    assert kt._plan(3, 40, 4096, False, dtype == torch.float32, False)[3] > 1  # the split path
    first = kt.gemm(x, w, torch.float32)
    kt.gemm(x, other, torch.float32)
    again = kt.gemm(x, w, torch.float32)
    assert torch.equal(first, again)
    assert int(arrival_counters(first.device, 1).abs().sum()) == 0
    want = x.float() @ w.float().T
    assert float((first - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a second CUDA stream")
def test_split_k_gemms_on_two_streams_at_once() -> None:
    """`triton_utils.beside`: a split-K GEMM on each stream at once (each stream its own arrival
    counters), eager and replayed in a CUDA graph: the bits of running them in turn, every counter of
    both streams back at zero."""
    from dsv4serve.backends.cuda import triton_utils

    gen = torch.Generator().manual_seed(8)
    x = on_device(torch.randn(2, 4096, generator=gen).bfloat16())
    w1, w2 = (on_device((torch.randn(96, 4096, generator=gen) / 64).bfloat16()) for _ in range(2))
    assert kt._plan(2, 96, 4096, False, False, False)[3] > 1  # both split over K

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        return triton_utils.beside(
            x.device, lambda: kt.gemm(x, w1, torch.float32), lambda: kt.gemm(x, w2, torch.float32)
        )

    want = (kt.gemm(x, w1, torch.float32), kt.gemm(x, w2, torch.float32))
    for _ in range(20):
        got = pair()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        held = pair()
    for _ in range(20):
        graph.replay()
        assert torch.equal(held[0], want[0]) and torch.equal(held[1], want[1])
    assert int(triton_utils._COUNTERS[x.device].abs().sum()) == 0
