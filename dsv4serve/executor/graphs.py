"""Decode steps as CUDA graphs, captured per (batch bucket, context bucket, sampling mode) and replayed.

A decode step (every item one token that samples) is padded to the next batch bucket with items on
the tables' pad row (every slot they touch is a sentinel, no window closes), and its `max_seq_len` is
rounded up to a context bucket, so the per-token entry lists follow live context, not max_model_len.
Every input lives in one static device buffer (int64 words, the fp32 ones viewed) that one
host->device copy refills per step, from a pinned buffer filled in place (a template of padding, then
the items' fields in one indexed assignment); the forward and the sampler then replay with no Python
in between. Capture runs on a batch of padding only, so neither the warm-up nor the capture writes a
live pool row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsv4serve.attention.metadata import ForwardBatch, WindowMeta
from dsv4serve.devices import PinnedStages
from dsv4serve.executor.sampling import SamplingBatch, top_k_of
from dsv4serve.protocol import MAX_TOP_LOGPROBS, StepItem

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
MIN_CONTEXT = 256
CONTEXT_STEP_UNTIL = 32768
MASK32 = 0xFFFFFFFF
STAGES = 3  # pinned upload buffers per graph (the engine runs at most a step or two ahead)

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

    def __init__(self, key: GraphKey, ratios: Sequence[int], device: torch.device, pad_row: int) -> None:
        B = self.batch = key.batch
        self.key, self.ratios = key, tuple(ratios)
        names = ["input_ids", "positions", "token_req", "rows", "prefix_lens", "seq_lens", "cu_seqlens"]
        names += ["sample_index", *(f"{p}{r}" for r in ratios for p in ("win_req", "win_index"))]
        names += ["top_k", "seed", "sample_pos"]
        sizes = [B + 1 if n == "cu_seqlens" else B for n in names]
        self.offsets = dict(zip(names, (sum(sizes[:i]) for i in range(len(sizes))), strict=True))
        # one buffer, one upload per step: the ints, then 2 * B floats in B int64 words
        self.num_ints = sum(sizes)
        self.inputs = torch.zeros(self.num_ints + B, dtype=torch.int64, device=device)
        self.ints = self.inputs[: self.num_ints]
        self.floats = self.inputs[self.num_ints :].view(torch.float32)
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
        per_item = ["input_ids", "positions", "rows", "prefix_lens", "seq_lens"]
        per_item += [*(f"win_index{r}" for r in ratios), "top_k", "seed", "sample_pos"]
        # item j's value of field f goes to word columns[f, j]; the rest of a step is the template
        self.columns = np.array([[self.offsets[f] + j for j in range(B)] for f in per_item], dtype=np.int64)
        self.template = self._template(pad_row)
        self.stages = PinnedStages(self.inputs, STAGES)  # the step before may still read one
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = self.logits = torch.zeros(0)  # static outputs: (2 + 2k, B) sampled, (B, V) logits

    def _template(self, pad_row: int) -> np.ndarray:
        """A step of padding only: every item on the pad row (its slots are sentinels), one token
        each at position 0, no window closing; temperature 0, top-p 1."""
        B, off = self.batch, self.offsets
        host = np.zeros(self.inputs.shape, dtype=np.int64)
        ints, floats = host[: self.num_ints], host[self.num_ints :].view(np.float32)
        ints[off["rows"] : off["rows"] + B] = pad_row
        for name in ("seq_lens", "sample_pos"):
            ints[off[name] : off[name] + B] = 1
        for r in self.ratios:
            ints[off[f"win_index{r}"] : off[f"win_index{r}"] + B] = -1
        for name in ("token_req", "sample_index", *(f"win_req{r}" for r in self.ratios)):
            ints[off[name] : off[name] + B] = np.arange(B)
        ints[off["cu_seqlens"] : off["cu_seqlens"] + B + 1] = np.arange(B + 1)
        floats[B:] = 1.0
        return host

    def upload(self, items: Sequence[StepItem], seeds: Sequence[int]) -> None:
        """Copy the step's inputs (items, then padding) into the static buffers, without waiting: filled
        in a pinned staging buffer whose previous copy has run (else in a fresh one), copied async."""
        words = self.stages.stage()
        self.fill(words, items, seeds)
        self.stages.send()

    def fill(self, host: np.ndarray, items: Sequence[StepItem], seeds: Sequence[int]) -> None:
        """The template, then each item's fields in one indexed assignment, then its floats."""
        np.copyto(host, self.template)
        n = len(items)
        if not n:
            return
        rows = []
        for i, seed in zip(items, seeds, strict=True):
            p = i.prefix_len
            q = p + 1  # the sequence length after the step, and the sampled token's position
            windows = [q // r - 1 if q % r == 0 else -1 for r in self.ratios]  # the window that closes
            rows.append(
                (i.token_ids[0], p, i.row, p, q, *windows, top_k_of(i.sampling.top_k), seed & MASK32, q)
            )
        host[self.columns[:, :n]] = np.array(rows, dtype=np.int64).T
        floats = host[self.num_ints :].view(np.float32)
        floats[:n] = [i.sampling.temperature for i in items]
        floats[self.batch : self.batch + n] = [i.sampling.top_p for i in items]

    def capture(self, step: StepFn, pool: object) -> None:
        self.upload((), ())  # a batch of padding only: every write lands on a sentinel
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
            graph = _Graph(key, self.ratios, self.device, self.pad_row)
            graph.capture(self.step, self.pool)  # a failed capture caches nothing
            self.graphs[key] = graph
        graph.upload(items, seeds)
        assert graph.graph is not None
        graph.graph.replay()
        self.last = graph
        return graph.out, graph.logits
