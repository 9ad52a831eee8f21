"""Triton router against routing.route: the same experts and weights per token, top-k and hash
routing, every score function, fp32 and bf16 (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4serve.moe.routing import route
from dsv4serve.moe.routing_triton import route as triton_route
from tests.kernel_cases import on_device


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.float().tolist(), strict=True)) for w, i in zip(weights, ids, strict=True)]


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hashed", [False, True])
def test_triton_route_matches_reference(scoring: str, dtype: torch.dtype, hashed: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, hidden, experts, k = 9, 32, 24, 6
    x = on_device((torch.randn(tokens, hidden, generator=gen) * 2).to(dtype))
    gate = on_device((torch.randn(experts, hidden, generator=gen) / 2).to(dtype))
    bias = on_device(torch.randn(experts, generator=gen) * 0.3)
    tid2eid = on_device(torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(50)]))
    input_ids = on_device(torch.randint(0, 50, (tokens,), generator=gen))
    kw = {"top_k": k, "scoring": scoring, "scaling": 1.5, "bias": bias}
    if hashed:
        kw |= {"tid2eid": tid2eid, "input_ids": input_ids}
    want = _by_expert(*route(x, gate, **kw))
    got = _by_expert(*triton_route(x, gate, linear=F.linear, **kw))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w)
        assert all(abs(g[e] - w[e]) <= tol * max(1.0, abs(w[e])) for e in w), (g, w)
