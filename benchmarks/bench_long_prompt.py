"""One long prompt served whole through `Engine.generate` (the actor system, chunked prefill, CUDA
graphs for the decode): GLM-4.7-Flash dimensions by default (random bf16 weights saved by nothing:
transformers' model built in memory, its tensors under the engine's names, as bench_decode.py does).

Reports the time to the first token, the decode time per token after it (the difference of a run of
1 and of --new-tokens tokens, each with its prefill: a few tokens leave the prefill's noise in it),
the device's peak memory
(torch's allocator) and the KV bytes the prompt holds; transformers eager on the same prompt in the
same run (its whole-prompt forward, or the error it raises), unless --skip-hf.

    PYTHONPATH=. python benchmarks/bench_long_prompt.py [--model glm4_moe_lite] [--layers 4]
        [--tokens 131072] [--new-tokens 128] [--chunk 8192] [--skip-hf] [--out FILE] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_decode import FAMILIES, sync

from dsv4serve import Engine, SamplingParams, logs
from dsv4serve.actors.system import SystemOptions
from dsv4serve.actors.tokenizer_core import load_tokenizer
from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.registry import spec_for
from dsv4serve.models.tiny import copy_tokenizer


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def hf_first_token(model: Any, prompt: list[int]) -> dict[str, Any]:
    """transformers eager: the whole prompt in one forward; its time, peak memory and greedy token."""
    ids = torch.tensor([prompt], device=model.device)
    torch.cuda.reset_peak_memory_stats() if model.device.type == "cuda" else None
    try:
        with torch.inference_mode():
            sync(model.device)
            begin = time.perf_counter()
            token = int(model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())
            took = time.perf_counter() - begin
    except torch.OutOfMemoryError as e:
        return {"error": f"OutOfMemoryError: {str(e).splitlines()[0][:160]}"}
    out: dict[str, Any] = {"ttft_ms": round(took * 1e3, 1), "first_token": token}
    if model.device.type == "cuda":
        out["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(FAMILIES), default="glm4_moe_lite")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny dimensions on the CPU: checks the flow")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    torch.manual_seed(0)
    family = FAMILIES[args.model]
    raw = family.raw_config(args.layers, args.experts or family.experts, args.dry_run)
    cfg: Any = spec_for(args.model).config(raw)
    hf = family.build_hf(raw, device)
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "model": args.model, "layers": args.layers, "tokens": args.tokens, "chunk": args.chunk,
    }  # fmt: skip
    engine_cfg = EngineConfig(
        device=device,
        dtype="bfloat16",
        page_size=128,
        max_num_seqs=4,
        max_num_batched_tokens=args.chunk,
        max_total_tokens=args.tokens + args.new_tokens + 2 * args.chunk,
    )
    runner = ModelRunner.from_weights(cfg, family.engine_weights(hf, cfg), engine_cfg)
    report["kv_bytes_of_prompt"] = family.kv_bytes(cfg, [args.tokens])
    rng = random.Random(0)
    prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(args.tokens)]
    logs.configure("warning")
    with tempfile.TemporaryDirectory() as tmp:
        copy_tokenizer(Path(tmp))
        tokenizer = load_tokenizer(Path(tmp))
        options = SystemOptions(model_dir=Path(tmp), engine=engine_cfg, prebuilt=(runner, tokenizer))
        with Engine._of(options) as engine:
            engine.generate([prompt[:1000]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up: graphs
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            walls, outputs = [], []
            for tokens in (1, args.new_tokens):
                begin = time.perf_counter()
                params = SamplingParams(max_tokens=tokens, temperature=0.0)
                outputs.append(engine.generate([prompt], params)[0])
                walls.append(time.perf_counter() - begin)
            stats = engine.stats()
    first, whole = outputs
    report["engine"] = {
        "ttft_ms": round(walls[0] * 1e3, 1),
        "decode_ms_per_token": round((walls[1] - walls[0]) / max(1, args.new_tokens - 1) * 1e3, 3),
        "first_token": first.token_ids[0],
        "tokens": list(whole.token_ids),
        "same_first_token_both_runs": first.token_ids[0] == whole.token_ids[0],
        "preemptions": stats.num_preemptions,
    }
    if device == "cuda":
        report["engine"]["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    print(json.dumps(report), flush=True)
    if not args.skip_hf:
        del runner
        torch.cuda.empty_cache() if device == "cuda" else None
        report["transformers"] = hf_first_token(hf, prompt)
        if "ttft_ms" in report["transformers"]:
            ratio = report["transformers"]["ttft_ms"] / report["engine"]["ttft_ms"]
            report["hf_over_engine_ttft"] = round(ratio, 2)
            report["same_first_token_as_hf"] = report["transformers"]["first_token"] == first.token_ids[0]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
