"""Regression: a token of probability 0 never wins the exponential race, even where its uniform
rounds to 1.0 in float32 (it raced 0 / -log(1) = NaN, and argmax picks NaN)."""

from __future__ import annotations

import torch

from dsv4serve.executor.sampling import sample, uniform
from tests.sampling_rows import sampling_batch

VOCAB, SEED, TOP = 129280, 7, 1.0 - 2.0**-24  # TOP: the largest float32 below 1


def positions_at_the_top(num_rows: int = 256, num_chunks: int = 2) -> list[int]:
    """Positions where some token's uniform sits at TOP or above (before the fix some were 1.0)."""
    found: list[int] = []
    for chunk in range(num_chunks):
        positions = torch.arange(chunk * num_rows, (chunk + 1) * num_rows, dtype=torch.int64)
        u = uniform(torch.full((num_rows,), SEED, dtype=torch.int64), positions, VOCAB)
        found += positions[(u >= TOP).any(dim=1)].tolist()
    assert found, "no uniform at the top in the scanned positions"
    return found


def test_zero_probability_tokens_never_win() -> None:
    rows = positions_at_the_top()
    n = len(rows)
    u = uniform(torch.full((n,), SEED, dtype=torch.int64), torch.tensor(rows), VOCAB)
    assert bool((u < 1).all()) and bool((u > 0).all())
    logits = torch.full((n, VOCAB), -1e4)
    logits[:, 3] = 0.0  # token 3 holds all the probability; every other one underflows to 0
    params = sampling_batch([1.0] * n, [1.0] * n, [0] * n, [SEED] * n, rows, want_logprobs=False)
    tokens, _ = sample(logits, params)
    assert tokens.tolist() == [3] * n
