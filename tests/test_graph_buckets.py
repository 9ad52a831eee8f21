"""Decode-graph bucketing (pure functions; the capture and replay run in the CUDA golden tests)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dsv4serve.attention.metadata import BatchItem, build_forward_batch
from dsv4serve.executor.graphs import (
    BATCH_BUCKETS,
    DecodeGraphs,
    GraphKey,
    _Graph,
    batch_bucket,
    context_bucket,
    is_decode,
)
from dsv4serve.executor.sampling import top_k_of
from dsv4serve.protocol import LOOKAHEAD, SamplingSpec, StepItem


def test_context_buckets_follow_live_context_closely() -> None:
    assert [context_bucket(n, 10**6) for n in (1, 256, 257, 1024, 1025, 8192, 8193)] == [
        256, 256, 512, 1024, 2048, 8192, 9216,
    ]  # fmt: skip
    assert context_bucket(40_000, 10**6) == 65536 and context_bucket(5000, 4096) == 4096
    for n in range(1, 40_000, 37):
        bucket = context_bucket(n, 10**6)
        assert (
            bucket >= n
            and (bucket <= 2 * n or bucket == 256)
            and (n > 1024 >= bucket - n or n <= 1024 or n > 32768)
        )


def test_batch_buckets_and_what_counts_as_a_decode_step() -> None:
    assert batch_bucket(1, 64) == 1 and batch_bucket(5, 64) == 8 and batch_bucket(64, 64) == 64
    assert batch_bucket(65, 64) is None and all(a < b for a, b in itertools.pairwise(BATCH_BUCKETS))
    spec = SamplingSpec()
    decode = StepItem(rid="a", prefix_len=5, token_ids=(LOOKAHEAD,), sample=True, sampling=spec)
    chunk = StepItem(rid="b", prefix_len=0, token_ids=(1, 2), sample=True, sampling=spec)
    assert is_decode([decode]) and not is_decode([decode, chunk]) and not is_decode([])


def test_a_failed_capture_caches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose capture raises fails alone; the next step of that key captures again (it used to
    find a graph-less entry and fail on an assert, and so did every step after it)."""
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # no CUDA here: only the cache logic runs
    graphs.graphs, graphs.ratios, graphs.device = {}, (), torch.device("cpu")
    graphs.step, graphs.pad_row, graphs.pool = None, 0, None  # type: ignore[assignment]
    key = GraphKey(1, 256, True, False, False, 0)
    item = StepItem(rid="a", prefix_len=5, token_ids=(7,), sample=True, sampling=SamplingSpec(), row=0)

    def capture(self: _Graph, step: object, pool: object) -> None:
        raise RuntimeError("capture failed")

    monkeypatch.setattr(_Graph, "capture", capture)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="capture failed"):
            graphs.launch(key, [item], [1])
        assert graphs.graphs == {}


@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_a_graph_upload_holds_the_eager_batch_then_padding(n: int) -> None:
    """A decode graph's static inputs after an upload: each item's fields as the eager step's batch
    has them (windows closing where the eager batch closes one), then padding on the pad row."""
    ratios, B, pad_row = (4, 128), 8, 99
    graph = _Graph(GraphKey(B, 1024, False, True, False, 0), ratios, torch.device("cpu"), pad_row)
    rng = random.Random(n)
    for size in (n, 0, n // 2, n):  # the same buffers refilled: nothing of a step before survives
        prefixes = [rng.choice([rng.randrange(0, 1000), 127, 511, 1023]) for _ in range(size)]
        items = [
            StepItem(
                rid=f"r{j}", prefix_len=p, token_ids=(rng.choice([LOOKAHEAD, rng.randrange(1000)]),),
                sample=True, row=rng.randrange(50),
                sampling=SamplingSpec(temperature=rng.random(), top_p=rng.random(), top_k=rng.choice([0, 7])),
            )
            for j, p in enumerate(prefixes)
        ]  # fmt: skip
        seeds = [rng.randrange(2**40) for _ in items]
        graph.upload(items, seeds)
        got, params = graph.forward_batch, graph.params
        eager = build_forward_batch(
            [BatchItem(i.row, i.prefix_len, i.token_ids, True) for i in items], ratios, "cpu"
        )
        for name in ("input_ids", "positions", "rows", "prefix_lens", "seq_lens"):
            pad = {"rows": pad_row, "seq_lens": 1}.get(name, 0)
            assert getattr(got, name).tolist() == getattr(eager, name).tolist() + [pad] * (B - size), name
        assert got.token_req.tolist() == got.sample_index.tolist() == list(range(B))
        assert got.cu_seqlens.tolist() == list(range(B + 1))
        for r in ratios:
            closing = dict(zip(eager.windows[r].req.tolist(), eager.windows[r].index.tolist(), strict=True))
            assert got.windows[r].index.tolist() == [closing.get(j, -1) for j in range(B)]
            assert got.windows[r].req.tolist() == list(range(B))
        assert params.temperature.tolist() == pytest.approx(
            [i.sampling.temperature for i in items] + [0.0] * (B - size)
        )
        assert params.top_p.tolist() == pytest.approx([i.sampling.top_p for i in items] + [1.0] * (B - size))
        assert params.top_k.tolist() == [top_k_of(i.sampling.top_k) for i in items] + [0] * (B - size)
        assert params.seed.tolist() == [s & 0xFFFFFFFF for s in seeds] + [0] * (B - size)
        assert params.position.tolist() == [p + 1 for p in prefixes] + [1] * (B - size)
