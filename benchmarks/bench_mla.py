"""MLA attention alone at GLM-4.7-Flash dimensions (20 heads, kv_lora 512, rope 64, bf16), one layer:
the CUDA backend's op (`backends/cuda/mla.py`: cuBLAS GEMMs around the Triton kernel) against the
reference torch ops in the same run, on random latents in scattered slots. Decode steps at batch 1 / 8
/ 64 with 1k and 8k context, prefill steps of 8 x 1024 and 1 x 8192 tokens. Each case: device time per
call (CUDA events around the eager call, so small steps include their launch costs), the largest
difference from the reference, and for decodes the bytes of latents read over the copy bandwidth.
Decodes are also timed replayed from a CUDA graph (as the engine runs them: `graph_ms`), and the
latent attention kernel(s) alone (`latent_ms`, graph-replayed). Prints one JSON object per case, then
one with every case. --sweep times the latent kernels over launch choices of each family instead.

    PYTHONPATH=. python benchmarks/bench_mla.py [--bandwidth-gb-s 4200] [--out FILE] [--sweep]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from bench_kernels import timed, timed_graph

from dsv4serve.attention import mla
from dsv4serve.backends.cuda import mla as cuda_mla
from dsv4serve.executor.inputs import forward_batch
from dsv4serve.protocol import SamplingParams, StepItem

H, L, R, NOPE, V = 20, 512, 64, 192, 256
DIMS = mla.MlaDims(H, 768, L, NOPE, R, V, 1e-6, (NOPE + R) ** -0.5)
CASES = {
    **{f"decode b{b} ctx{c}": [(c - 1, 1)] * b for c in (1024, 8192) for b in (1, 8, 64)},
    "prefill 8x1024": [(0, 1024)] * 8,
    "prefill 1x8192": [(0, 8192)],
}


def run_case(
    name: str, shares: list[tuple[int, int]], bandwidth: float, sweep: bool = False
) -> dict[str, Any]:
    """shares: (cached prefix, new tokens) per request."""
    total = sum(p + n for p, n in shares)
    table = torch.zeros(len(shares), max(p + n for p, n in shares), dtype=torch.int32, device="cuda")
    perm, used = torch.randperm(total, device="cuda").int(), 0
    for b, (p, n) in enumerate(shares):
        table[b, : p + n] = perm[used : used + p + n]
        used += p + n
    cache = torch.randn(total, L + R, device="cuda", dtype=torch.bfloat16)
    greedy = SamplingParams(temperature=0.0)
    items = [
        StepItem(rid=f"r{b}", prefix_len=p, token_ids=(5,) * n, sample=True, sampling=greedy, row=b)
        for b, (p, n) in enumerate(shares)
    ]
    meta = mla.mla_meta(forward_batch(items, (), "cuda"), table, torch.ones(R // 2, device="cuda"))
    tokens = int(meta.positions.shape[0])
    q_nope = torch.randn(tokens, H, NOPE, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(tokens, H, R, device="cuda", dtype=torch.bfloat16)
    kv_b = torch.randn(H * (NOPE + V), L, device="cuda", dtype=torch.bfloat16) / 20
    out: dict[str, Any] = {"case": name, "tokens": tokens}
    decode = tokens == len(shares)
    if sweep:
        q_lat = torch.randn(tokens, H, L, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            scale = DIMS.softmax_scale
            latent = lambda: cuda_mla.latent_attention(q_lat, q_pe, cache, meta, scale)  # noqa: E731
            return out | sweep_latent(latent, decode)
    with torch.inference_mode():
        q = torch.cat([q_nope, q_pe], -1)
        backend = lambda: cuda_mla.mla_attention(q, cache, kv_b, meta, DIMS)  # noqa: E731
        reference = lambda: mla.mla_attention(q, cache, kv_b, meta, DIMS, bound=1 << 28)  # noqa: E731
        out["backend_ms"] = timed(backend)
        out["reference_ms"] = timed(reference, 4)
        out["max_abs_diff"] = float((backend().float() - reference().float()).abs().max())
        q_lat = torch.randn(tokens, H, L, device="cuda", dtype=torch.bfloat16)
        latent = lambda: cuda_mla.latent_attention(q_lat, q_pe, cache, meta, DIMS.softmax_scale)  # noqa: E731
        if decode:  # captured as the engine captures decode steps (spans are ignored by small steps)
            out["graph_ms"] = timed_graph(backend)
            out["latent_ms"] = timed_graph(latent)
        else:
            out["latent_ms"] = timed(latent)
    if decode:  # a decode step: every token reads its request's latents once
        out["latent_bytes"] = total * (L + R) * 2
        out["latent_roofline_ms"] = round(out["latent_bytes"] / bandwidth * 1e3, 4)
    return out


DECODE_SWEEP = [
    (split, block_n, warps, stages)
    for split in (64, 128, 256, 512) for block_n in (32, 64) for warps in (8,) for stages in (2, 3)
]  # fmt: skip
PREFILL_SWEEP = [
    (rows, block_n, warps, stages)
    for rows in (32, 64) for block_n in (32, 64) for warps in (4, 8) for stages in (2,)
]  # fmt: skip


def sweep_latent(latent: Any, decode: bool) -> dict[str, Any]:
    """ms of the latent kernels per launch choice (decodes graph-replayed); failures recorded."""
    m = cuda_mla
    saved = (m.SPLIT, m.SPLIT_MIN, m.BLOCK_N, m.PREFILL_ROWS, m.PREFILL_BLOCK_N, dict(m.LAUNCH))
    times: dict[str, Any] = {}
    for a, block_n, warps, stages in DECODE_SWEEP if decode else PREFILL_SWEEP:
        if decode:
            cuda_mla.SPLIT, cuda_mla.SPLIT_MIN, cuda_mla.BLOCK_N = a, a, block_n
        else:
            cuda_mla.PREFILL_ROWS, cuda_mla.PREFILL_BLOCK_N = a, block_n
        cuda_mla.LAUNCH["decode" if decode else "prefill"] = {"num_warps": warps, "num_stages": stages}
        key = f"{'split' if decode else 'rows'}{a}_n{block_n}_w{warps}_s{stages}"
        try:
            times[key] = timed_graph(latent) if decode else timed(latent, 5)
        except Exception as e:  # e.g. out of shared memory: recorded, the sweep goes on
            times[key] = f"{type(e).__name__}: {str(e)[:80]}"
    m.SPLIT, m.SPLIT_MIN, m.BLOCK_N, m.PREFILL_ROWS, m.PREFILL_BLOCK_N, launch = saved
    cuda_mla.LAUNCH.update(launch)
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    return {"sweep_ms": times, "best": min(ok, key=ok.__getitem__) if ok else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bandwidth-gb-s", type=float, default=4200.0, help="copy bandwidth (H200: ~4,200)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true", help="launch choices of the latent kernels")
    args = parser.parse_args()
    torch.manual_seed(0)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for name, shares in CASES.items():
        case = run_case(name, shares, args.bandwidth_gb_s * 1e9, args.sweep)
        report["cases"].append(case)
        print(json.dumps(case), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
