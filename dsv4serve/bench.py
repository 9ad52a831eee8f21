"""The executor core's speed: prefill and decode steps through allocator -> slot messages -> tables ->
ModelRunner (no actors), on any device. `python -m dsv4serve bench` and benchmarks/bench_step.py
print `run_bench`'s result as JSON; benchmarks/bench_decode.py drives `CoreDriver` at real dimensions.
Times are medians over steps after a warm-up decode step.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.memory.allocator import KVAllocator, Refusal
from dsv4serve.protocol import LOOKAHEAD, SamplingParams, StepItem, StepPlan

GREEDY = SamplingParams(temperature=0.0)
TIMED = "core_step"  # the profiler's name for a step's timed part (launch, wait)


class CoreDriver:
    """Requests through the executor core as the engine runs them, without the actors."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.alloc = KVAllocator(runner.model_cfg, runner.engine, runner.sizes)
        self.lengths: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.step = 0
        self.launch_times: list[float] = []  # host time of each step's launch (s): until it returns

    def sync(self) -> None:
        """Wait for the device's queued work."""
        self.runner.ops.transfers.synchronize(self.runner.device)

    def _plan(self, chunks: Mapping[str, Sequence[int]]) -> StepPlan:
        """Allocate each rid's chunk after its cached tokens and write its slots; the step's plan."""
        items, locs = [], []
        for rid, ids in chunks.items():
            start = self.lengths.get(rid, 0)
            got = self.alloc.allocate(rid, start, start + len(ids), self.step)
            assert not isinstance(got, Refusal), got
            locs.append(got)
            items.append(
                StepItem(
                    rid=rid, prefix_len=start, token_ids=tuple(ids), sample=True, sampling=GREEDY, row=got.row
                )
            )
            self.lengths[rid] = start + len(ids)
        self.runner.write_locs(locs)
        self.step += 1
        return StepPlan(step=self.step - 1, items=tuple(items))

    def _run(self, chunks: dict[str, Sequence[int]]) -> float:
        """One step, alone on the device: returns launch + wait's wall time (s)."""
        plan = self._plan(chunks)
        self.sync()
        with torch.profiler.record_function(TIMED):  # what a profile of the step should look at
            begin = time.perf_counter()
            pending = self.runner.launch(plan)
            self.launch_times.append(time.perf_counter() - begin)
            result = pending.wait()
            self.sync()
            elapsed = time.perf_counter() - begin
        self.last.update({o.rid: o.token_id for o in result.outputs})
        return elapsed

    def decode_overlapped(self, rids: Sequence[str], steps: int) -> float:
        """`steps` decode steps as the engine's executor runs them: each launched (its input the token
        the step before samples, taken on the device) before the step before it is waited for, so the
        host's planning and launch overlap the device's work. Returns the time per step (s) between
        the first step's result and the last one's."""
        assert steps >= 2
        self.sync()
        in_flight = deque([self.runner.launch(self._plan({rid: (self.last[rid],) for rid in rids}))])
        done = []
        for n in range(steps):
            if n + 1 < steps:
                in_flight.append(self.runner.launch(self._plan({rid: (LOOKAHEAD,) for rid in rids})))
            result = in_flight.popleft().wait()
            done.append(time.perf_counter())
            self.last.update({o.rid: o.token_id for o in result.outputs})
        self.sync()
        return (done[-1] - done[0]) / (steps - 1)

    def prefill(self, prompts: Mapping[str, Sequence[int]], budget: int) -> list[float]:
        """Whole prompts in steps of at most `budget` tokens (longer prompts in chunks)."""
        pending = {rid: list(p) for rid, p in prompts.items()}
        times = []
        while pending:
            chunks: dict[str, Sequence[int]] = {}
            room = budget
            for rid in list(pending):
                if room == 0:
                    break
                take, pending[rid] = pending[rid][:room], pending[rid][room:]
                chunks[rid], room = take, room - len(take)
                if not pending[rid]:
                    del pending[rid]
            times.append(self._run(chunks))
        return times

    def next_logits(self, chunks: Mapping[str, Sequence[int]]) -> torch.Tensor:
        """One step over each rid's chunk: the next-token logits (len(chunks), V), in chunk order."""
        result = self.runner.execute(self._plan(chunks), keep_logits=True)
        assert result.logits is not None
        return result.logits[: len(chunks)]

    def decode(self, rids: Sequence[str], steps: int) -> list[float]:
        return [self._run({rid: (self.last[rid],) for rid in rids}) for _ in range(steps)]

    def free(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.alloc.free(rid)
            self.lengths.pop(rid, None)
            self.last.pop(rid, None)


def stack_options() -> dict[str, Any]:
    """The torch profiler's arguments that record each host op's Python stack (`device_idle`'s
    `launched_from`): with_stack alone left every event's stack empty (torch 2.13 on the CPU, and
    the H200's 2.11 in run 50)."""
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)
    return {"with_stack": True, "experimental_config": verbose}


