"""MoE: routers and the reference routed-expert op."""

from __future__ import annotations

import torch

from dsv4serve.moe.experts import routed_experts_reference, swiglu
from dsv4serve.moe.routing import gating_top_k, score_fn


def _experts(num: int, hidden: int, inter: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(num, inter, hidden, generator=gen) / hidden**0.5,
        torch.randn(num, hidden, inter, generator=gen) / inter**0.5,
        torch.randn(num, inter, hidden, generator=gen) / hidden**0.5,
    )


def test_reference_experts_equal_explicit_sum() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=gen)
    w1, w2, w3 = _experts(6, 16, 8, gen)
    ids = torch.tensor([[0, 5], [1, 2], [3, 3], [4, 0], [2, 1]])
    weights = torch.rand(5, 2, generator=gen)
    got = routed_experts_reference(x, weights, ids, w1, w2, w3, 0.5)
    for t in range(5):
        want = sum(
            weights[t, k] * swiglu(x[t], w1[ids[t, k]], w2[ids[t, k]], w3[ids[t, k]], 0.5) for k in range(2)
        )
        assert torch.allclose(got[t], want, atol=1e-6)


def test_swiglu_clamps_gate_above_and_up_both_ways() -> None:
    eye = torch.eye(2)
    x = torch.tensor([[5.0, -5.0]])
    out = swiglu(x, eye, eye, eye, 1.0)  # gate = (5, -5) -> (1, -5); up = (5, -5) -> (1, -1)
    want = torch.nn.functional.silu(torch.tensor([1.0, -5.0])) * torch.tensor([1.0, -1.0])
    assert torch.allclose(out[0], want)


def test_bias_changes_selection_not_weights() -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    gate = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 100.0])  # expert 5 always chosen
    weights, ids = gating_top_k(x @ gate.T, 2, bias=bias, norm_type=2, routed_scaling_factor=2.0)
    assert (ids == 5).any(dim=1).all()
    scores = score_fn(x @ gate.T, "sqrtsoftplus").gather(1, ids.long())
    assert torch.allclose(weights, 2.0 * scores / scores.sum(-1, keepdim=True))


def test_hash_routing_uses_the_token_table() -> None:
    table = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 4]])
    _, ids = gating_top_k(
        torch.randn(3, 6),
        2,
        input_ids=torch.tensor([3, 0, 2]),
        tid2eid=table,
        norm_type=2,
        bias=torch.ones(6),
    )
    assert ids.tolist() == [[1, 4], [0, 1], [4, 5]]


def test_softmax_weights_are_not_renormalized() -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(4))
    weights, ids = gating_top_k(x, 3, norm_type=0, routed_scaling_factor=1.5)
    torch.testing.assert_close(weights, 1.5 * x.softmax(-1).gather(1, ids.long()))
