"""The routed experts alone at DeepSeek-V4-Flash dimensions (256 experts, hidden 4096, intermediate
2048, top 6; `--dims glm`: GLM-4.7-Flash's 64 experts, hidden 2048, intermediate 1536, top 4 and its
shared expert riding along) on one GPU, per weight format: bf16, W8A8 int8 and MXFP4 (W4A16), at
decode batches and an 8 x 1024 prefill. Each case is timed as CUDA-graph replays (median ms of 20)
and set against the bytes of the experts it chose (what a step must read: the floor of its time at
the copy bandwidth measured in the same run). MXFP4 also runs its plain-Triton decode (the
interpreter's twin of the PTX one), a sweep of decode tiles (BLOCK_N x BLOCK_K x warps) and the
prefill's fused kernel (its tiles swept) against the default: decoded to bf16, then
torch._grouped_mm. `--bf16-sweep`: the bf16 decode kernels' tiles (BLOCK_N x BLOCK_K x warps x
stages), each call after the L2 is flushed (a decode step reads its experts cold). `--split-sweep`: the
decode kernels' K loops summed in (gate/up, down) slices (`experts.DECODE_SLICES`), split over that
many programs where the tile grid has fewer than `SPLIT_BELOW` ("auto") or never / always, every
format, each call after an L2 flush. Prints one JSON object.

    python benchmarks/bench_experts.py [--dims flash|glm] [--batches 1 8 64] [--prefill 8192] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from bench_decode import copy_bandwidth
from bench_kernels import captured, timed

from dsv4serve.backends.cuda import experts as kt
from dsv4serve.layers.formats import quantize_mxfp4
from dsv4serve.layers.linear import Int8Weight, Mxfp4Weight, Weight, quantize_int8

DIMS = {"flash": (256, 4096, 2048, 6, False), "glm": (64, 2048, 1536, 4, True)}  # E, H, I, k, shared
EXPERTS, HIDDEN, INTER, TOP_K, SHARED = DIMS["flash"]
BF16_DECODE_TILES = [  # BLOCK_N, BLOCK_K, warps, stages
    (64, 128, 4, 3), (32, 128, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (16, 128, 4, 4), (16, 256, 4, 3),
    (64, 256, 4, 3), (64, 64, 4, 4), (32, 64, 4, 5), (128, 128, 4, 3), (32, 128, 8, 4), (64, 128, 8, 4),
]  # fmt: skip
PREFILL_TILES = [(128, 128, 64, 8), (128, 128, 128, 8), (64, 128, 128, 4), (128, 64, 128, 4), (64, 64, 64, 4)]


def graph_ms(fn: Callable[[], Any]) -> float:
    """Median ms of one call replayed from a CUDA graph (bench_kernels.py's timing)."""
    return timed(captured(fn, 1).replay, reps=20)


def weights(fmt: str) -> tuple[Weight, Weight, Weight]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def one(shape: tuple[int, int]) -> Weight:
        if fmt == "bf16":
            return torch.randn(EXPERTS, *shape, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        if fmt == "int8":
            parts = [
                quantize_int8(torch.randn(*shape, device="cuda", generator=gen) * 0.02)
                for _ in range(EXPERTS)
            ]
            return Int8Weight(torch.stack([p.qweight for p in parts]), torch.stack([p.scale for p in parts]))
        packed, scales = zip(
            *(
                quantize_mxfp4(torch.randn(*shape, device="cuda", generator=gen) * 0.02)
                for _ in range(EXPERTS)
            ),
            strict=True,
        )
        return Mxfp4Weight(torch.stack(packed), torch.stack(scales))

    return one((INTER, HIDDEN)), one((HIDDEN, INTER)), one((INTER, HIDDEN))


def expert_bytes(w: tuple[Weight, Weight, Weight]) -> int:
    """One expert's bytes in its format (values and scales)."""
    total = 0
    for part in w:
        tensors = (part.qweight, part.scale) if isinstance(part, Int8Weight) else (
            (part.packed, part.scale) if isinstance(part, Mxfp4Weight) else (part,)
        )  # fmt: skip
        total += sum(t[0].numel() * t.element_size() for t in tensors)
    return total


def case(
    tokens: int, w: tuple[Weight, Weight, Weight], bandwidth: float, flush: torch.Tensor | None = None
) -> dict[str, Any]:
    """One call at `tokens` tokens (with `flush`, after the L2 is overwritten: the flush's own time is
    taken off)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).argsort(-1)[:, :TOP_K].to(torch.int32)
    route = torch.rand(tokens, TOP_K, device="cuda", generator=gen, dtype=torch.bfloat16)
    shared = tuple(p[EXPERTS - 1] for p in w) if SHARED else None  # (a copy's bytes: an expert's)
    if flush is None:
        ms = graph_ms(lambda: kt.routed_experts(x, route, ids, *w, 7.0, shared))  # type: ignore[arg-type]
    else:
        ms = graph_ms(lambda: (flush.zero_(), kt.routed_experts(x, route, ids, *w, 7.0, shared)))  # type: ignore[arg-type]
        ms -= graph_ms(flush.zero_)
    distinct = int(ids.unique().numel()) + SHARED
    floor = distinct * expert_bytes(w) / bandwidth / 1e6
    return {
        "ms": round(ms, 4),
        "distinct": distinct,
        "floor_ms": round(floor, 4),
        "over_floor": round(ms / floor, 2),
    }


def bf16_sweep(w: tuple[Weight, Weight, Weight], bandwidth: float, batches: list[int]) -> dict[str, Any]:
    """The bf16 decode kernels per tile at each batch, every call after an L2 flush: ms (the current
    tiles first)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MB: more than the L2
    tiles, result = kt._tiles, {}
    for tile in [None, *BF16_DECODE_TILES]:
        label = "current" if tile is None else "x".join(map(str, tile))
        if tile is not None:
            kt._tiles = lambda *_, t=(16, *tile): t  # type: ignore[assignment]
        try:
            result[label] = {f"t{b}": case(b, w, bandwidth, flush) for b in batches}
        except Exception as exc:
            result[label] = repr(exc)[:120]
        kt._tiles = tiles
        print(label, result[label], flush=True)
    return result


SPLITS = [((1, 1), "auto"), ((4, 4), "auto"), ((4, 4), "never"), ((8, 4), "auto"), ((8, 4), "always"),
          ((16, 8), "always"), ((2, 2), "auto")]  # fmt: skip


def split_sweep(w: tuple[Weight, Weight, Weight], bandwidth: float, batches: list[int]) -> dict[str, Any]:
    """The decode kernels per (gate/up, down) slices and split rule at each batch, each call after an
    L2 flush (int8 splits always: its sums are exact)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    slices, below, result = kt.DECODE_SLICES, kt.SPLIT_BELOW, {}
    for pair, rule in SPLITS:
        kt.DECODE_SLICES = {fmt: pair for fmt in slices}
        kt.SPLIT_BELOW = {"auto": below, "never": 0, "always": 1 << 30}[rule]
        label = "x".join(map(str, pair)) + "_" + rule
        try:
            result[label] = {f"t{b}": case(b, w, bandwidth, flush) for b in batches}
        except Exception as exc:
            result[label] = repr(exc)[:120]
        print("split", label, result[label], flush=True)
    kt.DECODE_SLICES, kt.SPLIT_BELOW = slices, below
    return result


def dequantize_sweep(w: Weight, bandwidth: float) -> dict[str, Any]:
    """The prefill path's MXFP4 -> bf16 kernel on one stacked weight, per (rows, 32-blocks, warps):
    ms and GB/s of bytes read and written (the floor: those bytes at the copy bandwidth)."""
    assert isinstance(w, Mxfp4Weight)
    out = torch.empty(w.shape, dtype=torch.bfloat16, device="cuda")
    moved = w.packed.numel() + w.scale.numel() + 2 * out.numel()
    result: dict[str, Any] = {"floor_ms": round(moved / bandwidth / 1e6, 4)}
    default = kt.FP4_DEQUANTIZE_TILE
    for tile in ((64, 4, 4), (32, 8, 4), (128, 2, 4), (64, 8, 8), (128, 4, 8), (16, 16, 4), (256, 1, 4)):
        kt.FP4_DEQUANTIZE_TILE = tile
        try:
            ms = graph_ms(lambda: kt.dequantize_fp4(w, out))
            result["x".join(map(str, tile))] = {"ms": round(ms, 4), "gb_s": round(moved / ms / 1e6, 1)}
        except Exception as exc:
            result["x".join(map(str, tile))] = repr(exc)[:120]
    kt.FP4_DEQUANTIZE_TILE = default
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--formats", nargs="+", default=["mxfp4", "int8", "bf16"])
    parser.add_argument("--sweep", action="store_true", help="the MXFP4 tile sweeps")
    parser.add_argument("--dequantize", action="store_true", help="the MXFP4 -> bf16 kernel's tiles")
    parser.add_argument("--dims", choices=sorted(DIMS), default="flash")
    parser.add_argument("--bf16-sweep", action="store_true", help="the bf16 decode tiles, L2 flushed")
    parser.add_argument("--split-sweep", action="store_true", help="split K loops, L2 flushed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    global EXPERTS, HIDDEN, INTER, TOP_K, SHARED
    EXPERTS, HIDDEN, INTER, TOP_K, SHARED = DIMS[args.dims]
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "dims": args.dims}
    report["copy_gb_s"] = round(copy_bandwidth("cuda") / 1e9, 1)  # as bench_decode.py measures it
    bw = report["copy_gb_s"]
    for fmt in args.formats:
        w = weights(fmt)
        entry: dict[str, Any] = {"expert_bytes": expert_bytes(w)}
        if args.split_sweep:
            entry["splits_cold"] = split_sweep(w, bw, args.batches)
        for tokens in [*args.batches, args.prefill] if args.prefill else args.batches:
            try:
                entry[f"t{tokens}"] = case(tokens, w, bw)
            except Exception as exc:  # a kernel that fails to build is a result: the rest still runs
                entry[f"t{tokens}"] = repr(exc)[-300:]
            print(fmt, tokens, entry[f"t{tokens}"], flush=True)
        if fmt == "mxfp4" and args.sweep:
            ptx, tiles = kt.ptx_enabled, kt._tiles
            kt.ptx_enabled = lambda device: False  # type: ignore[assignment]
            entry["plain_triton_decode"] = {f"t{b}": case(b, w, bw) for b in args.batches}
            kt.ptx_enabled = ptx
            sweep = {}
            for bn in (32, 64, 128):
                for bk in (64, 128, 256):
                    for warps in (4, 8):
                        kt._tiles = lambda *_, bn=bn, bk=bk, warps=warps: (16, bn, bk, warps, 3)  # type: ignore[assignment]
                        try:
                            sweep[f"{bn}x{bk}x{warps}"] = {
                                f"t{b}": case(b, w, bw)["ms"] for b in args.batches
                            }
                        except Exception as exc:
                            sweep[f"{bn}x{bk}x{warps}"] = repr(exc)[:120]
            entry["decode_tiles"] = sweep
            prefill = {}
            kt.FP4_PREFILL_DEQUANTIZED = False  # the fused kernel at prefill size, for the record
            for bm, bn, bk, warps in PREFILL_TILES:
                kt._tiles = lambda *_, t=(bm, bn, bk, warps, 3): t  # type: ignore[assignment]
                try:
                    prefill[f"{bm}x{bn}x{bk}x{warps}"] = case(args.prefill, w, bw)["ms"]
                except Exception as exc:
                    prefill[f"{bm}x{bn}x{bk}x{warps}"] = repr(exc)[:120]
            kt._tiles = tiles
            kt.FP4_PREFILL_DEQUANTIZED = True
            entry["prefill_fused_tiles"] = prefill
        if fmt == "bf16" and args.bf16_sweep:
            entry["decode_tiles_cold"] = bf16_sweep(w, bw, args.batches)
        if fmt == "mxfp4" and args.dequantize:
            entry["dequantize_tiles"] = dequantize_sweep(w[0], bw)
        report[fmt] = entry
        del w
        torch.cuda.empty_cache()
    text = json.dumps(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
