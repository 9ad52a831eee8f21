"""The Triton router against routing.gating_top_k on random logits: ragged T (0 and 1 included), hash
and top-k routing, every norm type, with and without bias, grouped (both select modes, a group count
that is not a power of two), fp32 and bf16; and forced ties, which both must break to the lower
group and expert id (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.backends.cuda.routing import gating_top_k as triton_gating_top_k
from dsv4serve.moe.routing import gating_top_k
from tests.kernel_cases import on_device

GROUPED = [{}, {"group_count": 4, "k_group": 2, "group_select_mode": 1}, {"group_count": 3, "k_group": 2}]


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.float().tolist(), strict=True)) for w, i in zip(weights, ids, strict=True)]


def _agree(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], tol: float
) -> None:
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype == torch.int32
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    for g, w in zip(_by_expert(*got), _by_expert(*want), strict=True):
        assert sorted(g) == sorted(w)
        assert all(abs(g[e] - w[e]) <= tol * max(1.0, abs(w[e])) for e in w), (g, w)


@pytest.mark.parametrize("norm_type", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 9])
def test_triton_gating_top_k_matches_reference(norm_type: int, dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator().manual_seed(3 + tokens)
    experts, k = 24, 4
    x = on_device((torch.randn(tokens, experts, generator=gen) * 2).to(dtype))
    bias = on_device(torch.randn(experts, generator=gen) * 0.3)
    tid2eid = on_device(torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(50)]))
    input_ids = on_device(torch.randint(0, 50, (tokens,), generator=gen))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    base = {"norm_type": norm_type, "routed_scaling_factor": 1.5}
    cases = [{"bias": bias, **g} for g in GROUPED] + [{}, {"input_ids": input_ids, "tid2eid": tid2eid}]
    for kw in cases:
        _agree(triton_gating_top_k(x, k, **base, **kw), gating_top_k(x, k, **base, **kw), tol)


def _tied_logits(tokens: int, experts: int, tied: int, gen: torch.Generator) -> torch.Tensor:
    """Random logits in which `tied` random experts per token share the row's highest value."""
    x = torch.randn(tokens, experts, generator=gen)
    for row in x:
        row[torch.randperm(experts, generator=gen)[:tied]] = row.max() + 1.0
    return x


@pytest.mark.parametrize("norm_type", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_ties_go_to_the_lower_expert_id(norm_type: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(norm_type)
    x = _tied_logits(16, 12, 5, gen).to(dtype)
    top = x.float() == x.float().amax(-1, keepdim=True)  # (T, E): the tied experts
    want_ids = torch.stack([row.nonzero().flatten()[:3] for row in top]).int()  # the 3 lowest ids
    bias = torch.zeros(12)
    for kw in ({}, {"bias": bias}):
        want = gating_top_k(x, 3, norm_type=norm_type, routed_scaling_factor=2.0, **kw)
        on = {name: on_device(t) for name, t in kw.items()}  # the kernel's inputs on the test device
        got = triton_gating_top_k(on_device(x), 3, norm_type=norm_type, routed_scaling_factor=2.0, **on)
        assert torch.equal(want[1], want_ids)
        assert torch.equal(got[1].cpu(), want_ids)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got[0].cpu().float(), want[0].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("select_mode", [0, 1])
def test_group_ties_go_to_the_lower_group(select_mode: int) -> None:
    gen = torch.Generator().manual_seed(select_mode)
    pattern = torch.randn(4, generator=gen) + 2.0
    x = torch.cat(
        [torch.randn(8, 4, generator=gen) - 3.0, pattern.repeat(3).expand(8, 12)], dim=1
    )  # groups 1-3 equal
    best = 4 + int(pattern.argmax())
    want_ids = torch.tensor([[best, best + 4]] * 8, dtype=torch.int32)  # from groups 1 and 2, not 3
    kw = {"group_count": 4, "k_group": 2, "group_select_mode": select_mode, "norm_type": 1}
    want = gating_top_k(x, 2, **kw)
    got = triton_gating_top_k(on_device(x), 2, **kw)
    assert torch.equal(want[1], want_ids) and torch.equal(got[1].cpu(), want_ids)
    torch.testing.assert_close(got[0].cpu(), want[0])