def device_idle(events: Iterable[Any], top: int = 8) -> dict[str, Any]:
    """Where the device waits inside a profiled step's timed part (the first `TIMED` range of a torch
    profiler trace: `prof.events()`): the host's lead-in before the first device op and before the
    first compute kernel (copies and memsets aside), the idle time between its first and last device
    op, and the longest gaps (`_gap`). Device ops outside the range are not the step's."""
    events = list(events)
    host = [e for e in events if e.device_type.name == "CPU"]
    step = next((e for e in host if e.name == TIMED), None)
    if step is None:
        return {"error": f"no {TIMED!r} range in the profile"}
    lo, hi = step.time_range.start, step.time_range.end
    ops = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type.name != "CPU"
        and not getattr(e, "is_user_annotation", False)
        and e.name != TIMED  # the range shows on the device too, as an annotation
        and lo <= e.time_range.start <= hi
    )
    if not ops:
        return {"error": "no device op in the timed range"}
    host = [e for e in host if e.name != TIMED and lo <= e.time_range.start <= hi]
    lead_in: Counter[str] = Counter()  # host self time by op before the first device op
    for e in host:
        if e.time_range.end <= ops[0][0]:
            lead_in[e.name[:50]] += e.self_cpu_time_total
    compute = next((start for start, _, name in ops if not name.startswith(("Memcpy", "Memset"))), None)
    gaps = []  # (us, when it began, the op before, the op after)
    end, before = ops[0][1], ops[0][2]
    for start, stop, name in ops[1:]:
        if start > end:
            gaps.append((start - end, end, before, name))
        if stop > end:
            end, before = stop, name
    gaps.sort(reverse=True)
    return {
        "lead_in_us": round(ops[0][0] - lo, 1),
        "lead_in_compute_us": None if compute is None else round(compute - lo, 1),
        "lead_in_host_us": {name: round(us, 1) for name, us in lead_in.most_common(top)},
        "span_us": round(end - ops[0][0], 1),
        "idle_us": round(sum(g[0] for g in gaps), 1),
        "gaps": len(gaps),
        "longest": [_gap(*g, host) for g in gaps[:top]],
    }


def _gap(us: float, at: float, after: str, then: str, host: list[Any]) -> dict[str, Any]:
    """One device gap: its length, the device ops around it, the host ops (innermost first) running
    when it began and, in a profile with stacks, the package frames of the last host op begun before
    it ended (where the launch that ended it came from)."""
    running = sorted(
        (e for e in host if e.time_range.start <= at <= e.time_range.end),
        key=lambda e: e.time_range.end - e.time_range.start,
    )
    gap = {
        "us": round(us, 1),
        "after": after[:60],
        "before": then[:60],
        "host": [e.name[:50] for e in running[:3]],
    }
    begun = [e for e in host if getattr(e, "stack", None) and e.time_range.start <= at + us]
    if begun:
        launcher = max(begun, key=lambda e: e.time_range.start)
        gap["launched_from"] = [f for f in launcher.stack if "dsv4serve" in f][:4]
    return gap


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
    core = CoreDriver(ModelRunner(model_dir, engine))
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(2, 129000) for _ in range(prompt_len)] for i in range(requests)}
    prefill = core.prefill(prompts, requests * prompt_len)[0]
    times = core.decode(list(prompts), decode_steps)
    decode = statistics.median(times[1:] or times)
    return {
        "device": device,
        "dtype": engine.torch_dtype_name,
        "requests": requests,
        "prompt_len": prompt_len,
        "prefill_ms": round(prefill * 1e3, 2),
        "prefill_tok_s": round(requests * prompt_len / prefill),
        "decode_step_ms": round(decode * 1e3, 2),
        "decode_tok_s": round(requests / decode),
        "tokens": [core.last[r] for r in sorted(core.last)][:8],
    }
