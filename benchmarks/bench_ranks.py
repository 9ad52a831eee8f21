"""What each tensor-parallel rank holds (issue 30): the weights every rank of `--tensor-parallel-size N`
loads (`load_weights` with the rank's `Shard`, as the engine's ranks do), by `plan`'s groups, against one
device's whole model and against `plan --devices N --layout tp`'s per-device figure. CPU only: no rank
process is started, the loader is run once per rank. Prints JSON.

    python benchmarks/bench_ranks.py [--model DIR] [--tp 2] [--ep]     # default: the demo's tiny model
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def held_bytes(weights: dict[str, Any], groups: dict[str, str]) -> dict[str, int]:
    """Bytes held by `plan`'s weight group (embed_head, attention, routed_experts, ...)."""
    from dsv4serve.layers.linear import resident_bytes

    out: dict[str, int] = {}
    for name, w in weights.items():
        out[groups[name]] = out.get(groups[name], 0) + sum(resident_bytes({name: w}).values())
    return out


def main() -> None:
    from dsv4serve.demo import default_cache_dir, tiny_checkpoint
    from dsv4serve.layers.parallel import Shard
    from dsv4serve.models.loader import load_weights, loaded_schema
    from dsv4serve.models.plan import device_share
    from dsv4serve.models.registry import config_from_dir, spec_for

    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", type=Path, default=None, help="a checkpoint (default: the demo's tiny one)"
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", action="store_true", help="expert parallelism (whole experts per rank)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = args.model or tiny_checkpoint(default_cache_dir(), 0)[0]
    cfg = config_from_dir(model)
    spec = spec_for(cfg.model_type)
    groups = {n: t.group for n, t in loaded_schema(spec.schema(cfg), spec.names(cfg)).items()}
    dtype = getattr(torch, args.dtype)
    whole = held_bytes(load_weights(model, spec, cfg, dtype=dtype), groups)
    ranks = []
    for rank in range(args.tp):
        shard = Shard(rank, args.tp, expert_parallel=args.ep)
        ranks.append(held_bytes(load_weights(model, spec, cfg, dtype=dtype, shard=shard), groups))
    params, _ = device_share(spec, cfg, "bf16", "tp", args.tp)
    one = sum(whole.values())
    report = {
        "bench": "ranks",
        "model": str(model),
        "tensor_parallel_size": args.tp,
        "expert_parallel": args.ep,
        "whole_bytes": one,
        "rank_bytes": [sum(r.values()) for r in ranks],
        "rank_over_whole": [round(sum(r.values()) / one, 4) for r in ranks],
        "plan_params_per_device": params,
        "by_group": {"whole": whole, "ranks": ranks},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
