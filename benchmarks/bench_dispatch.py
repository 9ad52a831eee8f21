"""The two ways a MoE layer reaches experts spread over data-parallel cores (issue 30), timed through
`Engine.generate` on the demo's tiny checkpoint: `expert_dispatch="gather"` (every core's tokens
all-gathered, the outputs reduce-scattered) against `"all_to_all"` (each (token, choice) row sent only
to its expert's rank and back). `--data-parallel-size` cores, experts over all of them; per decode step =
(T(1 + steps tokens) - T(1 token)) / steps, and T(1 token) (prefill, then one step). On the CPU the
collectives are gloo's: the figures choose nothing for NCCL or HCCL; the multi-GPU issue measures those.

    python benchmarks/bench_dispatch.py [--dp 2] [--requests 8 64] [--prompt-len 64] [--steps 16]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    from dsv4serve import Engine, SamplingParams, logs
    from dsv4serve.demo import default_cache_dir, tiny_checkpoint

    logs.configure("warning")
    model, _ = tiny_checkpoint(default_cache_dir(), 0)
    rng = random.Random(0)
    report: dict[str, Any] = {"bench": "dispatch", "dp": args.dp, "prompt_len": args.prompt_len}
    for dispatch in ("gather", "all_to_all"):
        knobs = {"data_parallel_size": args.dp, "expert_parallel_size": args.dp, "expert_dispatch": dispatch}
        with Engine(model, max_num_seqs=max(args.requests), max_num_batched_tokens=8192, **knobs) as engine:
            for n in args.requests:
                prompts = [[rng.randrange(2, 100_000) for _ in range(args.prompt_len)] for _ in range(n)]
                walls = []
                for tokens in (1 + args.steps, 1, 1 + args.steps):
                    begin = time.perf_counter()
                    engine.generate(
                        prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
                    )
                    walls.append(time.perf_counter() - begin)
                report[f"{dispatch}_n{n}"] = {
                    "decode_step_ms": round((walls[2] - walls[1]) / args.steps * 1e3, 2),
                    "one_token_s": round(walls[1], 3),
                }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
