"""Executor-core throughput on a tiny checkpoint (see dsv4serve/bench.py); optionally checks the
device's greedy tokens against the CPU's.

    python benchmarks/bench_step.py --device cuda --requests 32 --prompt-len 256 --decode-steps 32

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from dsv4serve.bench import run_bench
from dsv4serve.models.deepseek_v4.tiny import make_tiny


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--check-cpu", action="store_true", help="also run on the CPU and compare tokens")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(Path(tmp) / "tiny", seed=0)
        out = run_bench(model_dir, args.device, args.requests, args.prompt_len, args.decode_steps, args.dtype)
        if args.check_cpu and args.device != "cpu":
            ref = run_bench(model_dir, "cpu", args.requests, args.prompt_len, args.decode_steps, out["dtype"])
            out["same_tokens_as_cpu"] = ref["tokens"] == out["tokens"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
