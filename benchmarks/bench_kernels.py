"""Tile sweeps of the heaviest Triton kernels at DeepSeek-V4-Flash dimensions on the GPU: the routed
experts of an 8 x 1024 prefill (49,152 token-expert pairs over 256 experts) and sparse attention at
prefill (8 x 1024) and decode (batch 1, 8, 16 and 64 at 1k context; batch 1 at 8k over 512 picks), the
small steps with and without splitting the keys over programs, and the mHC pre-mix of an 8 x 1024
prefill. Prints one JSON object: median ms per variant, with the variant the package uses now marked
"current".

    python benchmarks/bench_kernels.py [--mhc | --moe | --gemv | --launch | --prefill | --grouped-mm | --pdl]

Each option runs one sweep only. --gemv: the decode projections' GEMMs at 1 and 8 rows, per tile, in
us and GB/s of weight read; --launch: a CUDA graph launch's host time and when the device starts its
work; --prefill: the 8 x 1024 attention and mHC sweeps; --grouped-mm: the prefill experts' GEMMs in
torch._grouped_mm against torch.compile's max-autotune Triton templates; --pdl: chains of Triton
kernels in a CUDA graph without and with programmatic dependent launch (each kernel waits for the one
before it, then lets the next launch).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4serve.attention import core
from dsv4serve.backends.cuda import experts as experts_triton
from dsv4serve.backends.cuda import mhc as mhc_triton
from dsv4serve.backends.cuda import norm_rope as norm_rope_triton
from dsv4serve.backends.cuda import sparse as sparse_triton
from dsv4serve.layers import mhc
from tests.kernel_cases import kernel_model, make_case
from tools.kernel_shapes import FLASH


def timed(fn: Any, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times[1:]), 3)


def captured(fn: Any, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of fn (after one eager warm-up call)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def timed_graph(fn: Any, calls: int = 20) -> float:
    """Median ms of one call, replayed from a CUDA graph of `calls` calls: what a captured decode
    step pays (no launch overhead), for kernels shorter than their Python launch."""
    return round(timed(captured(fn, calls).replay) / calls, 4)


def moe_inputs(tokens: int = 8192) -> tuple[torch.Tensor, ...]:
    """An 8 x 1024 prefill's routed experts at Flash's dimensions: x, weights, ids (random distinct
    experts), w13 (E, 2I, H: w1 and w3 its halves), w2; bf16 on the GPU."""
    experts, hidden, inter, k = 256, 4096, 2048, 6
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    ids = torch.rand(tokens, experts, device="cuda").argsort(-1)[:, :k]
    weights = torch.rand(tokens, k, device="cuda", dtype=torch.bfloat16)
    return x, weights, ids, w13, w2


def moe_sweep() -> dict[str, float]:
    x, weights, ids, w13, w2 = moe_inputs()
    inter = w2.shape[-1]
    current = experts_triton._tiles
    out: dict[str, float] = {}
    tiles = [(64, 128, 64, 8), (128, 64, 64, 8), (128, 128, 64, 8), (64, 64, 64, 4), (128, 128, 32, 8)]
    grouped, experts_triton.GROUPED_MM_PREFILL = experts_triton.GROUPED_MM_PREFILL, False  # the Triton path
    for tile in [None, *tiles]:
        experts_triton._tiles = current if tile is None else (lambda *_, t=(*tile, 3): t)  # type: ignore[misc]
        name = "current" if tile is None else "x".join(map(str, tile))
        out[name] = timed(
            lambda: experts_triton.routed_experts(x, weights, ids, w13[:, :inter], w2, w13[:, inter:], 10.0)
        )
    experts_triton._tiles = current
    experts_triton.GROUPED_MM_PREFILL = grouped
    if hasattr(torch, "_grouped_mm"):
        try:
            out["torch_grouped_mm"] = timed(
                lambda: experts_triton.grouped_mm_experts(
                    x, weights, ids, w13[:, :inter], w2, w13[:, inter:], 10.0
                )
            )
            want = experts_triton.routed_experts(
                x[:512], weights[:512], ids[:512], w13[:, :inter], w2, w13[:, inter:], 10.0
            )
            got = experts_triton.grouped_mm_experts(
                x[:512], weights[:512], ids[:512], w13[:, :inter], w2, w13[:, inter:], 10.0
            )
            out["torch_grouped_mm_rel_err"] = float((got.float() - want.float()).norm() / want.float().norm())
        except Exception as exc:
            print("grouped_mm", type(exc).__name__, str(exc)[:300])
    return out


def inductor_grouped_mm() -> dict[str, Any]:
    """The prefill experts' two grouped GEMMs (8 x 1024 tokens, 6 of 256 experts each: ~192 rows per
    expert) in `torch._grouped_mm` (CUTLASS, 128-row tiles for these shapes) against what torch's
    own compiler makes of them under max-autotune: its Triton grouped-GEMM templates (TMA, persistent,
    64- and 128-row tiles) benchmarked beside the CUTLASS kernel, the best kept. Median ms of each call
    (event-timed: the compiled call's host work counts where the device waits for it); inductor logs
    each template's own time (stderr)."""
    import torch._inductor.config as inductor_config

    x, _, ids, w13, w2 = moe_inputs()
    counts = torch.bincount(ids.flatten(), minlength=w13.shape[0])
    offs = counts.cumsum(0).int()
    rows = x.repeat_interleave(ids.shape[1], 0)  # (pairs, H): a GEMM's time does not hang on which rows
    h = torch.randn(rows.shape[0], w2.shape[-1], device="cuda", dtype=torch.bfloat16)
    out: dict[str, Any] = {"rows_per_expert": [int(counts.min()), int(counts.max())]}

    def grouped(a: torch.Tensor, b: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, b, offs=o)

    inductor_config.max_autotune_gemm_backends = "TRITON,ATEN"
    compiled = torch.compile(grouped, mode="max-autotune-no-cudagraphs", dynamic=False)
    for name, a, b in (("gate_up", rows, w13.transpose(1, 2)), ("down", h, w2.transpose(1, 2))):
        out[f"{name}_grouped_mm"] = timed(lambda a=a, b=b: grouped(a, b, offs))
        begin = time.perf_counter()
        got = compiled(a, b, offs)
        out[f"{name}_compile_s"] = round(time.perf_counter() - begin, 1)
        out[f"{name}_inductor"] = timed(lambda a=a, b=b: compiled(a, b, offs))
        out[f"{name}_max_abs_diff"] = float((got.float() - grouped(a, b, offs).float()).abs().max())
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[-1]
        out[f"{name}_grouped_mm_tflops"] = round(flops / out[f"{name}_grouped_mm"] / 1e9, 1)
    return out


def q_norm_rope_timing(tokens: int = 8192) -> dict[str, float]:
    """One prefill's per-head q norm + rope (Flash: 64 heads x 512): ms and GB/s read + written."""
    cfg = kernel_model(**{**FLASH, "compress_ratios": [0, 4, 128], "max_position_embeddings": 16384})
    case = make_case(0, [(0, 1024)] * (tokens // 1024), page_size=64, dtype="bfloat16", cfg=cfg)
    q = torch.randn(tokens, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: norm_rope_triton.q_norm_rope(q, case.fused, False, 1e-6))
    return {"ms": ms, "gb_s": round(2 * q.numel() * q.element_size() / ms / 1e6, 1)}


def gate_up_timing() -> dict[str, float]:
    """The prefill experts (torch._grouped_mm) with gate and up as one GEMM over a stacked [W1; W3]
    weight, and as two GEMMs (the same weights apart)."""
    x, weights, ids, w13, w2 = moe_inputs()
    inter = w2.shape[-1]
    out: dict[str, float] = {}
    results = []
    for name, (w1, w3) in (
        ("one_gemm", (w13[:, :inter], w13[:, inter:])),
        ("two_gemms", (w13[:, :inter].clone(), w13[:, inter:].clone())),
    ):
        out[name] = timed(
            lambda w1=w1, w3=w3: experts_triton.grouped_mm_experts(x, weights, ids, w1, w2, w3, 10.0)
        )
        results.append(experts_triton.grouped_mm_experts(x, weights, ids, w1, w2, w3, 10.0).float())
    out["max_abs_diff"] = float((results[0] - results[1]).abs().max())
    return out


def attention_sweep(
    steps: list[tuple[int, int]], which: str, topk: int = 0, ratio: int = 4
) -> dict[str, float]:
    """Median ms of one attention call (ratio 4: the window and every visible entry, 0: the window
    only) per tile config of `which` (CONFIG, SPLIT_CONFIG); `topk` > 0 attends to that many indexer
    picks per token instead of every visible entry."""
    cfg = kernel_model(**{**FLASH, "compress_ratios": [0, 4, 128], "max_position_embeddings": 16384})
    case = make_case(0, steps, page_size=64, dtype="bfloat16", cfg=cfg)
    T, H, D = case.batch.num_tokens, cfg.num_heads, cfg.head_dim
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(H, device="cuda")
    swa, cmp = case.buffer("swa", 1), case.buffer("c4", 1)
    cmp_ = cmp if ratio else None
    idx = None
    if topk:  # random distinct visible entries, packed before their padding, as the indexer returns them
        visible = ((case.batch.positions + 1) // 4)[:, None]
        entries = torch.arange(case.batch.max_seq_len // 4, device="cuda")
        scores = torch.rand(T, entries.numel(), device="cuda").masked_fill(entries >= visible, -1.0)
        chosen = scores.topk(min(topk, entries.numel()), dim=-1).indices
        idx = core.in_index_order(chosen, chosen < visible)
    current = getattr(sparse_triton, which)
    clock = timed if T > sparse_triton.PREFILL_TOKENS else timed_graph  # decode steps are captured
    if which == "SPLIT_CONFIG":
        configs = [(16, 32, 8, 2, 32), (16, 32, 4, 2, 64), (32, 32, 8, 2, 32), (64, 32, 8, 2, 32)]
        configs += [(16, 64, 8, 2, 64), (16, 32, 4, 3, 32)]
    else:  # (block_h, block_n, warps, stages)
        configs = [(64, 64, 8, 2), (64, 16, 8, 3), (64, 32, 8, 1), (64, 16, 8, 2), (16, 64, 4, 2)]
    out: dict[str, float] = {}
    for c in [None, *configs]:
        setattr(sparse_triton, which, current if c is None else sparse_triton.AttentionConfig(*c))
        name = "current" if c is None else "x".join(map(str, c))
        try:
            out[name] = clock(
                lambda: sparse_triton.sparse_attention(q, swa, cmp_, idx, case.fused, sinks, D**-0.5, ratio)
            )
        except Exception as exc:  # a tile that does not fit (shared memory) is reported, not fatal
            out[name] = float("nan")
            print(name, type(exc).__name__, str(exc)[:200])
    setattr(sparse_triton, which, current)
    if which == "SPLIT_CONFIG":  # the same step without splitting
        tokens, sparse_triton.SPLIT_TOKENS = sparse_triton.SPLIT_TOKENS, 0
        out["no_split"] = clock(
            lambda: sparse_triton.sparse_attention(q, swa, cmp_, idx, case.fused, sinks, D**-0.5, ratio)
        )
        sparse_triton.SPLIT_TOKENS = tokens
    return out


def mhc_sweep(tokens: int = 8192) -> dict[str, float]:
    """Median ms of one hc_pre (mixes + epilogue) at Flash's hidden size per prefill tiling:
    BLOCK_T x BLOCK_K x warps x K-slices."""
    n, D = 4, FLASH["hidden_size"]
    params = mhc.HcParams(mult=n, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    hc = mhc.HyperConnection(
        fn=torch.randn((2 + n) * n, n * D, device="cuda") * 0.01,
        base=torch.randn((2 + n) * n, device="cuda"),
        scale=torch.rand(3, device="cuda") + 0.5,
    )
    h = torch.randn(tokens, n, D, device="cuda", dtype=torch.bfloat16)
    norm = torch.randn(D, device="cuda", dtype=torch.bfloat16)
    tiles, splits = mhc_triton.PREFILL_TILES, mhc_triton.LARGE_SPLITS
    configs = [(128, 32, 8, 4), (128, 32, 8, 16), (256, 32, 8, 8), (128, 32, 4, 8), (64, 64, 4, 16)]
    configs += [(128, 64, 8, 8), (128, 128, 8, 8), (256, 64, 8, 8), (64, 128, 4, 8)]
    out: dict[str, float] = {}
    for c in [None, *configs]:
        mhc_triton.PREFILL_TILES = tiles if c is None else c[:3]
        mhc_triton.LARGE_SPLITS = splits if c is None else c[3]
        name = "current" if c is None else "x".join(map(str, c))
        try:
            out[name] = timed(lambda: mhc_triton.hc_pre(h, hc, norm, params))
        except Exception as exc:
            out[name] = float("nan")
            print(name, type(exc).__name__, str(exc)[:200])
    mhc_triton.PREFILL_TILES, mhc_triton.LARGE_SPLITS = tiles, splits
    return out


GEMV_SHAPES = {  # (N, K) of every decode-step projection at DeepSeek-V4-Flash dimensions
    "wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
    "compressor_c4": (2048, 4096), "compressor_c128": (1024, 4096), "indexer_wq_b": (8192, 1024),
    "indexer_compressor": (512, 4096), "weights_proj": (64, 4096), "gate": (256, 4096),
    "head": (129280, 4096),
}  # fmt: skip
GEMV_TILES = [  # BLOCK_N, BLOCK_K, warps, stages, target programs
    (16, 256, 4, 4, 264), (32, 256, 4, 4, 264), (32, 128, 4, 4, 264), (32, 512, 4, 3, 264),
    (64, 256, 4, 4, 264), (64, 128, 4, 4, 264), (32, 256, 8, 4, 264), (64, 256, 8, 4, 264),
    (32, 256, 4, 4, 528), (16, 256, 4, 4, 528), (32, 256, 4, 5, 264), (16, 512, 4, 3, 528),
]  # fmt: skip


def gemv_sweep(rows: int) -> dict[str, Any]:
    """Each decode projection's GEMM at `rows` rows, replayed in a graph, per tile: us and GB/s of
    weight read (the roofline's measure), next to the current plan."""
    from dsv4serve.backends.cuda import linear as quant_triton

    current = quant_triton._plan
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MB: more than the L2
    flush_ms = timed_graph(flush.zero_, 10)
    out: dict[str, Any] = {}
    for name, (N, K) in GEMV_SHAPES.items():
        a = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        row: dict[str, Any] = {}
        for tile in [None, *GEMV_TILES]:
            if tile is None:
                quant_triton._plan = current
            else:
                bn, bk, warps, stages, target = tile
                splits = max(1, min(triton.cdiv(target, triton.cdiv(N, bn)), K // (4 * bk)))
                quant_triton._plan = lambda *_, c=(16, bn, bk, splits, warps, stages): c  # type: ignore[misc]
            ms = timed_graph(lambda a=a, w=w: (flush.zero_(), quant_triton.gemm(a, w, torch.bfloat16)), 10)
            ms -= flush_ms  # each call after the L2 is flushed: a decode step reads every weight cold
            label = "current" if tile is None else "x".join(map(str, tile))
            row[label] = {"us": round(ms * 1e3, 1), "gb_s": round(N * K * 2 / (ms * 1e-3) / 1e9)}
        quant_triton._plan = current
        out[name] = row
    return out


def launch_sweep() -> dict[str, Any]:
    """What a graph launch costs the host and when the device starts: graphs of n tiny kernels (host
    time of `replay()`, and until the device is done), and 128 kernels of ~8 us each launched as one
    graph or as k graphs back to back (if the device waits for a whole launch, k graphs finish sooner)."""
    x = torch.zeros(1, device="cuda")
    out: dict[str, Any] = {}

    def clocks(graphs: list[torch.cuda.CUDAGraph], reps: int = 30) -> dict[str, float]:
        host, wall = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            for g in graphs:
                g.replay()
            launched = time.perf_counter()
            torch.cuda.synchronize()
            host.append(launched - begin)
            wall.append(time.perf_counter() - begin)
        return {
            "host_us": round(statistics.median(host[3:]) * 1e6, 1),
            "wall_us": round(statistics.median(wall[3:]) * 1e6, 1),
        }

    for n in (32, 64, 128, 256):
        out[f"tiny_x{n}"] = clocks([captured(lambda: x.add_(1), n)])
    cycles = 15_000  # ~8 us at the H200's boost clock; the measured length is reported
    out["sleep_us"] = round(timed_graph(lambda: torch.cuda._sleep(cycles)) * 1e3, 2)
    for k in (1, 2, 4, 8):
        out[f"sleep8us_x128_in_{k}"] = clocks(
            [captured(lambda: torch.cuda._sleep(cycles), 128 // k) for _ in range(k)]
        )
    return out


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


def pdl_elementwise_chains() -> dict[str, Any]:
    """120 dependent elementwise kernels (4 and 132 programs each) in one CUDA graph, without and with
    PDL: ms per replay, and the chain's result (equal with and without)."""
    out: dict[str, Any] = {}
    for n in (4096, 132 * 1024):
        bufs = [torch.randn(n, device="cuda") for _ in range(2)]
        for pdl in (False, True):

            def chain(pdl: bool = pdl, n: int = n, bufs: list[torch.Tensor] = bufs) -> None:
                for i in range(120):
                    _chain_kernel[(triton.cdiv(n, 1024),)](
                        bufs[i % 2], bufs[1 - i % 2], n, PDL=pdl, BLOCK=1024, num_warps=4, launch_pdl=pdl
                    )

            key = f"elementwise120_n{n}_pdl{int(pdl)}"
            graph = captured(chain, 1)
            out[key + "_ms"] = timed(graph.replay, 20)
            bufs[0].fill_(1.0)
            graph.replay()
            out[key + "_sum"] = round(float(bufs[0].sum()), 3)
    return out


def pdl_gemv_chains() -> dict[str, Any]:
    """12 one-row GEMVs over distinct bf16 weights (six 32768 x 1024, six 4096 x 8192: 604 MB, more
    than the L2 holds), a 4-program kernel after each, in one CUDA graph: without PDL, with it, and
    with each GEMV program's first weight tile loaded before its wait."""
    out: dict[str, Any] = {}
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
        graph = captured(chain, 1)
        out[key + "_ms"] = timed(graph.replay, 20)
        out[key + "_tb_s"] = round(sum(w.numel() * 2 for w in ws) / (out[key + "_ms"] * 1e-3) / 1e12, 2)
        graph.replay()
        results.append(torch.cat([o.float() for o in outs], 1))
    out["gemv_variants_equal"] = all(torch.equal(r, results[0]) for r in results)
    return out


def main() -> None:
    if sys.argv[1:] == ["--prefill"]:
        report = {
            "gpu": torch.cuda.get_device_name(),
            "attention_prefill_8x1024": attention_sweep([(0, 1024)] * 8, "PREFILL_CONFIG"),
            "attention_prefill_8x1024_window": attention_sweep([(0, 1024)] * 8, "PREFILL_CONFIG", ratio=0),
            "q_norm_rope_8x1024": q_norm_rope_timing(),
            "experts_gate_up_8x1024": gate_up_timing(),
            "mhc_prefill_8x1024": mhc_sweep(),
        }
        print(json.dumps(report))
        return
    if sys.argv[1:] == ["--grouped-mm"]:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "experts_8x1024": inductor_grouped_mm()}))
        return
    if sys.argv[1:] == ["--launch"]:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "graph_launch": launch_sweep()}))
        return
    if sys.argv[1:] == ["--pdl"]:
        report = {"gpu": torch.cuda.get_device_name(), **pdl_elementwise_chains(), **pdl_gemv_chains()}
        print(json.dumps(report))
        return
    if sys.argv[1:] == ["--gemv"]:
        report = {"gpu": torch.cuda.get_device_name(), "gemv_m1": gemv_sweep(1), "gemv_m8": gemv_sweep(8)}
        print(json.dumps(report))
        return
    if sys.argv[1:] == ["--mhc"]:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "mhc_prefill_8x1024": mhc_sweep()}))
        return
    if sys.argv[1:] == ["--moe"]:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "moe_prefill_8x1024": moe_sweep()}))
        return
    report = {
        "gpu": torch.cuda.get_device_name(),
        "mhc_prefill_8x1024": mhc_sweep(),
        "moe_prefill_8x1024": moe_sweep(),
        "attention_prefill_8x1024": attention_sweep([(0, 1024)] * 8, "PREFILL_CONFIG"),
        "attention_decode_b1_1k": attention_sweep([(1023, 1)], "SPLIT_CONFIG"),
        "attention_decode_b8_1k": attention_sweep([(1023, 1)] * 8, "SPLIT_CONFIG"),
        "attention_decode_b16_1k": attention_sweep([(1023, 1)] * 16, "SPLIT_CONFIG"),
        "attention_decode_b1_8k_top512": attention_sweep([(8191, 1)], "SPLIT_CONFIG", topk=512),
        "attention_decode_b64_1k": attention_sweep([(1023, 1)] * 64, "CONFIG"),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
