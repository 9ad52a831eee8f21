"""Decode steps as device graphs, captured per (batch bucket, context bucket, sampling mode) and replayed.

A decode step (every item one token that samples) is padded to the next batch bucket (`inputs.pack`:
padding items on the tables' pad row, where every slot they touch is a sentinel), and its
`max_seq_len` is rounded up to a context bucket, so the per-token entry lists follow live context,
not max_model_len. Every input lives in one static device buffer of words that one host->device copy
refills per step, from a staged host buffer filled in place; the forward and the sampler then replay
with no Python in between. Capture runs on a batch of padding only, so neither the warm-up nor the
capture writes a live pool row. The graphs share one memory pool, and their logits land in one
buffer of the largest bucket's rows that lives outside it: a graph's own outputs stay allocated in the
pool for as long as the graph lives, and (B, vocab) logits per (batch, context) bucket added up to
gigabytes over a day's contexts; the copy costs a step B x vocab x 4 bytes of device traffic. The
backend captures and replays (`Backend.graphs`); this module only decides which steps replay which
graph.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.backends import Backend, Graph
from dsv4serve.executor.inputs import SamplingFlags, StepLayout, StepShape, pack
from dsv4serve.executor.sampling import SamplingBatch
from dsv4serve.protocol import MAX_TOP_LOGPROBS, StepItem

_LOG = structlog.get_logger().bind(actor="executor")
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
MIN_CONTEXT = 256
CONTEXT_STEP_UNTIL = 32768
WARM_CONTEXTS = (MIN_CONTEXT, 2048)  # captured at start-up: both of Triton's size classes of the tables

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
    """One captured step: its static input words (a device buffer refilled through a stager), the
    graph and its static outputs."""

    def __init__(self, key: GraphKey, ratios: Sequence[int], device: torch.device, backend: Backend) -> None:
        self.key = key
        self.layout = StepLayout(StepShape.decode(key.batch, len(ratios)), ratios)
        self.words = torch.zeros(self.layout.num_words, dtype=torch.int64, device=device)
        flags = SamplingFlags(key.greedy, key.filtered, key.logprobs, key.num_top)
        self.batch, self.params = self.layout.views(self.words, key.context, flags)
        self.stager = backend.transfers.stager(self.words)
        self.graph: Graph | None = None
        self.out = self.logits = torch.zeros(0)  # static outputs: (2 + 2k, B) sampled, (B, V) logits

    def upload(self, items: Sequence[StepItem], seeds: Sequence[int], pad_row: int) -> None:
        """Pack the step's inputs (items, then padding) into a staged host buffer and queue its copy
        into the static words, without waiting."""
        pack(items, seeds, self.layout, self.stager.stage(), pad_row)
        self.stager.send()

    def capture(self, step: StepFn, graph: Graph, pad_row: int, logits: torch.Tensor) -> None:
        """Capture on a batch of padding only: every write lands on a sentinel. The step's logits are
        copied into `logits` (the graphs' shared buffer, at least B rows)."""
        self.upload((), (), pad_row)
        self.logits = logits[: self.key.batch]

        def run() -> torch.Tensor:
            out, step_logits = step(self.batch, self.params)
            assert step_logits.dtype == logits.dtype, f"{step_logits.dtype} logits, {logits.dtype} buffer"
            self.logits.copy_(step_logits)
            return out

        self.out = graph.capture(run)
        self.graph = graph


class DecodeGraphs:
    """The captured decode steps of one runner, by key: the greedy ones of `startup_keys` before
    serving (`capture`), any other on first use."""

    def __init__(
        self,
        step: StepFn,
        backend: Backend,
        ratios: Sequence[int],
        max_seqs: int,
        max_len: int,
        pad_row: int,
        device: torch.device,
        logits: tuple[int, torch.dtype],  # (vocab, dtype) of the step's logits
    ) -> None:
        assert backend.graphs is not None, f"the {backend.name} backend captures no graphs"
        self.step, self.backend, self.new_graph = step, backend, backend.graphs
        self.ratios, self.max_seqs, self.max_len = tuple(ratios), max_seqs, max_len
        self.pad_row, self.device = pad_row, device
        rows = max(b for b in BATCH_BUCKETS if b <= max(max_seqs, 1))  # more requests run eagerly
        self.logits = torch.empty(rows, logits[0], dtype=logits[1], device=device)
        self.graphs: dict[GraphKey, _Graph] = {}
        self.last: _Graph | None = None  # the graph the latest step replayed (benchmarks time it alone)

    def key(self, items: Sequence[StepItem]) -> GraphKey | None:
        """The graph a step replays, or None when it must run eagerly."""
        if not is_decode(items):
            return None
        batch = batch_bucket(len(items), self.max_seqs)
        if batch is None:
            return None
        flags = SamplingFlags.of(items)
        num_top = MAX_TOP_LOGPROBS if flags.num_top else 0  # one graph for any number of top logprobs
        context = context_bucket(max(i.seq_len for i in items), self.max_len)
        return GraphKey(batch, context, flags.all_greedy, flags.needs_filter, flags.want_logprobs, num_top)

    def startup_keys(self) -> list[GraphKey]:
        """The greedy steps captured before serving: every batch bucket (largest first, so the pool is
        sized once) at the contexts of WARM_CONTEXTS. A first capture also compiles the kernels of its
        shapes; Triton specializes on sizes (== 1, multiples of 16), so a bucket first met while
        serving stalled every stream for seconds (run 81: 2.76 s for batch 16)."""
        contexts = sorted({min(c, self.max_len) for c in WARM_CONTEXTS})
        batches = [b for b in reversed(BATCH_BUCKETS) if b <= max(self.max_seqs, 1)]
        return [GraphKey(b, c, True, False, False, 0) for c in contexts for b in batches]

    def capture(self, keys: Sequence[GraphKey]) -> None:
        """Capture the graphs of `keys` not captured yet."""
        begin, before = time.perf_counter(), len(self.graphs)
        for key in keys:
            if key not in self.graphs:
                self._capture(key)
        ms = round((time.perf_counter() - begin) * 1e3, 1)
        _LOG.info("graphs_ready", captured=len(self.graphs) - before, graphs=len(self.graphs), ms=ms)

    def _capture(self, key: GraphKey) -> _Graph:
        begin = time.perf_counter()
        graph = _Graph(key, self.ratios, self.device, self.backend)
        new = self.new_graph(self.device)
        graph.capture(self.step, new, self.pad_row, self.logits)  # a failure caches nothing
        self.graphs[key] = graph
        ms = round((time.perf_counter() - begin) * 1e3, 1)  # the step that met it waited this long
        _LOG.info("graph_captured", batch=key.batch, context=key.context, ms=ms, graphs=len(self.graphs))
        return graph

    def launch(
        self, key: GraphKey, items: Sequence[StepItem], seeds: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the step's replay; returns the graph's static outputs ((2 + 2k, B) sampled outputs,
        (B, V) logits), valid until its next replay."""
        graph = self.graphs.get(key) or self._capture(key)
        graph.upload(items, seeds, self.pad_row)
        assert graph.graph is not None
        graph.graph.replay(items)
        self.last = graph
        return graph.out, graph.logits
