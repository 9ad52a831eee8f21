"""FP8 block-scaled GEMMs at DeepSeek-V4-Flash prefill shapes on one GPU: which implementation to use.

    python benchmarks/bench_fp8.py [--tokens 8192] [--out FILE]

For each (N, K) of an official FP8 projection: the weight quantized as the checkpoint stores it (e4m3,
one power-of-two scale per 128 x 128 block), the activations per token per 128 channels (e4m3 with a
power-of-two scale, as DeepSeek-V4's reference inference quantizes them). Candidates, each timed with
CUDA events (bench_kernels.py's `timed`: median of 20 after a warm-up) and checked against the fp32
product of the dequantized operands (max |diff| / max |ref|):
  - bf16: `F.linear` on the dequantized bf16 weight (cuBLAS; today's path above 16 rows)
  - scaled_mm: `torch._scaled_mm` with block-wise scales (1 x 128 on the activations, 128 x 128 on the
    weight) from already-quantized activations (torch 2.11 accepts the activation scales with the
    token dimension fastest and the weight's as the transpose of its (N / 128, K / 128) tensor; run 71)
  - engine: this engine's `fp8_linear` from the bf16 activations (its quantization kernel included)
  - triton: this engine's own Triton GEMM on the same W8A8 contract (quantized in its prologue)
`--decode`: the decode-sized Triton GEMM (1 and 8 rows) at each decode projection's shape per launch plan
(BLOCK_N, programs aimed at, K steps a split at least, warps, stages), each call replayed from a CUDA
graph with its weight cold (a decode step reads its weights once), against its bytes at the copy
bandwidth measured in the same run. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from bench_kernels import timed

from dsv4serve.layers.formats import quantize_fp8_block

SHAPES = [(32768, 1024), (1024, 4096), (4096, 8192), (2048, 4096), (4096, 2048), (512, 4096)]
# a decode step's FP8 projections at Flash dimensions: wq_b, wq_a / one wo_a group, wo_b, shared gate or
# up, shared down, wkv, the indexer's wq_b
DECODE_SHAPES = [*SHAPES, (8192, 1024)]
DECODE_PLANS = [  # BLOCK_N, programs aimed at, K steps a split at least, warps, stages (2nd: `_plan`'s)
    (32, 264, 4, 4, 4), (64, 264, 4, 4, 4), (128, 264, 4, 4, 4), (32, 528, 2, 4, 4), (64, 528, 2, 4, 4),
    (128, 528, 2, 4, 4), (64, 264, 4, 8, 4), (32, 264, 4, 4, 6), (64, 1056, 1, 4, 4), (128, 1056, 1, 8, 4),
]  # fmt: skip


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> e4m3 (M, K), fp32 power-of-two scales (M, K / 128)."""
    m, k = x.shape
    blocks = x.float().view(m, k // 128, 128)
    e = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=1e-4) / 448.0))
    s = torch.exp2(e)
    return (blocks / s[..., None]).to(torch.float8_e4m3fn).view(m, k), s


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def candidates(
    x: torch.Tensor, w: torch.Tensor
) -> tuple[dict[str, Callable[[], torch.Tensor]], torch.Tensor]:
    """Each implementation of x (M, K) bf16 @ w (N, K)^T as W8A8 FP8, and the fp32 reference."""
    from dsv4serve.backends.cuda import linear as ours
    from dsv4serve.layers.linear import Fp8BlockWeight

    (m, k), n = x.shape, w.shape[0]
    wq, ws_e = quantize_fp8_block(w)
    ws = torch.exp2(ws_e.float() - 127)  # (N / 128, K / 128)
    xq, xs = act_quant(x)
    w_deq = (wq.float().view(n // 128, 128, k // 128, 128) * ws[:, None, :, None]).view(n, k)
    x_deq = (xq.float().view(m, k // 128, 128) * xs[..., None]).view(m, k)
    xb, w_bf16 = x_deq.to(torch.bfloat16), w_deq.to(torch.bfloat16)  # xb quantizes to xq, xs again
    fw = Fp8BlockWeight(wq, ws)
    xs_outer = xs.t().contiguous().t()  # (M, K / 128), M the fastest dimension: what torch accepts
    return {
        "bf16": lambda: F.linear(xb, w_bf16),
        "scaled_mm": lambda: torch._scaled_mm(xq, wq.t(), xs_outer, ws.t(), out_dtype=torch.bfloat16),
        "engine": lambda: ours.fp8_linear(xb, fw),
        "triton": lambda: ours.gemm(xb, wq.view(torch.uint8), torch.bfloat16, fp8=ws),
    }, x_deq @ w_deq.T


def decode_sweep(rows: list[int]) -> dict[str, Any]:
    """The Triton GEMM of `rows` rows at each decode shape under each of DECODE_PLANS: ms per call
    with its weight cold (a CUDA graph of calls over enough copies of the weight to pass 192 MB, more
    than the L2, between two reads of one copy; median replay over the calls), max |diff| / max |ref|
    against the fp32 product, and the sum over the shapes against their bytes at the copy bandwidth."""
    import triton
    from bench_decode import copy_bandwidth
    from bench_kernels import captured

    from dsv4serve.backends.cuda import linear as ours

    bandwidth = copy_bandwidth("cuda")
    plan = ours._plan
    result: dict[str, Any] = {"copy_gb_s": round(bandwidth / 1e9, 1)}
    weights = {}
    for n, k in DECODE_SHAPES:
        wq, ws_e = quantize_fp8_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        weights[(n, k)] = (wq.view(torch.uint8), torch.exp2(ws_e.float() - 127))
    floor = sum(w.numel() + s.numel() * 4 for w, s in weights.values()) / bandwidth * 1e3
    for m in rows:
        x = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in DECODE_SHAPES}
        refs = {}
        for (n, k), (wq, ws) in weights.items():
            w_deq = (wq.view(torch.float8_e4m3fn).float().view(n // 128, 128, k // 128, 128)
                     * ws[:, None, :, None]).view(n, k)  # fmt: skip
            xq, xs = act_quant(x[k])
            refs[(n, k)] = (xq.float().view(m, k // 128, 128) * xs[..., None]).view(m, k) @ w_deq.T
        entry: dict[str, Any] = {"floor_ms": round(floor, 4)}
        for bn, target, steps, warps, stages in DECODE_PLANS:
            label = f"{bn}x{target}x{steps}x{warps}x{stages}"

            def fixed(
                M: int,
                N: int,
                K: int,
                *_: Any,
                bn: int = bn,
                target: int = target,
                steps: int = steps,
                warps: int = warps,
                stages: int = stages,
            ) -> tuple[int, int, int, int, int, int]:
                splits = max(1, min(triton.cdiv(target, triton.cdiv(N, bn)), K // (128 * steps)))
                return 16, bn, 128, splits, warps, stages

            ours._plan = fixed  # type: ignore[assignment]
            try:
                per_shape, err = {}, 0.0
                for (n, k), (wq, ws) in weights.items():
                    a = x[k]
                    err = max(err, rel_err(ours.gemm(a, wq, torch.bfloat16, fp8=ws), refs[(n, k)]))
                    copies = [wq.clone() for _ in range(max(2, -(-(192 << 20) // wq.numel())))]

                    def calls(a: torch.Tensor = a, copies: list[torch.Tensor] = copies,
                              ws: torch.Tensor = ws) -> None:  # fmt: skip
                        for c in copies:
                            ours.gemm(a, c, torch.bfloat16, fp8=ws)

                    ms = timed(captured(calls, 1).replay, reps=20) / len(copies)
                    per_shape[f"{n}x{k}"] = round(ms, 4)
                    del copies
                total = sum(per_shape.values())
                entry[label] = {"total_ms": round(total, 4), "over_floor": round(total / floor, 2),
                                "rel_err": err, "ms": per_shape}  # fmt: skip
            except Exception as exc:
                entry[label] = repr(exc)[:200]
            ours._plan = plan
            print(m, label, entry[label], flush=True)
        result[f"m{m}"] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--decode", action="store_true", help="the decode GEMM's launch plans, 1 and 8 rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    if args.decode:
        report["decode"] = decode_sweep([1, 8])
        print(json.dumps(report))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        return
    m = args.tokens
    for n, k in SHAPES:
        row: dict[str, Any] = {}
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        cands, ref = candidates(x, w)
        for name, fn in cands.items():
            try:
                err = rel_err(fn(), ref)
                ms = timed(fn, reps=20)
                row[name] = {"ms": round(ms, 4), "tflops": round(2 * m * n * k / ms / 1e9, 1), "rel_err": err}
            except Exception as exc:  # a refused shape is a finding
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        report["shapes"][f"{m}x{n}x{k}"] = row
        print(json.dumps({f"{m}x{n}x{k}": row}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
