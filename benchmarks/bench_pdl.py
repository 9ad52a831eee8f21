"""Programmatic dependent launch (PDL) on a CUDA graph of Triton kernels, with and without (JSON out).

Two chains, each captured in one CUDA graph and replayed: 120 dependent elementwise kernels (4 and
132 programs each), and 12 GEMVs of one row over distinct bf16 weights (six 32768 x 1024, six 4096 x
8192: 604 MB, more than the L2 holds) with a 4-program kernel after each. Variants: no PDL; PDL (each
kernel waits for the one before it, then lets the next launch); PDL with each GEMV program's first
weight tile loaded before its wait. Every variant's outputs are checked against the others'.

    python benchmarks/bench_pdl.py
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _chain_kernel(x_ptr, y_ptr, N, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < N)
    tl.store(y_ptr + i, x * 0.999 + 1.0, mask=i < N)


@triton.jit
def _gemv_kernel(
    a_ptr, w_ptr, o_ptr, N, K, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if EARLY:  # the weights never change: their first tile may be read before the wait
        w0 = tl.load(w_ptr + n[:, None] * K + kk[None, :])
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    start = 0
    if EARLY:
        a0 = tl.load(a_ptr + m[:, None] * K + kk[None, :], mask=(m < 1)[:, None], other=0.0)
        acc += tl.dot(a0, tl.trans(w0))
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        k = k0 + kk
        a = tl.load(a_ptr + m[:, None] * K + k[None, :], mask=(m < 1)[:, None], other=0.0)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :])
        acc += tl.dot(a, tl.trans(w))
    tl.store(o_ptr + m[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=(m < 1)[:, None])


def graph_us(fn: Callable[[], None], reps: int = 20) -> tuple[float, torch.cuda.CUDAGraph]:
    """Median device time of one replay of `fn` captured in a CUDA graph (after a warm-up)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times[3:]) * 1e3, 1), graph


def elementwise_chains() -> dict[str, float]:
    out: dict[str, float] = {}
    for n in (4096, 132 * 1024):  # 4 programs, 132 programs
        bufs = [torch.randn(n, device="cuda") for _ in range(2)]
        for pdl in (False, True):

            def chain(pdl: bool = pdl, n: int = n, bufs: list[torch.Tensor] = bufs) -> None:
                for i in range(120):
                    _chain_kernel[(triton.cdiv(n, 1024),)](
                        bufs[i % 2], bufs[1 - i % 2], n, PDL=pdl, BLOCK=1024, num_warps=4, launch_pdl=pdl
                    )

            key = f"elementwise120_n{n}_pdl{int(pdl)}"
            out[key + "_us"], graph = graph_us(chain)
            bufs[0].fill_(1.0)
            graph.replay()
            torch.cuda.synchronize()
            out[key + "_sum"] = round(float(bufs[0].sum()), 3)  # equal with and without PDL
    return out


def gemv_chains() -> dict[str, float]:
    out: dict[str, float] = {}
    ws = [torch.randn(32768, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    ws += [torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    xs = [torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    outs = [torch.empty(1, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]
    tmp = torch.empty(4096, device="cuda")
    results = []
    for pdl, early in ((False, False), (True, False), (True, True)):

        def chain(pdl: bool = pdl, early: bool = early) -> None:
            for i, (w, o) in enumerate(zip(ws, outs, strict=True)):
                n, k = w.shape
                _gemv_kernel[(n // 32,)](
                    xs[i % 2], w, o, n, k, PDL=pdl, EARLY=early, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
                    num_warps=4, num_stages=4, launch_pdl=pdl,
                )  # fmt: skip
                _chain_kernel[(4,)](tmp, tmp, 4096, PDL=pdl, BLOCK=1024, num_warps=4, launch_pdl=pdl)

        key = f"gemv12_pdl{int(pdl)}_early{int(early)}"
        out[key + "_us"], graph = graph_us(chain)
        out[key + "_tb_s"] = round(sum(w.numel() * 2 for w in ws) / (out[key + "_us"] * 1e-6) / 1e12, 2)
        graph.replay()
        torch.cuda.synchronize()
        results.append(torch.cat([o.float() for o in outs], 1))
    out["gemv_variants_equal"] = float(all(torch.equal(r, results[0]) for r in results))
    return out


def main() -> None:
    report = {"gpu": torch.cuda.get_device_name(), **elementwise_chains(), **gemv_chains()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
