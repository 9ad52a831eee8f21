"""Capture the decode forward in a CUDA graph and check that replays equal eager runs.

    python benchmarks/check_cuda_graph.py [--requests 32] [--prompt-len 100] [--steps 8]

Prefills `--requests` prompts, then runs `--steps` decode steps twice each: eagerly, and by replaying
one graph captured at the first decode step (its inputs copied into the captured buffers). Prints one
JSON object: max |logit difference| per step, tokens equal, eager and replay times.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import torch

from dsv4serve.attention.metadata import BatchItem, ForwardBatch, WindowMeta, build_forward_batch
from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.memory.allocator import KVAllocator, Refusal
from dsv4serve.models.tiny import make_tiny


def _copy_into(static: ForwardBatch, fresh: ForwardBatch) -> None:
    """Decode batches of one bucket have equal shapes: copy every tensor into the captured one."""
    assert static.max_seq_len >= fresh.max_seq_len
    for f in fields(ForwardBatch):
        a, b = getattr(static, f.name), getattr(fresh, f.name)
        if isinstance(a, torch.Tensor):
            a.copy_(b)
    for r, win in static.windows.items():
        for f in fields(WindowMeta):
            getattr(win, f.name).copy_(getattr(fresh.windows[r], f.name))


def _decode_batch(items: list[BatchItem], ratios: tuple[int, ...], bucket: int) -> ForwardBatch:
    """A decode batch whose window lists are padded to one entry per request (index -1 = none), and
    whose max_seq_len is the bucket's, so every step of the bucket has the same shapes."""
    batch = build_forward_batch(items, ratios, "cuda")
    windows = {}
    for r, win in batch.windows.items():
        req = torch.arange(len(items), device="cuda")
        index = torch.full((len(items),), -1, dtype=torch.int64, device="cuda")
        index[win.req] = win.index
        windows[r] = WindowMeta(req=req, index=index)
    return ForwardBatch(**{**batch.__dict__, "windows": windows, "max_seq_len": bucket})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    n, plen = args.requests, args.prompt_len
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(Path(tmp) / "tiny", seed=0)
        engine = EngineConfig(
            device="cuda",
            dtype="float32",
            page_size=16,
            max_num_seqs=n,
            max_num_batched_tokens=n * plen,
            max_total_tokens=n * (plen + 64),
        )
        runner = ModelRunner(model_dir, engine)
        alloc = KVAllocator(runner.model_cfg, engine, runner.sizes)
        rng = random.Random(0)
        rows, seqs, last = {}, {}, {}
        items = []
        for i in range(n):
            prompt = [rng.randrange(2, 129000) for _ in range(plen)]
            locs = alloc.allocate(f"r{i}", 0, plen, 0)
            assert not isinstance(locs, Refusal)
            runner.write_locs([locs])
            rows[i], seqs[i] = locs.row, plen
            items.append(BatchItem(locs.row, 0, prompt, True))
        ratios = runner.model_cfg.compress_ratio_set
        with torch.inference_mode():
            logits = runner.model.forward(
                build_forward_batch(items, ratios, "cuda"), runner.pools, runner.tables
            )
            last = logits.argmax(-1).tolist()
            bucket = plen + args.steps + 1
            graph, static, out = None, None, None
            report: dict[str, object] = {
                "requests": n,
                "prompt_len": plen,
                "max_abs_diff": [],
                "same_tokens": True,
            }
            eager_s, replay_s = 0.0, 0.0
            for step in range(1, args.steps + 1):
                dec = []
                for i in range(n):
                    locs = alloc.allocate(f"r{i}", seqs[i], seqs[i] + 1, step)
                    assert not isinstance(locs, Refusal)
                    runner.write_locs([locs])
                    dec.append(BatchItem(rows[i], seqs[i], [last[i]], True))
                    seqs[i] += 1
                fresh = _decode_batch(dec, ratios, bucket)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                eager = runner.model.forward(fresh, runner.pools, runner.tables)
                torch.cuda.synchronize()
                eager_s += time.perf_counter() - t0
                if graph is None:
                    static = fresh
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):  # warm up on a side stream, as capture wants
                        runner.model.forward(static, runner.pools, runner.tables)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = runner.model.forward(static, runner.pools, runner.tables)
                assert static is not None and out is not None
                _copy_into(static, fresh)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                replay_s += time.perf_counter() - t0
                report["max_abs_diff"].append(float((eager - out).abs().max()))  # type: ignore[union-attr]
                if eager.argmax(-1).tolist() != out.argmax(-1).tolist():
                    report["same_tokens"] = False
                last = eager.argmax(-1).tolist()
        report["eager_step_ms"] = round(eager_s / args.steps * 1e3, 3)
        report["replay_step_ms"] = round(replay_s / args.steps * 1e3, 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
