"""The KV sized by device memory (issue 29): does the engine stay inside `gpu_memory_utilization`?

An `Engine` on the GPU without `max_total_tokens` sizes its pools from the memory the weights leave
(`executor/runner.sized_engine`); this script then runs what a step can hold at most — prefill chunks of
`max_num_batched_tokens` and decode steps of `max_num_seqs` requests — and reports the device's peak use
(torch's reserved peak plus what torch does not hold: the CUDA context, other processes) against
`gpu_memory_utilization` x total. The checkpoint is bench_serving's (DeepSeek-V4 dimensions, random
bf16, `--layers`, `--experts`). Prints JSON.

    python benchmarks/bench_kv_sizing.py [--max-num-seqs 256] [--max-num-batched-tokens 8192] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def with_context(model: Path, max_position: int) -> Path:
    """The checkpoint declaring `max_position` tokens of context (a sibling folder: its config changed,
    its other files linked): the KV is then bounded by memory, not by max_num_seqs x the context."""
    out = model.with_name(f"{model.name}-ctx{max_position}")
    out.mkdir(exist_ok=True)
    for f in model.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model / "config.json").read_text()) | {"max_position_embeddings": max_position}
    (out / "config.json").write_text(json.dumps(config))
    return out


def main() -> None:
    from bench_serving import checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--cache", default="/tmp/dsv4serve-bench")
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU: checks the flow")
    parser.add_argument(
        "--max-position", type=int, default=1 << 20, help="the context the checkpoint declares (Flash's 1M)"
    )
    args = parser.parse_args()
    import torch

    from dsv4serve import Engine, SamplingParams, logs

    logs.configure("warning")
    args.steps = 0
    model = with_context(checkpoint(args), args.max_position)
    device = "cpu" if args.dry_run else "cuda"
    knobs: dict[str, Any] = {"device": device, "max_num_seqs": args.max_num_seqs}
    knobs |= {"max_num_batched_tokens": args.max_num_batched_tokens}
    knobs |= {"gpu_memory_utilization": args.gpu_memory_utilization}
    report: dict[str, Any] = {"bench": "kv_sizing", **knobs, "layers": args.layers, "experts": args.experts}
    begin = time.perf_counter()
    with Engine(model, core_process=False, **knobs) as engine:  # its memory read in this process
        report["load_s"] = round(time.perf_counter() - begin, 1)
        pools = engine.pool_usage()
        report["pool_slots"] = {name: capacity for name, (_, capacity) in pools.items()}
        report["max_position"] = args.max_position
        first = next(iter(pools.values()))[1]
        n = min(args.max_num_seqs, first // (args.prompt_len + 16))
        if device == "cuda":
            torch.cuda.synchronize()
            loaded = torch.cuda.memory_reserved()  # weights, pools, tables: before any step
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 100_000) for _ in range(args.prompt_len)] for _ in range(n)]
        begin = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        run_s = round(time.perf_counter() - begin, 1)
        report |= {"requests": n, "prompt_len": args.prompt_len, "run_s": run_s}
        if device == "cuda":
            free, total = torch.cuda.mem_get_info()
            outside = (total - free) - torch.cuda.memory_reserved()  # context, other processes
            peak = torch.cuda.max_memory_reserved() + outside
            from dsv4serve.config import EngineConfig
            from dsv4serve.memory.sizing import activation_reserve, pool_bytes
            from dsv4serve.models.registry import config_from_dir

            cfg, config = config_from_dir(model), EngineConfig(**knobs)
            reserve = activation_reserve(cfg, config)
            pools = pool_bytes(cfg, config.with_(max_total_tokens=report["pool_slots"]["full"]))
            weights = sum(engine.stats().weight_bytes.values())
            report |= {  # what the graphs and steps took beside weights and pools, against the reserve
                "weight_bytes": weights,
                "pool_bytes": pools,
                "beside_weights_and_pools_bytes": torch.cuda.max_memory_reserved() - weights - pools,
                "loaded_reserved_bytes": loaded,  # start-up graphs included
                "steps_peak_bytes": torch.cuda.max_memory_reserved() - loaded,
                "reserve_bytes": reserve,
                "outside_torch_bytes": outside,
            }
            report |= {
                "total_bytes": total,
                "allowed_bytes": int(args.gpu_memory_utilization * total),
                "peak_bytes": peak,
                "peak_over_total": round(peak / total, 4),
                "within": peak <= args.gpu_memory_utilization * total,
            }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
