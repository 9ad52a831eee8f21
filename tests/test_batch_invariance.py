"""A prompt's greedy tokens do not depend on what else is in the batch (reference backend).

Random tiny shapes with 2 index heads, where indexer scores tie exactly (at 0) often: the row width
the indexer's top-k sees is the batch's longest request, so `torch.topk`'s own choice among ties
would change with the batch. The engine breaks ties to the lowest compressed index; each prompt must
give the same tokens alone as inside a random batch (prefills chunked at random, mixed with
decodes), and through `Engine.generate` alone as inside a batch whose small KV capacity forces
preemptions. A counter checks that exact ties at the top-k boundary really occurred.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from golden_harness import engine_traces, random_chunker
from tiny_shapes import random_shape

from dsv4serve import Engine, SamplingParams
from dsv4serve.attention import core
from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.deepseek_v4.tiny import make_tiny

NUM_SHAPES = 6
MAX_NEW = 24


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def boundary_ties(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts indexer rows whose k-th and (k+1)-th visible scores are exactly equal."""
    count = [0]
    topk: Callable[[torch.Tensor, int], torch.Tensor] = core.topk_lowest_ties

    def counting(scores: torch.Tensor, k: int) -> torch.Tensor:
        if scores.shape[-1] > k:
            top = scores.sort(dim=-1, descending=True).values[:, k - 1 : k + 1]  # (T, 2)
            count[0] += int(((top[:, 0] == top[:, 1]) & (top[:, 1] > float("-inf"))).sum())
        return topk(scores, k)

    monkeypatch.setattr(core, "topk_lowest_ties", counting)
    return count


def _prompts(rng: random.Random, num: int) -> list[list[int]]:
    return [[rng.randrange(2, 512) for _ in range(rng.randint(1, 60))] for _ in range(num)]


def test_greedy_tokens_alone_equal_tokens_in_random_batches(tmp_path: Path, boundary_ties: list[int]) -> None:
    engine = EngineConfig(device="cpu", dtype="float32", page_size=4, max_num_seqs=6, max_total_tokens=1024)
    for seed in range(NUM_SHAPES):
        rng = random.Random(100 + seed)
        model_dir = make_tiny(tmp_path / f"shape{seed}", seed=seed, **random_shape(rng))
        runner = ModelRunner(model_dir, engine)
        prompts = _prompts(rng, rng.randint(3, 5))
        alone = [engine_traces(model_dir, [p], MAX_NEW, engine, runner=runner)[0].tokens for p in prompts]
        order = rng.sample(range(len(prompts)), len(prompts))
        chunk = random_chunker(seed, 1, 17)
        batched = engine_traces(model_dir, [prompts[i] for i in order], MAX_NEW, engine, chunk, runner)
        for i, trace in zip(order, batched, strict=True):
            assert trace.tokens == alone[i], f"shape {seed}, prompt {i} (length {len(prompts[i])})"
    assert boundary_ties[0] > 0, "no exact tie at the top-k boundary: the test did not exercise the rule"


# seeds whose tokens change with the batch under plain `torch.topk` (checked when the test was written)
@pytest.mark.parametrize("seed", [4, 6])
def test_engine_tokens_alone_equal_tokens_batched_and_preempted(tmp_path: Path, seed: int) -> None:
    rng = random.Random(200 + seed)
    model_dir = make_tiny(tmp_path / "model", seed=seed, **random_shape(rng))
    prompts = _prompts(rng, 6)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    small = {"max_num_seqs": 6, "max_num_batched_tokens": 16, "max_total_tokens": 128, "page_size": 4}
    with Engine(model_dir, dtype="float32", **small) as eng:  # type: ignore[arg-type]
        alone = [list(eng.generate([p], greedy)[0].token_ids) for p in prompts]
        assert eng.stats().num_preemptions == 0
        batched = [list(c.token_ids) for c in eng.generate(prompts, greedy)]
        assert eng.stats().num_preemptions > 0, "the small KV capacity was meant to force preemptions"
    assert batched == alone
