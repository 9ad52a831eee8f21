"""Decode-graph bucketing (pure functions; the capture and replay run in the CUDA golden tests)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from dsv4serve.backends import reference
from dsv4serve.executor.graphs import (
    BATCH_BUCKETS,
    DecodeGraphs,
    GraphKey,
    batch_bucket,
    context_bucket,
    is_decode,
)
from dsv4serve.protocol import LOOKAHEAD, SamplingParams, StepItem


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
    spec = SamplingParams()
    decode = StepItem(rid="a", prefix_len=5, token_ids=(LOOKAHEAD,), sample=True, sampling=spec)
    chunk = StepItem(rid="b", prefix_len=0, token_ids=(1, 2), sample=True, sampling=spec)
    assert is_decode([decode]) and not is_decode([decode, chunk]) and not is_decode([])


def test_a_failed_capture_caches_nothing() -> None:
    """A step whose capture raises fails alone; the next step of that key captures again (it used to
    find a graph-less entry and fail on an assert, and so did every step after it)."""

    class FailingGraph:
        def capture(self, step: object) -> None:
            raise RuntimeError("capture failed")

    backend = dataclasses.replace(reference.backend(), graphs=lambda device: FailingGraph())  # type: ignore[arg-type]
    step = lambda batch, params: (batch, params)  # noqa: E731
    cpu, logits = torch.device("cpu"), (32, torch.float32)
    graphs = DecodeGraphs(step, backend, (), 8, 1024, 0, cpu, logits)
    key = GraphKey(1, 256, True, False, False, 0)
    item = StepItem(rid="a", prefix_len=5, token_ids=(7,), sample=True, sampling=SamplingParams(), row=0)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="capture failed"):
            graphs.launch(key, [item], [1])
        assert graphs.graphs == {}


def test_startup_keys_cover_every_batch_bucket_at_both_size_classes_largest_first() -> None:
    """Before serving, the greedy step of every batch bucket up to max_num_seqs is captured at the
    warm contexts (capped at the model's length), largest batch first."""
    backend = reference.backend()
    step = lambda batch, params: (batch, params)  # noqa: E731
    graphs = DecodeGraphs(
        step,
        dataclasses.replace(backend, graphs=lambda d: None),
        (4,),
        20,
        1024,
        0,
        torch.device("cpu"),
        (8, torch.float32),
    )  # type: ignore[arg-type]
    keys = graphs.startup_keys()
    assert [k.batch for k in keys] == [16, 12, 8, 4, 2, 1] * 2
    assert [k.context for k in keys] == [256] * 6 + [1024] * 6
    assert all(k.greedy and not (k.filtered or k.logprobs or k.num_top) for k in keys)
    assert graphs.logits.shape == (16, 8)  # the largest bucket's rows
