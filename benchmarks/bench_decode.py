"""Decode and prefill at DeepSeek-V4-Flash (or GLM-4.7-Flash) layer dimensions, in ONE run on one GPU:
transformers eager, the executor core and `Engine.generate`, each decode step against its HBM
roofline. Prints JSON.

    python benchmarks/bench_decode.py [--model deepseek_v4|glm4_moe_lite] [--layers 4] [--experts N] \
        [--batches 1 8 64] [--contexts 1024 8192] [--engine-contexts 1024] [--prefills 1x1024 8x1024] \
        [--steps 16] [--weights bf16|official] [--out FILE]

`--weights official` (DeepSeek-V4): the random weights as the official checkpoint stores them, the
routed experts MXFP4 (kept packed by the engine: `Mxfp4Weight`) and the FP8 linears in 128 x 128
blocks (kept e4m3 where the model takes them through `linear`: `Fp8BlockWeight`); transformers runs
the very values they encode (written back into its parameters), so both compute the same function.
The roofline then counts the bytes the engine reads in each format (the JSON's `"weights"` names it).

`--experts` defaults to the model's own (256 routed experts for DeepSeek-V4-Flash, 64 for
GLM-4.7-Flash); `--layers` keeps the model's first layers (GLM-4.7-Flash's first is dense).

The weights are random bf16, built on the device once, by transformers' own initialisation; the engine
serves the very same tensors (renamed to the official names, experts as views), so both read the same
bytes. Hash-routed layers get random distinct experts per token (transformers initialises `tid2eid`
to zeros). Roofline of a decode step: bytes of the non-expert weights (the embedding's rows of the
batch only) + the routed experts that step actually chose (counted on an eager run of that step) + the
KV each query reads (window, chosen or all compressed entries, indexer keys), over the device-to-device
copy bandwidth measured in the same run (bytes read + written per second).

Two executor-core times per decode: `core_ms`, each step alone (plan, launch, wait for its tokens,
synchronize: the host's whole launch is on the step's path), and `core_overlapped_ms`, steps launched
back to back as the engine's executor runs them (each step's input the token the step before samples,
taken on the device; the next step is planned and launched before the current one is waited for).

The per-kernel and host profiles run after every timing (on fresh requests of the same shapes): once
the torch profiler has run in a process, every later launch pays for CUPTI.

Prefill: transformers runs the forward as its `generate` does (`logits_to_keep=1`: the last
position's logits only, as the engine computes them). `matmul_ms` is the floor of the engine's
prefill set by its matrix products alone: every `F.linear`, `torch._grouped_mm`, `torch.bmm` and
`torch.einsum` call of one eager prefill recorded with its very tensors and replayed back to back in a
CUDA graph (no attention, norms, mHC, routing or host work).

`--set MODULE.NAME=VALUE ...` sets constants of the CUDA backend's modules before the engine is built
(e.g. `experts.SPLIT_BELOW=0`, `linear.GROUPED_FP8_LAUNCH=False`): two runs on one machine, one with and
one without, time one change; the JSON's `set` records what was set.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch

from dsv4serve.bench import TIMED, CoreDriver, device_idle, stack_options
from dsv4serve.config import EngineConfig
from dsv4serve.executor.graphs import _Graph
from dsv4serve.executor.inputs import forward_batch
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.layers.formats import dequantize_fp8_block, quantize_fp8_block, quantize_mxfp4
from dsv4serve.layers.linear import Fp8BlockWeight, Int8Weight, Mxfp4Weight, quantize_int8, resident_bytes
from dsv4serve.memory.sizing import engine_pool_sizes
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.deepseek_v4.names import official_weights
from dsv4serve.models.glm4_moe_lite.config import GlmConfig
from dsv4serve.models.loader import loaded_schema, storage_dtype
from dsv4serve.models.registry import config_file, spec_for
from dsv4serve.protocol import SamplingParams, StepItem

REPORT: dict[str, Any] = {}


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def copy_bandwidth(device: str, gib: float = 4.0) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    n = int(gib * 2**30) // 2
    a, b = (
        torch.empty(n, dtype=torch.bfloat16, device=device),
        torch.empty(n, dtype=torch.bfloat16, device=device),
    )
    a.normal_()
    times = []
    for _ in range(12):
        sync(device)
        begin = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - begin)
    del a, b
    return 2 * n * 2 / statistics.median(times[2:])


class Family:
    """What the benchmark needs of a model family: its config at the benchmark's size, transformers'
    model of it, the engine's weights over the very same tensors, and the KV bytes a decode reads."""

    model_type: ClassVar[str]
    official: ClassVar[str]  # the shipped official config
    experts: ClassVar[int]  # routed experts by default
    dry_run_dims: ClassVar[dict[str, Any]]  # --dry-run: the same flow on the CPU at tiny dimensions

    def raw_config(self, layers: int, experts: int, dry_run: bool) -> dict[str, Any]:
        raw = json.loads(config_file(self.official).read_text())
        raw.update(self.dry_run_dims if dry_run else {})
        raw.update(num_hidden_layers=layers, n_routed_experts=experts, num_nextn_predict_layers=0)
        raw.pop("quantization_config", None)
        return raw

    def build_hf(self, raw: dict[str, Any], device: str) -> Any:
        raise NotImplementedError

    def engine_weights(self, model: Any, cfg: Any) -> dict[str, torch.Tensor]:
        """transformers' tensors under the engine's loaded names, in the dtypes the engine keeps."""
        schema = loaded_schema(spec_for(self.model_type).schema(cfg), spec_for(self.model_type).names(cfg))
        return {n: t.to(storage_dtype(schema[n], torch.bfloat16)) for n, t in self.named(model).items()}

    def named(self, model: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def kv_bytes(self, cfg: Any, lengths: list[int]) -> int:
        raise NotImplementedError


class DeepseekV4(Family):
    model_type, official, experts = "deepseek_v4", "deepseek-v4-flash", 256
    dry_run_dims: ClassVar[dict[str, Any]] = {
        "hidden_size": 64, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 4, "index_head_dim": 32,
        "index_topk": 8, "moe_intermediate_size": 32, "sliding_window": 16, "vocab_size": 1000,
    }  # fmt: skip

    def raw_config(self, layers: int, experts: int, dry_run: bool) -> dict[str, Any]:
        raw = super().raw_config(layers, experts, dry_run)
        raw["compress_ratios"] = [*raw["compress_ratios"][:layers], 0]
        raw.pop("expert_dtype", None)
        return raw

    def build_hf(self, raw: dict[str, Any], device: str) -> Any:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

        with torch.device(device):
            model = DeepseekV4ForCausalLM._from_config(DeepseekV4Config(**raw), dtype=torch.bfloat16).eval()
        vocab, experts, k = raw["vocab_size"], raw["n_routed_experts"], raw["num_experts_per_tok"]
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):  # random distinct experts per token, as a trained table has
                buf.copy_(torch.rand(vocab, experts, device=device).argsort(-1)[:, :k])
        return model

    def named(self, model: Any) -> dict[str, torch.Tensor]:
        return official_weights(model.state_dict().items())  # experts as views

    def kv_bytes(self, cfg: DeepseekV4Config, lengths: list[int]) -> int:
        """Bytes of keys / entries each query of a decode step reads (bf16), summed over layers."""
        total, D, Di = 0, cfg.head_dim, cfg.index_head_dim
        for n in lengths:  # the query sits at position n - 1
            for r in cfg.compress_ratios:
                total += min(cfg.sliding_window, n) * D * 2
                if r == 4:
                    total += min(cfg.index_topk, n // 4) * D * 2 + (n // 4) * Di * 2
                elif r:
                    total += (n // r) * D * 2
        return total


class Glm4MoeLite(Family):
    model_type, official, experts = "glm4_moe_lite", "glm-4.7-flash", 64
    dry_run_dims: ClassVar[dict[str, Any]] = {
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "intermediate_size": 96, "moe_intermediate_size": 32, "vocab_size": 1000, "pad_token_id": 2,
        "eos_token_id": [1, 2],
    }  # fmt: skip

    def raw_config(self, layers: int, experts: int, dry_run: bool) -> dict[str, Any]:
        raw = super().raw_config(layers, experts, dry_run)
        dense = raw["first_k_dense_replace"]
        raw["mlp_layer_types"] = ["dense" if i < dense else "sparse" for i in range(layers)]
        return raw

    def build_hf(self, raw: dict[str, Any], device: str) -> Any:
        from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

        with torch.device(device):
            return Glm4MoeLiteForCausalLM._from_config(Glm4MoeLiteConfig(**raw), dtype=torch.bfloat16).eval()

    def named(self, model: Any) -> dict[str, torch.Tensor]:
        """Loaded names: no `model.` prefix; transformers' stacked experts as w1 / w3 views and w2."""
        out: dict[str, torch.Tensor] = {}
        for name, value in model.state_dict().items():
            name = name.removeprefix("model.")
            if name.endswith(".experts.gate_up_proj"):  # (E, 2I, hidden): gate rows, then up rows
                stem, inter = name.removesuffix("gate_up_proj"), value.shape[1] // 2
                out[stem + "w1"], out[stem + "w3"] = value[:, :inter], value[:, inter:]
            elif name.endswith(".experts.down_proj"):
                out[name.removesuffix("down_proj") + "w2"] = value
            else:
                out[name] = value
        return out

    def kv_bytes(self, cfg: GlmConfig, lengths: list[int]) -> int:
        """Bytes of latent rows each query of a decode step reads (bf16), summed over layers."""
        return sum(lengths) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_layers


FAMILIES: dict[str, Family] = {f.model_type: f for f in (DeepseekV4(), Glm4MoeLite())}


def _cache_kwarg(out: Any) -> dict[str, Any]:
    return {"cache": out.cache} if hasattr(out, "cache") else {"past_key_values": out.past_key_values}


def hf_run(model: Any, batch: int, context: int, steps: int, vocab: int) -> dict[str, float]:
    """transformers eager: prefill (in chunks of <= 16k tokens in all), then timed greedy decode steps."""
    device = model.device
    ids = torch.randint(2, vocab, (batch, context), device=device)
    chunk = max(128, 16384 // batch)
    out, kw = None, {}
    with torch.inference_mode():
        for start in range(0, context, chunk):
            out = model(input_ids=ids[:, start : start + chunk], use_cache=True, **kw)
            kw = _cache_kwarg(out)
        assert out is not None
        token = out.logits[:, -1].argmax(-1)
        times = []
        for _ in range(steps):
            sync(device)
            begin = time.perf_counter()
            out = model(input_ids=token[:, None], use_cache=True, **kw)
            kw = _cache_kwarg(out)
            token = out.logits[:, -1].argmax(-1)
            token.tolist()
            times.append(time.perf_counter() - begin)
    return {"decode_ms": statistics.median(times[1:]) * 1e3}


def hf_prefill(model: Any, batch: int, length: int, vocab: int) -> float:
    ids = torch.randint(2, vocab, (batch, length), device=model.device)
    times = []
    with torch.inference_mode():
        for _ in range(3):
            sync(model.device)
            begin = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
            times.append(time.perf_counter() - begin)
    return statistics.median(times[1:]) * 1e3


def matmul_floor_ms(run: Any, device: str) -> float:
    """Device time of the matrix products of `run()` alone: recorded in one eager run, graph-replayed
    (on the CPU of a dry run: replayed eagerly, wall time)."""
    import torch.nn.functional as F

    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    originals = {
        "linear": F.linear,
        "_grouped_mm": torch._grouped_mm,
        "einsum": torch.einsum,
        "bmm": torch.bmm,
    }

    def recording(name: str) -> Any:
        fn = originals[name]

        def record(*args: Any, **kwargs: Any) -> Any:
            calls.append((fn, args, kwargs))
            return fn(*args, **kwargs)

        return record

    owners = {"linear": F, "_grouped_mm": torch, "einsum": torch, "bmm": torch}
    for name, owner in owners.items():
        setattr(owner, name, recording(name))
    try:
        run()
    finally:
        for name, owner in owners.items():
            setattr(owner, name, originals[name])

    def replay() -> None:
        for fn, args, kwargs in calls:
            fn(*args, **kwargs)

    if device != "cuda":
        with torch.inference_mode():
            begin = time.perf_counter()
            replay()
            return (time.perf_counter() - begin) * 1e3
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.inference_mode():
        replay()  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            replay()
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    calls.clear()  # frees the recorded activations
    return statistics.median(times[1:])


def official_formats(weights: dict[str, Any], cfg: Any, model_type: str) -> dict[str, Any]:
    """The engine's weights as the official checkpoint stores them: MXFP4 experts kept packed, FP8
    projections kept as e4m3 blocks (the grouped wo_a too; FP8 experts would be dequantized),
    as `fp4_experts="mxfp4", fp8_linears="fp8"` loads them. Each tensor is a view of transformers'
    parameter: the values the formats encode are written back, so transformers computes the same
    function."""
    if model_type != "deepseek_v4":
        raise SystemExit(f"--weights official: only DeepSeek-V4 ships FP8 + MXFP4 weights, not {model_type}")
    spec = spec_for(model_type)
    schema = loaded_schema(spec.schema(cfg), spec.names(cfg))
    out = dict(weights)
    with torch.no_grad():
        for name, w in weights.items():
            disk = schema[name].disk
            if disk == "mxfp4":  # one expert at a time: the whole stack's fp32 temporaries do not fit
                parts = [quantize_mxfp4(w[e]) for e in range(w.shape[0])]
                packed = Mxfp4Weight(torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts]))
                for e in range(w.shape[0]):
                    w[e].copy_(packed[e].dequantized(w.dtype))
                out[name] = packed
            elif disk == "fp8":
                q, s = quantize_fp8_block(w)
                w.copy_(dequantize_fp8_block(q, s, w.dtype))
                held = schema[name].int8 or schema[name].linear  # the projections, wo_a too: kept FP8
                if held and ".ffn.experts." not in name:
                    out[name] = Fp8BlockWeight(q, torch.exp2(s.float() - 127))
    return out


def w8a8_formats(weights: dict[str, Any], cfg: Any, model_type: str) -> dict[str, Any]:
    """The engine's weights as a W8A8 int8 checkpoint (msModelSlim, compressed-tensors) stores them:
    each projection the schema marks int8 as int8 with a per-output-channel scale, stacked experts one
    expert at a time; the values they encode are written back into transformers' parameters."""
    spec = spec_for(model_type)
    schema = loaded_schema(spec.schema(cfg), spec.names(cfg))
    out = dict(weights)
    with torch.no_grad():
        for name, w in weights.items():
            if not (name in schema and schema[name].int8 and isinstance(w, torch.Tensor)):
                continue
            parts = [quantize_int8(w[e]) for e in range(w.shape[0])] if w.dim() == 3 else [quantize_int8(w)]
            q = Int8Weight(torch.stack([p.qweight for p in parts]), torch.stack([p.scale for p in parts]))
            if w.dim() == 2:
                q = q[0]
            w.copy_((q.qweight.float() * q.scale[..., None]).to(w.dtype))
            out[name] = q
    if not any(isinstance(w, Int8Weight) for w in out.values()):
        raise SystemExit(f"--weights w8a8: {model_type} has no W8A8 projections")
    return out


def weight_bytes(model: Any, batch: int) -> tuple[int, int]:
    """(non-expert weight bytes a decode step reads, bytes of one routed expert)."""
    nonexpert, per_expert = 0, 0
    for name, t in model.state_dict().items():
        size = t.numel() * t.element_size()
        if ".experts." in name:
            per_expert += size // t.shape[0]
        elif name.endswith("embed_tokens.weight"):
            nonexpert += batch * t.shape[1] * t.element_size()
        elif not name.endswith("tid2eid"):
            nonexpert += size
    layers = sum(1 for n in model.state_dict() if n.endswith("experts.down_proj"))
    return nonexpert, per_expert // layers


def distinct_experts(runner: ModelRunner, core: CoreDriver, rids: list[str]) -> list[int]:
    """One decode step run eagerly, recording how many distinct experts each MoE layer chose."""
    counts: list[int] = []
    ops = runner.model.ops

    def recording(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *rest: Any) -> torch.Tensor:
        counts.append(int(ids.unique().numel()))
        return ops.routed_experts(x, weights, ids, *rest)

    runner.model.ops = replace(ops, routed_experts=recording)
    try:
        items, locs = [], []
        for rid in rids:
            n = core.lengths[rid]
            got = core.alloc.allocate(rid, n, n + 1, core.step)
            locs.append(got)
            greedy = SamplingParams(temperature=0.0)
            token = (core.last[rid],)
            items.append(
                StepItem(rid=rid, prefix_len=n, token_ids=token, sample=True, sampling=greedy, row=got.row)
            )  # type: ignore[union-attr]
        runner.write_locs(locs)  # type: ignore[arg-type]
        with torch.inference_mode():
            batch = forward_batch(items, runner.ratios, runner.device)
            logits = runner.model.forward(batch)
        for rid, token in zip(rids, logits.argmax(-1).tolist(), strict=True):
            core.lengths[rid] += 1
            core.last[rid] = token
        core.step += 1
    finally:
        runner.model.ops = ops
    return counts


def random_prompts(rng: random.Random, vocab: int, tag: str, batch: int, length: int) -> dict[str, list[int]]:
    """`batch` prompts of `length` random token ids (no BOS / EOS), by request id `{tag}-{i}`."""
    return {f"{tag}-{i}": [rng.randrange(2, vocab) for _ in range(length)] for i in range(batch)}


def prefill_and_free(core: CoreDriver, prompts: dict[str, list[int]], budget: int) -> None:
    """One prefill step of the prompts, then their memory back (the same step again on the next call)."""
    core.prefill(prompts, budget)
    core.free(list(prompts))


class HostClock:
    """Host time of each call of the named methods while the clock is entered (patched, then restored)."""

    def __init__(self, targets: dict[str, tuple[Any, str]]) -> None:
        self.targets = targets
        self.times: dict[str, list[float]] = {name: [] for name in targets}
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> HostClock:
        for name, (owner, attr) in self.targets.items():
            self.saved[name] = original = getattr(owner, attr)

            def timed(*args: Any, _f: Any = original, _t: list[float] = self.times[name], **kw: Any) -> Any:
                begin = time.perf_counter()
                try:
                    return _f(*args, **kw)
                finally:
                    _t.append(time.perf_counter() - begin)

            setattr(owner, attr, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, (owner, attr) in self.targets.items():
            setattr(owner, attr, self.saved[name])

    def medians_ms(self, skip: int = 0) -> dict[str, float]:
        return {n: round(statistics.median(t[skip:] or t) * 1e3, 3) for n, t in self.times.items() if t}


# a decode step's launch split in its two host parts: the graph inputs' upload and the graph launch
LAUNCH_PARTS = {"upload": (_Graph, "upload"), "graph_launch": (torch.cuda.CUDAGraph, "replay")}


def replay_ms(runner: ModelRunner) -> float | None:
    """Device time of the last decode step's graph replayed alone (no host work around it)."""
    graph = runner.graphs.last if runner.graphs is not None else None
    if graph is None or graph.graph is None:
        return None
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.graph.replay()  # the same step again: every write lands the same values
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def profile_step(
    core: CoreDriver, run: Any, idle: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-kernel device time of one eager step (graphs off), top 25; with `idle`, also where the
    device waits in that step (`device_idle`: host ops and their Python stacks recorded too, which
    slows the host, so its gaps are upper bounds), else an empty dict."""
    from torch.profiler import ProfilerActivity, profile

    graphs, core.runner.graphs = core.runner.graphs, None
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if idle else [])]
    try:
        run()
        with profile(activities=activities, **(stack_options() if idle else {})) as prof:
            run()
    finally:
        core.runner.graphs = graphs
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us and e.device_type.name != "CPU" and e.key != TIMED:  # kernels only
            rows.append({"kernel": e.key[:90], "us": round(us, 1), "calls": e.count})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    return [{"total_us": round(total, 1)}, *rows[:25]], device_idle(prof.events()) if idle else {}


def host_profile(run: Any, steps: int) -> list[dict[str, Any]]:
    """Host time of `steps` replayed decode steps by op (self CPU time per step, top 15): where the
    host work that the synchronous core pays goes."""
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    rows = [
        {"op": e.key[:80], "self_us_per_step": round(e.self_cpu_time_total / steps, 1), "calls": e.count}
        for e in prof.key_averages()
        if e.key != TIMED  # the step's own range: its self time is Python between ops, not an op
    ]
    rows.sort(key=lambda r: -r["self_us_per_step"])
    return rows[:15]


class ThreadSampler:
    """Samples every other thread's Python stack each `interval` s: per thread, the innermost frames
    (where it sits, idle waits included) and the share of samples in which each dsv4serve function is
    on the stack (where `Engine.generate`'s host time goes: the actors' loop, launch and collect)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.stop = interval, threading.Event()
        self.leaf: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.ours: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> ThreadSampler:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self.stop.wait(self.interval):
            names = {t.ident: t.name[:40] for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                self.samples[name] += 1
                where = lambda f: f"{f.f_code.co_name} ({Path(f.f_code.co_filename).name}:{f.f_lineno})"  # noqa: E731
                self.leaf[name][where(frame)] += 1
                seen = set()
                f: Any = frame
                while f is not None:
                    if "dsv4serve" in f.f_code.co_filename:
                        seen.add(where(f))
                    f = f.f_back
                self.ours[name].update(seen)

    def report(self, top: int = 15) -> dict[str, Any]:
        def shares(c: collections.Counter[str], n: int) -> dict[str, float]:
            return {f: round(k / n, 3) for f, k in c.most_common(top)}

        return {
            name: {"samples": n, "leaf": shares(self.leaf[name], n), "dsv4serve": shares(self.ours[name], n)}
            for name, n in self.samples.items()
        }


def save(args: argparse.Namespace) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(REPORT, indent=1))


def set_constants(assignments: list[str]) -> dict[str, Any]:
    """Each `module.NAME=value` (a module of dsv4serve.backends.cuda, a Python literal) set before the
    engine is built; the names must exist already."""
    done = {}
    for item in assignments:
        target, _, text = item.partition("=")
        module_name, _, name = target.rpartition(".")
        module = importlib.import_module(f"dsv4serve.backends.cuda.{module_name}")
        if not text or not hasattr(module, name):
            raise SystemExit(f"--set {item!r}: no constant {name!r} in {module.__name__}")
        setattr(module, name, ast.literal_eval(text))
        done[target] = getattr(module, name)
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(FAMILIES), default="deepseek_v4")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=None, help="routed experts (default: the model's)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--engine-contexts", type=int, nargs="*", default=[1024])
    parser.add_argument("--prefills", nargs="*", default=["1x1024", "8x1024"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", type=int, nargs="*", default=[1, 64], help="batches to profile at 1k")
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny dimensions on the CPU: checks the flow")
    parser.add_argument("--sample-engine", action="store_true", help="where the engine's threads spend time")
    parser.add_argument(
        "--weights", choices=("bf16", "official", "w8a8"), default="bf16", help="the weights' formats"
    )
    parser.add_argument("--accuracy", type=int, default=256, help="prompts of the native-vs-bf16 check")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="set a constant of a CUDA-backend module first (e.g. linear.GROUPED_FP8_LAUNCH=False): A / B "
        "of one change on one machine; the JSON records it",
    )
    args = parser.parse_args()
    REPORT["set"] = set_constants(args.set)
    device = "cpu" if args.dry_run else "cuda"
    torch.manual_seed(0)
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    family = FAMILIES[args.model]
    experts = args.experts or family.experts
    REPORT.update(gpu=gpu, torch=torch.__version__, model=args.model, layers=args.layers, experts=experts)
    REPORT["weights"] = args.weights
    bandwidth = copy_bandwidth(device, 0.25 if args.dry_run else 4.0)
    REPORT["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    raw = family.raw_config(args.layers, experts, args.dry_run)
    cfg: Any = spec_for(args.model).config(raw)  # the family's config
    hf = family.build_hf(raw, device)
    log("built", round(time.perf_counter() - started, 1), "s")
    longest, widest = max(args.contexts + args.engine_contexts), max(args.batches)
    engine = EngineConfig(
        device=device,
        dtype="bfloat16",
        page_size=128,
        max_num_seqs=widest,
        max_num_batched_tokens=8192,
        max_total_tokens=widest * (longest + 256) + 8192,
    )
    # the driver prefills every request before any decodes, so each holds its last chunk's SWA slots
    # until then (the engine's sizing assumes a decode soon after): room for one chunk per request
    sizes = engine_pool_sizes(cfg, engine)
    if "swa" in sizes.names:
        sizes = sizes.with_(swa=widest * (engine.max_num_batched_tokens // engine.page_size + 2))
    weights = family.engine_weights(hf, cfg)
    plain = dict(weights)  # views of transformers' parameters: the formats' decoded values, below
    if args.weights == "official":
        weights = official_formats(weights, cfg, args.model)
    elif args.weights == "w8a8":
        weights = w8a8_formats(weights, cfg, args.model)
    REPORT["resident_weight_bytes"] = resident_bytes(weights)
    runner = ModelRunner.from_weights(cfg, weights, engine, sizes)
    core = CoreDriver(runner)
    vocab = cfg.vocab_size
    rng = random.Random(0)
    REPORT["prefill"] = {}
    profiles: list[tuple[str, str]] = []  # ("prefill", "8x1024") / ("decode", "b1_ctx1024"), run at the end
    largest = max((math.prod(int(v) for v in p.split("x")) for p in args.prefills), default=0)
    for spec in args.prefills:
        b, n = (int(v) for v in spec.split("x"))
        times = []
        for rep in range(3):
            prompts = random_prompts(rng, vocab, f"p{rep}", b, n)
            times.append(core.prefill(prompts, b * n)[0])
            core.free(list(prompts))
        entry: dict[str, Any] = {"core_ms": round(statistics.median(times[1:]) * 1e3, 2)}
        entry["launch_host_ms"] = round(statistics.median(core.launch_times[-2:]) * 1e3, 2)
        if b * n == largest:
            one = partial(prefill_and_free, core, random_prompts(rng, vocab, "m", b, n), b * n)
            entry["matmul_ms"] = round(matmul_floor_ms(one, device), 2)
            entry["core_over_matmul"] = round(entry["core_ms"] / entry["matmul_ms"], 2)
        if not args.skip_hf:
            entry["hf_ms"] = round(hf_prefill(hf, b, n, vocab), 2)
            entry["hf_over_core"] = round(entry["hf_ms"] / entry["core_ms"], 2)
            if "matmul_ms" in entry:  # the best any engine with these matmuls could do
                entry["hf_over_matmul"] = round(entry["hf_ms"] / entry["matmul_ms"], 2)
        if device == "cuda" and b * n == largest:
            profiles.append(("prefill", spec))
        REPORT["prefill"][spec] = entry
        log("prefill", spec, entry)
        save(args)
    nonexpert, per_expert = weight_bytes(hf, 1)
    if args.weights == "w8a8":  # a byte a weight (and 4 a channel for its scale), not two
        int8 = [w for n, w in weights.items() if isinstance(w, Int8Weight) and ".ffn.experts." not in n]
        nonexpert -= sum(w.qweight.numel() - 4 * w.scale.numel() for w in int8)
        experts = [w for n, w in weights.items() if isinstance(w, Int8Weight) and ".ffn.experts." in n]
        per_expert = per_expert // 2 + 4 * sum(w.scale[0].numel() for w in experts) // args.layers
    if args.weights == "official":  # an expert's three matrices as MXFP4: 4 bits + a byte per 32
        per_expert = per_expert // 2 * 17 // 32
        fp8 = [w for w in weights.values() if isinstance(w, Fp8BlockWeight)]  # a byte, not two, a weight
        nonexpert -= sum(w.qweight.numel() - 4 * w.scale.numel() for w in fp8)
    REPORT["decode"] = {}
    for context in args.contexts:
        for batch in args.batches:
            key = f"b{batch}_ctx{context}"
            prompts = random_prompts(rng, vocab, f"d{key}", batch, context)
            core.prefill(prompts, engine.max_num_batched_tokens)
            rids = list(prompts)
            experts = distinct_experts(runner, core, rids)
            with HostClock(LAUNCH_PARTS) as clock:
                times = core.decode(rids, args.steps)
            launches = core.launch_times[-len(times) :]
            lengths = [core.lengths[r] for r in rids]
            nbytes = {
                "weights": nonexpert + (batch - 1) * cfg.hidden_size * 2,
                "experts": sum(experts) * per_expert,
                "kv": family.kv_bytes(cfg, lengths),
            }
            roofline = sum(nbytes.values()) / bandwidth * 1e3
            entry = {
                "core_ms": round(statistics.median(times[2:]) * 1e3, 3),
                "launch_host_ms": round(statistics.median(launches[2:]) * 1e3, 3),  # of core_ms
                "roofline_ms": round(roofline, 3),
                "bytes": nbytes,
                "distinct_experts": experts,
            }
            entry["core_over_roofline"] = round(entry["core_ms"] / roofline, 2)
            entry["launch_parts_ms"] = clock.medians_ms(skip=2)  # of launch_host_ms
            if device == "cuda":
                entry["replay_ms"] = round(replay_ms(runner) or 0.0, 3)  # the graph of the steps above
            overlapped = core.decode_overlapped(rids, args.steps)  # as the engine's executor runs steps
            entry["core_overlapped_ms"] = round(overlapped * 1e3, 3)
            entry["core_overlapped_over_roofline"] = round(overlapped * 1e3 / roofline, 2)
            if batch in args.profile and context == min(args.contexts) and device == "cuda":
                profiles.append(("decode", key))
            core.free(rids)
            if not args.skip_hf:
                entry["hf_ms"] = round(hf_run(hf, batch, context, min(args.steps, 8), vocab)["decode_ms"], 3)
                entry["hf_over_core"] = round(entry["hf_ms"] / entry["core_ms"], 2)
                entry["hf_over_roofline"] = round(entry["hf_ms"] / roofline, 2)
            REPORT["decode"][key] = entry
            log("decode", key, entry)
            save(args)
    if args.engine_contexts and args.sample_engine:
        with ThreadSampler() as sampler:
            REPORT["engine"] = engine_generate(runner, args, rng)
        REPORT["engine_host_samples"] = sampler.report()
    elif args.engine_contexts:
        REPORT["engine"] = engine_generate(runner, args, rng)
    if args.weights != "bf16" and args.accuracy:
        try:  # a second runner (the bf16 twin, sharing transformers' tensors where it can)
            REPORT["accuracy"] = accuracy(core, cfg, plain, engine, 8 if args.dry_run else args.accuracy, rng)
        except torch.OutOfMemoryError as exc:
            REPORT["accuracy"] = {"error": repr(exc)[:300]}
        torch.cuda.empty_cache() if device == "cuda" else None
        log("accuracy", REPORT["accuracy"])
        save(args)
    run_profiles(core, profiles, args.steps, rng)  # last: the profiler slows later launches (CUPTI)
    REPORT["seconds"] = round(time.perf_counter() - started, 1)
    save(args)
    print(json.dumps(REPORT))


def first_logits(core: CoreDriver, prompts: list[list[int]], tag: str, per_step: int) -> torch.Tensor:
    """Each prompt's next-token logits (fp32, (len(prompts), vocab)), per_step prompts a step."""
    rows = []
    for start in range(0, len(prompts), per_step):
        chunk = {f"{tag}{start + i}": p for i, p in enumerate(prompts[start : start + per_step])}
        rows.append(core.next_logits(chunk).float())
        core.free(list(chunk))
    return torch.cat(rows)


def accuracy(
    core: CoreDriver, cfg: Any, plain: dict[str, Any], engine: EngineConfig, prompts: int, rng: random.Random
) -> dict[str, float]:
    """The native formats against this engine's bf16 path on the same (decoded) weights: first-token
    distributions of random prompts (16-128 tokens): mean KL(bf16 || native), top-1 agreement, max and
    rms |logit diff| (rms as a fraction of the logits' own rms about their mean)."""
    per_step = min(64, engine.max_num_seqs)
    small = engine.with_(max_num_seqs=per_step, max_total_tokens=per_step * 160 + 1024)
    twin = CoreDriver(ModelRunner.from_weights(cfg, plain, small, engine_pool_sizes(cfg, small)))
    texts = [
        [rng.randrange(2, cfg.vocab_size) for _ in range(rng.randrange(16, 129))] for _ in range(prompts)
    ]
    got = first_logits(core, texts, "acc-n", per_step)
    want = first_logits(twin, texts, "acc-b", per_step)
    g, w = got.double(), want.double()
    kl = (w.softmax(-1) * (w.log_softmax(-1) - g.log_softmax(-1))).sum(-1)
    spread = (w - w.mean(-1, keepdim=True)).pow(2).mean().sqrt()
    return {
        "prompts": prompts,
        "mean_kl": round(float(kl.mean()), 5),
        "top1": round(float((g.argmax(-1) == w.argmax(-1)).double().mean()), 4),
        "max_abs_diff": round(float((g - w).abs().max()), 4),
        "rel_rms": round(float((g - w).pow(2).mean().sqrt() / spread), 4),
    }


def run_profiles(core: CoreDriver, profiles: list[tuple[str, str]], steps: int, rng: random.Random) -> None:
    """The per-kernel profiles (and at batch 1 the host profile) of the listed steps, on fresh requests
    of their shapes, after every timing of the run: once the torch profiler has run in a process, each
    later launch pays for CUPTI (a decode graph's `cudaGraphLaunch` ~0.02 -> ~0.07 ms of host time).
    Batch 1 is timed again after its profiles to show it (`core_ms_after_profiler`)."""
    vocab = core.runner.model_cfg.vocab_size
    for kind, key in profiles:
        if kind == "prefill":
            b, n = (int(v) for v in key.split("x"))
            one = partial(prefill_and_free, core, random_prompts(rng, vocab, "q", b, n), b * n)
            entry = REPORT["prefill"][key]
            entry["profile_eager"], entry["device_idle"] = profile_step(core, one, idle=True)
            continue
        batch, context = (int(v) for v in key.removeprefix("b").split("_ctx"))
        prompts = random_prompts(rng, vocab, f"r{key}", batch, context)
        core.prefill(prompts, core.runner.engine.max_num_batched_tokens)
        rids, entry = list(prompts), REPORT["decode"][key]
        entry["profile_eager"] = profile_step(core, lambda rids=rids: core.decode(rids, 1))[0]
        if batch == 1:
            entry["host_profile"] = host_profile(lambda rids=rids: core.decode(rids, 1), 8)
            with HostClock(LAUNCH_PARTS) as clock:
                times = core.decode(rids, steps)
            entry["core_ms_after_profiler"] = round(statistics.median(times[2:]) * 1e3, 3)
            entry["launch_parts_ms_after_profiler"] = clock.medians_ms(skip=2)
        core.free(rids)
        log("profiled", key)


def engine_generate(runner: ModelRunner, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """`Engine.generate` through the actor system: per decode step = (T(n + 1 tokens) - T(1 token)) / n,
    after a warm-up run of the same batch."""
    from dsv4serve import Engine, SamplingParams, logs
    from dsv4serve.actors.system import SystemOptions
    from dsv4serve.actors.tokenizer_core import load_tokenizer
    from dsv4serve.models.tiny import copy_tokenizer

    out: dict[str, Any] = {}
    logs.configure("warning")
    with tempfile.TemporaryDirectory() as tmp:
        copy_tokenizer(Path(tmp))
        tok = load_tokenizer(Path(tmp))
        options = SystemOptions(model_dir=Path(tmp), engine=runner.engine, prebuilt=(runner, tok))
        with Engine._of(options) as engine:
            for context in args.engine_contexts:
                for batch in args.batches:
                    vocab = runner.model_cfg.vocab_size
                    prompts = list(random_prompts(rng, vocab, "e", batch, context).values())
                    walls, steps, preempted = [], [], []
                    # warm-up: graph captures and kernel compiles of this batch's buckets happen here
                    engine.generate(prompts, SamplingParams(max_tokens=args.steps * 2 + 1, temperature=0.0))
                    for tokens in (1, args.steps * 2 + 1):
                        params = SamplingParams(max_tokens=tokens, temperature=0.0)
                        before = engine.stats()
                        begin = time.perf_counter()
                        engine.generate(prompts, params)
                        walls.append(time.perf_counter() - begin)
                        after = engine.stats()
                        steps.append(after.num_steps - before.num_steps)
                        preempted.append(after.num_preemptions - before.num_preemptions)
                    per_step = (walls[1] - walls[0]) / (args.steps * 2) * 1e3
                    key = f"b{batch}_ctx{context}"
                    decode = REPORT["decode"].get(key, {})
                    core_ms, overlapped_ms = decode.get("core_ms"), decode.get("core_overlapped_ms")
                    out[key] = {"engine_ms": round(per_step, 3), "core_ms": core_ms}
                    out[key] |= {"steps": steps, "preemptions": preempted}
                    if core_ms:
                        out[key]["engine_over_core"] = round(per_step / core_ms, 3)
                    if overlapped_ms:
                        out[key]["engine_over_core_overlapped"] = round(per_step / overlapped_ms, 3)
                    log("engine", key, out[key])
    return out


if __name__ == "__main__":
    main()
