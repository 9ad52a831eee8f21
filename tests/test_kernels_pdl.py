"""Programmatic dependent launch: when it is on, and that a chain of dependent kernels launched with
it (split-K GEMMs sharing the arrival counters, norms between them) gives, in a CUDA graph, exactly
what the same chain gives without it."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.backends.cuda import triton_utils
from dsv4serve.backends.cuda.linear import gemm
from dsv4serve.backends.cuda.norm_rope import rms_norm
from tests.kernel_cases import DEVICE, on_device


def test_off_on_the_cpu_and_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert triton_utils.launch_options(torch.zeros(1)) == {"PDL": False}
    triton_utils.pdl_enabled.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_utils.pdl_enabled(torch.device("cuda", 0))
    triton_utils.pdl_enabled.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DSV4SERVE_PDL", "0")
    assert not triton_utils.pdl_enabled(torch.device("cuda", 0))  # switched off: no device asked
    triton_utils.pdl_enabled.cache_clear()


def _chain(x: torch.Tensor, ws: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
    for w in ws:  # each GEMM reads the norm before it, each norm the GEMM before it
        x = rms_norm(gemm(x, w, x.dtype), norm, 1e-6)
    return x


@pytest.mark.skipif(DEVICE != "cuda", reason="PDL needs a CUDA device (compute capability 9+)")
def test_graph_of_dependent_kernels_matches_without_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9 or more")
    gen = torch.Generator().manual_seed(5)
    K = 2048  # split over several programs per tile at one row: the counters are shared by every GEMM
    ws = [on_device(torch.randn(K, K, generator=gen).bfloat16() * K**-0.5) for _ in range(24)]
    norm = on_device(torch.rand(K, generator=gen) + 0.5)
    x = on_device(torch.randn(1, K, generator=gen).bfloat16())
    monkeypatch.setattr(triton_utils, "pdl_enabled", lambda device: False)
    want = _chain(x, ws, norm)
    monkeypatch.setattr(triton_utils, "pdl_enabled", lambda device: True)
    assert triton_utils.launch_options(x) == {"PDL": True, "launch_pdl": True}
    eager = _chain(x, ws, norm)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _chain(x, ws, norm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, ws, norm)
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(eager, want, rtol=0, atol=0)
