"""The executor core's speed: prefill and decode steps through allocator -> six-tuples -> tables ->
ModelRunner (no actors), on any device. `python -m dsv4serve bench` and benchmarks/bench_step.py
print `run_bench`'s result as JSON. Times are medians over steps after a warm-up decode step.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.memory.allocator import KVAllocator, Refusal
from dsv4serve.protocol import SamplingSpec, StepItem, StepPlan

GREEDY = SamplingSpec(temperature=0.0)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_bench(
    model_dir: Path, device: str, requests: int, prompt_len: int, decode_steps: int, dtype: str | None = None
) -> dict[str, object]:
    engine = EngineConfig(
        device=device,
        dtype=dtype,
        page_size=64,
        max_num_seqs=requests,
        max_num_batched_tokens=requests * prompt_len,
        max_total_tokens=requests * (prompt_len + decode_steps + 64),
    )
    runner = ModelRunner(model_dir, engine)
    alloc = KVAllocator(runner.model_cfg, engine, runner.sizes)
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(2, 129000) for _ in range(prompt_len)] for i in range(requests)}
    lengths = dict.fromkeys(prompts, 0)
    last: dict[str, int] = {}
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    for step in range(decode_steps + 1):
        items, locs = [], []
        for rid, prompt in prompts.items():
            ids = tuple(prompt) if step == 0 else (last[rid],)
            got = alloc.allocate(rid, lengths[rid], lengths[rid] + len(ids), step)
            assert not isinstance(got, Refusal), got
            locs.append(got)
            items.append(
                StepItem(
                    rid=rid, prefix_len=lengths[rid], token_ids=ids, sample=True, sampling=GREEDY, row=got.row
                )
            )
            lengths[rid] += len(ids)
        runner.write_locs(locs)
        _sync(device)
        start = time.perf_counter()
        result = runner.execute(StepPlan(step=step, items=tuple(items)))
        _sync(device)
        times["prefill" if step == 0 else "decode"].append(time.perf_counter() - start)
        last = {o.rid: o.token_id for o in result.outputs}
    decode = statistics.median(times["decode"][1:] or times["decode"])
    return {
        "device": device,
        "dtype": engine.torch_dtype_name,
        "requests": requests,
        "prompt_len": prompt_len,
        "prefill_ms": round(times["prefill"][0] * 1e3, 2),
        "prefill_tok_s": round(requests * prompt_len / times["prefill"][0]),
        "decode_step_ms": round(decode * 1e3, 2),
        "decode_tok_s": round(requests / decode),
        "tokens": [last[r] for r in sorted(last)][:8],
    }
