"""Triton indexer top-k against the reference: exact integer-valued inputs (so both compute identical
scores, full of exact ties), ragged steps, poisoned pools; the picks packed before their padding (what
the sparse attention walks by); and the tie rule itself."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.attention import core
from dsv4serve.attention import dsv4 as reference
from dsv4serve.backends.cuda import indexer as kt
from tests.kernel_cases import make_case, on_device

STEPS = [[(0, 9), (40, 1), (13, 6), (70, 1)], [(0, 3), (7, 1)]]


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("poison", [False, True])
def test_indexer_topk_matches_reference_with_exact_ties(steps: list, dtype: str, poison: bool) -> None:
    case = make_case(11, steps, page_size=4, dtype=dtype, poison=poison)
    torch_dtype = getattr(torch, dtype)
    T, Hi, Di = case.batch.num_tokens, case.cfg.index_n_heads, case.cfg.index_head_dim
    gen = torch.Generator().manual_seed(12)
    keys = case.buffer("c4_index", 1)
    live = ~keys.float().isnan().any(-1) & ~keys.float().isinf().any(-1)
    keys[live] = on_device(torch.randint(-1, 2, (int(live.sum()), Di), generator=gen).to(torch_dtype))
    q = on_device(torch.randint(-2, 3, (T, Hi, Di), generator=gen).to(torch_dtype))
    head_w = on_device(torch.randint(-2, 3, (T, Hi), generator=gen).float())
    ref = reference.indexer_topk(q, head_w, keys, case.ref, 5, 0.5)
    got = kt.indexer_topk(q, head_w, keys, case.fused, 5, 0.5)
    assert got.dtype == torch.int32 and got.shape == ref.shape
    assert torch.equal(got, ref)
    _assert_packed(ref.cpu(), case.batch.positions.cpu())


def _assert_packed(picks: torch.Tensor, positions: torch.Tensor) -> None:
    """The picks' contract the sparse attention walks by: each token's min(k, visible) picks are
    distinct visible entries in index order, then only padding (-1)."""
    k = picks.shape[1]
    for row, pos in zip(picks.tolist(), positions.tolist(), strict=True):
        n = min(k, (pos + 1) // 4)
        assert row[:n] == sorted(set(row[:n])) and all(0 <= e < (pos + 1) // 4 for e in row[:n])
        assert row[n:] == [-1] * (k - n)


def test_topk_rule_is_highest_first_then_lowest_index_whatever_the_width() -> None:
    scores = torch.tensor([[0.0, 2.0, -0.0, 2.0, float("-inf"), 1.0, 0.0]])
    assert core.topk_lowest_ties(scores, 4).tolist() == [[1, 3, 5, 0]]
    padded = torch.cat([scores, torch.full((1, 9), float("-inf"))], dim=1)
    assert torch.equal(core.topk_lowest_ties(padded, 4), core.topk_lowest_ties(scores, 4))
