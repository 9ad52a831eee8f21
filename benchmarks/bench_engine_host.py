"""The engine's host cost per decode step, on any machine: `Engine.generate` over a tiny checkpoint
whose device is simulated (each step takes `--device-ms` of "device" time after its launch, or after
the step before it; the forward never runs), so the per-step time is max(device time, the actors'
turnaround), and with `--device-ms 0` the turnaround alone.

    python benchmarks/bench_engine_host.py --batches 1 8 64 --device-ms 0 1.4

Prints one JSON object: per (device ms, batch) the engine's ms per decode step, and over the device
time. On the H200 the same turnaround decides whether `Engine.generate` keeps the GPU busy at batch 1.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from dsv4serve import Engine, SamplingParams, logs
from dsv4serve.actors.system import SystemOptions
from dsv4serve.actors.tokenizer_core import load_tokenizer
from dsv4serve.config import EngineConfig
from dsv4serve.executor.graphs import is_decode
from dsv4serve.executor.runner import ModelRunner, StepResult
from dsv4serve.models.deepseek_v4.tiny import make_tiny
from dsv4serve.protocol import SampledToken, StepPlan

TOKEN = 1000  # every simulated step samples this (an ordinary token: requests end by max_tokens)


class SimulatedDevice:
    """A device queue in time only: a step runs `step_s` after its launch or after the step before it."""

    def __init__(self, step_s: float, launch_s: float) -> None:
        self.step_s, self.launch_s, self.free_at, self.lock = step_s, launch_s, 0.0, threading.Lock()

    def launch(self, plan: StepPlan, *args: Any, **kwargs: Any) -> _Pending:
        """Holds the GIL for `launch_s` (the host side of a real launch: Python, then the graph launch),
        the device starting on the step only then."""
        end = time.perf_counter() + self.launch_s
        while time.perf_counter() < end:
            pass
        with self.lock:
            self.free_at = max(time.perf_counter(), self.free_at) + self.step_s
            return _Pending(plan, self.free_at)


class _Pending:
    def __init__(self, plan: StepPlan, done_at: float) -> None:
        self.plan, self.done_at = plan, done_at

    def ready(self) -> bool:
        return time.perf_counter() >= self.done_at

    def wait(self) -> StepResult:
        if (delay := self.done_at - time.perf_counter()) > 0:
            time.sleep(delay)
        sampled = (i for i in self.plan.items if i.sample)
        return StepResult(tuple(SampledToken(rid=i.rid, token_id=TOKEN) for i in sampled))


def per_step_ms(engine: Engine, batch: int, steps: int) -> float:
    """(T(steps + 1 tokens) - T(1 token)) / steps, after a warm-up of the same batch."""
    prompts = [[TOKEN] * 64 for _ in range(batch)]
    walls = []
    for tokens in (steps + 1, 1, steps + 1):
        begin = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))
        walls.append(time.perf_counter() - begin)
    return (walls[2] - walls[1]) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--device-ms", type=float, nargs="+", default=[0.0, 1.4])
    parser.add_argument("--launch-ms", type=float, default=0.0, help="host time of each launch (GIL held)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    logs.configure("warning")
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(Path(tmp) / "tiny", seed=0)
        engine_cfg = EngineConfig(device="cpu", max_num_seqs=max(args.batches), max_num_batched_tokens=8192)
        runner = ModelRunner(model_dir, engine_cfg)
        for device_ms in args.device_ms:
            runner.launch = SimulatedDevice(device_ms / 1e3, args.launch_ms / 1e3).launch  # type: ignore[method-assign]
            # as on a GPU once a bucket's graph is captured: decode steps replay (launched in place)
            runner.replays = lambda plan: is_decode(plan.items)  # type: ignore[method-assign]
            options = SystemOptions(model_dir, engine_cfg, prebuilt=(runner, load_tokenizer(model_dir)))
            with Engine._of(options) as engine:
                for batch in args.batches:
                    ms = per_step_ms(engine, batch, args.steps)
                    entry = {"engine_ms": round(ms, 3)}
                    if device_ms:
                        entry["engine_over_device"] = round(ms / device_ms, 3)
                    report[f"device{device_ms}ms_b{batch}"] = entry
    print(json.dumps(report))


if __name__ == "__main__":
    main()
