"""Decode steps as CUDA graphs, captured per (batch bucket, context bucket, sampling mode) and replayed.

A decode step (every item one token that samples) is padded to the next batch bucket with items on
the tables' pad row (every slot they touch is a sentinel, no window closes), and its `max_seq_len` is
rounded up to a context bucket, so the per-token entry lists follow live context, not max_model_len.
Every input lives in two static device buffers (int64 and fp32) that one host->device copy refills
per step; the forward and the sampler then replay with no Python in between. Capture runs on a
batch of padding only, so neither the warm-up nor the capture writes a live pool row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dsv4serve.attention.metadata import ForwardBatch, WindowMeta
from dsv4serve.devices import copy_to_device
from dsv4serve.executor.sampling import SamplingBatch, top_k_of
from dsv4serve.protocol import MAX_TOP_LOGPROBS, StepItem

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
MIN_CONTEXT = 256
CONTEXT_STEP_UNTIL = 32768
MASK32 = 0xFFFFFFFF

StepFn = Callable[[ForwardBatch, SamplingBatch], tuple[torch.Tensor, torch.Tensor]]  # -> (2+2k, B), logits


@dataclass(frozen=True)
class GraphKey:
    batch: int  # padded number of requests
    context: int  # bound on every request's length after the step
    greedy: bool
    filtered: bool  # some row uses top-k / top-p
    logprobs: bool
    num_top: int  # 0, or MAX_TOP_LOGPROBS when some request asks for top logprobs (one graph for any n)


def is_decode(items: Sequence[StepItem]) -> bool:
    return bool(items) and all(len(i.token_ids) == 1 and i.sample for i in items)


def batch_bucket(n: int, limit: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if b >= n and b <= max(limit, 1)), None)


def context_bucket(longest: int, max_len: int) -> int:
    """256, 512, then every 1024 up to 32k, then powers of two: little more than live context."""
    if longest <= 1024:
        bucket = MIN_CONTEXT
        while bucket < longest:
            bucket *= 2
    elif longest <= CONTEXT_STEP_UNTIL:
        bucket = -(-longest // 1024) * 1024
    else:
        bucket = CONTEXT_STEP_UNTIL
        while bucket < longest:
            bucket *= 2
    return min(bucket, max_len)


class _Graph:
    """One captured step: static inputs (views of `ints` / `floats`), the graph, static outputs."""

    def __init__(self, key: GraphKey, ratios: Sequence[int], device: torch.device) -> None:
        B = self.batch = key.batch
        self.key, self.ratios = key, tuple(ratios)
        names = ["input_ids", "positions", "token_req", "rows", "prefix_lens", "seq_lens", "cu_seqlens"]
        names += ["sample_index", *(f"{p}{r}" for r in ratios for p in ("win_req", "win_index"))]
        names += ["top_k", "seed", "sample_pos"]
        sizes = [B + 1 if n == "cu_seqlens" else B for n in names]
        self.offsets = dict(zip(names, (sum(sizes[:i]) for i in range(len(sizes))), strict=True))
        # one buffer, one upload per step: the ints, then 2 * B floats in B int64 words
        self.inputs = torch.zeros(sum(sizes) + B, dtype=torch.int64, device=device)
        self.ints = self.inputs[: sum(sizes)]
        self.floats = self.inputs[sum(sizes) :].view(torch.float32)
        v = {n: self.ints[o : o + s] for (n, o), s in zip(self.offsets.items(), sizes, strict=True)}
        self.forward_batch = ForwardBatch(
            **{n: v[n] for n in names[:8]},
            max_seq_len=key.context,
            windows={r: WindowMeta(req=v[f"win_req{r}"], index=v[f"win_index{r}"]) for r in ratios},
        )
        self.params = SamplingBatch(
            self.floats[:B], self.floats[B:], v["top_k"], v["seed"], v["sample_pos"],
            key.greedy, key.filtered, key.logprobs, key.num_top,
        )  # fmt: skip
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = self.logits = torch.zeros(0)  # static outputs: (2 + 2k, B) sampled, (B, V) logits

    def upload(self, items: Sequence[StepItem], seeds: Sequence[int], pad_row: int) -> None:
        """Copy the step's inputs (items, then padding) into the static buffers, without waiting (staged
        in pinned buffers that the step before may still be reading from: `devices.copy_to_device`)."""
        host = np.empty(self.inputs.shape, dtype=np.int64)
        ints = self.ints.numel()
        self.fill(host[:ints], host[ints:].view(np.float32), items, seeds, pad_row)
        copy_to_device(self.inputs, torch.from_numpy(host))

    def fill(
        self, ints: Any, floats: Any, items: Sequence[StepItem], seeds: Sequence[int], pad_row: int
    ) -> None:
        B, n, off = self.batch, len(items), self.offsets
        prefix = [i.prefix_len for i in items]

        def put(name: str, values: Sequence[int], fill: int) -> None:
            ints[off[name] : off[name] + n] = values
            ints[off[name] + n : off[name] + B] = fill

        put("input_ids", [i.token_ids[0] for i in items], 0)
        put("positions", prefix, 0)
        put("rows", [i.row for i in items], pad_row)
        put("prefix_lens", prefix, 0)
        put("seq_lens", [p + 1 for p in prefix], 1)
        for r in self.ratios:
            put(f"win_index{r}", [(p + 1) // r - 1 if (p + 1) % r == 0 else -1 for p in prefix], -1)
        put("top_k", [top_k_of(i.sampling.top_k) for i in items], 0)
        put("seed", [s & MASK32 for s in seeds], 0)
        put("sample_pos", [p + 1 for p in prefix], 1)
        for name in ("token_req", "sample_index", *(f"win_req{r}" for r in self.ratios)):
            ints[off[name] : off[name] + B] = range(B)
        ints[off["cu_seqlens"] : off["cu_seqlens"] + B + 1] = range(B + 1)
        floats[:n] = [i.sampling.temperature for i in items]
        floats[B : B + n] = [i.sampling.top_p for i in items]
        floats[n:B] = 0.0
        floats[B + n :] = 1.0

    def capture(self, step: StepFn, pad_row: int, pool: object) -> None:
        self.upload((), (), pad_row)  # a batch of padding only: every write lands on a sentinel
        device = self.inputs.device  # the runner's, not necessarily the current device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: compiles the kernels of these shapes
            step(self.forward_batch, self.params)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trio thread's slot-table copies (pinned staging, event waits) run while a
        # worker thread captures; under the default global mode they invalidated the capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # type: ignore[arg-type]
            self.out, self.logits = step(self.forward_batch, self.params)
        self.graph = graph


class DecodeGraphs:
    """The captured decode steps of one runner, by key; captured lazily on first use."""

    def __init__(
        self,
        step: StepFn,
        ratios: Sequence[int],
        max_seqs: int,
        max_len: int,
        pad_row: int,
        device: torch.device,
    ) -> None:
        self.step, self.ratios, self.max_seqs, self.max_len = step, tuple(ratios), max_seqs, max_len
        self.pad_row, self.device = pad_row, device
        self.graphs: dict[GraphKey, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.last: _Graph | None = None  # the graph the latest step replayed (benchmarks time it alone)

    def key(self, items: Sequence[StepItem]) -> GraphKey | None:
        """The graph a step replays, or None when it must run eagerly."""
        if not is_decode(items):
            return None
        batch = batch_bucket(len(items), self.max_seqs)
        if batch is None:
            return None
        specs = [i.sampling for i in items]
        greedy, filtered = SamplingBatch.flags(
            [s.temperature for s in specs], [s.top_p for s in specs], [s.top_k for s in specs]
        )
        logprobs = any(i.sampling.logprobs for i in items)
        num_top = MAX_TOP_LOGPROBS if any(i.sampling.top_logprobs for i in items) else 0
        context = context_bucket(max(i.seq_len for i in items), self.max_len)
        return GraphKey(batch, context, greedy, filtered, logprobs, num_top)

    def launch(
        self, key: GraphKey, items: Sequence[StepItem], seeds: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the step's replay; returns the graph's static outputs ((2 + 2k, B) sampled outputs,
        (B, V) logits), valid until its next replay."""
        graph = self.graphs.get(key)
        if graph is None:
            graph = _Graph(key, self.ratios, self.device)
            graph.capture(self.step, self.pad_row, self.pool)  # a failed capture caches nothing
            self.graphs[key] = graph
        graph.upload(items, seeds, self.pad_row)
        assert graph.graph is not None
        graph.graph.replay()
        self.last = graph
        return graph.out, graph.logits
