"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs, top logprobs."""

from __future__ import annotations

import math

import torch

from dsv4serve.executor.sampling import SamplingBatch, sample, top_logprobs, uniform
from tests.sampling_rows import sampling_batch


def _params(
    n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 7, position: int = 3
) -> SamplingBatch:
    return sampling_batch([temperature] * n, [top_p] * n, [top_k] * n, [seed] * n, [position] * n)


def test_greedy_is_argmax_and_logprob_matches_log_softmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample(logits, _params(5, temperature=0.0))
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs, expected)


def _reference_top(logits: torch.Tensor, n: int) -> tuple[list[list[int]], torch.Tensor]:
    """torch.log_softmax's n largest per row (topk's values), ids ordered by (-logprob, id)."""
    ref = torch.log_softmax(logits.double(), -1)
    ids = [sorted(range(ref.shape[1]), key=lambda j: (-float(row[j]), j))[:n] for row in ref]
    return ids, ref.topk(n).values


def test_top_logprobs_equal_log_softmax_topk_with_ties_to_the_lowest_id() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 300, generator=gen) * 4).round() / 2  # (S, V): many exact ties
    logits[0] = 1.0  # a whole row of ties
    logits[1, 250:] = logits[1].max()  # the tie at the top, at high ids
    for n in (1, 5, 20):
        ids, lps = top_logprobs(logits, n)
        want_ids, want_lps = _reference_top(logits, n)
        assert ids.tolist() == want_ids
        assert torch.allclose(lps.double(), want_lps, atol=1e-5)
    assert top_logprobs(logits, 5)[0][0].tolist() == [0, 1, 2, 3, 4]


def test_chosen_logprob_is_the_top_entry_of_the_same_log_softmax() -> None:
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)) * 3
    top_ids, top_lps = top_logprobs(logits, 64)  # every token: the chosen one is among them
    for temperature in (0.0, 1.0):
        tokens, logprobs = sample(logits, _params(8, temperature=temperature, seed=11))
        at = (top_ids == tokens[:, None]).float().argmax(-1)  # (S,) the chosen token's rank
        assert torch.equal(top_lps.gather(1, at[:, None]).squeeze(1), logprobs)  # bit for bit
    assert torch.equal(top_ids[:, 0], logits.argmax(-1))


def test_uniform_is_in_open_interval_and_roughly_uniform() -> None:
    u = uniform(torch.tensor([1, 2]), torch.tensor([0, 5]), 20000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_samples_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, -1)
    params = sampling_batch([1.0] * 4000, [1.0] * 4000, [0] * 4000, list(range(4000)), [0] * 4000)
    tokens, _ = sample(logits, params)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(500, -1)
    seeds = list(range(500))
    k2 = sampling_batch([1.0] * 500, [1.0] * 500, [2] * 500, seeds, [0] * 500)
    assert set(sample(logits, k2)[0].tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    top_p = float(p[0] + p[1] / 2)  # the nucleus needs tokens 0 and 1
    nucleus = sampling_batch([1.0] * 500, [top_p] * 500, [0] * 500, seeds, [0] * 500)
    assert set(sample(logits, nucleus)[0].tolist()) == {0, 1}


def test_low_temperature_concentrates_on_the_mode() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0]]).expand(300, -1)
    params = sampling_batch([0.01] * 300, [1.0] * 300, [0] * 300, list(range(300)), [0] * 300)
    assert set(sample(logits, params)[0].tolist()) == {0}


def test_seeded_sample_does_not_depend_on_batch_composition() -> None:
    gen = torch.Generator().manual_seed(1)
    mine = torch.randn(1, 100, generator=gen)
    others = torch.randn(6, 100, generator=gen)
    alone, _ = sample(mine, _params(1, seed=42, position=11))
    batch = torch.cat([others[:3], mine, others[3:]])
    seeds = [1, 2, 3, 42, 4, 5, 6]
    positions = [9, 9, 9, 11, 9, 9, 9]
    params = sampling_batch([1.0] * 7, [1.0] * 7, [0] * 7, seeds, positions)
    together, _ = sample(batch, params)
    assert int(together[3]) == int(alone[0])


def test_different_positions_draw_different_samples() -> None:
    logits = torch.zeros(1, 1000)
    draws = {int(sample(logits, _params(1, position=p))[0][0]) for p in range(50)}
    assert len(draws) > 40
    assert math.isfinite(float(sample(logits, _params(1))[1][0]))


def test_two_pass_argmax_is_the_first_maximum() -> None:
    from dsv4serve.executor.sampling import argmax_rows

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 128 * 40, generator=gen).round()  # many exact ties
    x[2, 17] = x[2, 4000] = 99.0  # the first of two equal maxima, in different chunks
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert int(argmax_rows(x)[2]) == 17


def test_a_top_k_beyond_32_bits_is_off_not_wrapped() -> None:
    """4294967301 = 2**32 + 5 used to wrap to top_k 5; any top_k >= the vocabulary means "off"."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    seeds = list(range(64))
    tokens = {
        k: sample(logits, sampling_batch([1.0] * 64, [1.0] * 64, [k] * 64, seeds, [0] * 64))[0]
        for k in (0, 5, 50, 2**32 + 5, 2**63 - 1)
    }
    assert torch.equal(tokens[2**32 + 5], tokens[0]) and torch.equal(tokens[2**63 - 1], tokens[0])
    assert torch.equal(tokens[50], tokens[0]) and not torch.equal(tokens[5], tokens[0])
