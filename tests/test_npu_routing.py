"""The npu backend's router through a fake `torch_npu.npu_moe_gating_top_k` written from the documented
reference (op-plugin doc torch_npu-npu_moe_gating_top_k.md): the wrapper's plumbing and its fallbacks, not the
real kernel (never run on an Ascend NPU)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from dsv4serve.backends.npu.routing import npu_gating_top_k
from dsv4serve.moe.routing import gating_top_k


def fake_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                      group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                      eps=1e-20):  # fmt: skip
    assert x.dim() == 2 and renorm == 0 and x.shape[1] % group_count == 0 and x.shape[1] // group_count > 2
    assert bias is None or bias.dtype == x.dtype
    xf = x.float()
    s = {0: lambda v: v.softmax(-1), 1: torch.sigmoid, 2: lambda v: F.softplus(v).sqrt()}[norm_type](xf)
    sel = s if bias is None else s + bias.float()
    t, e = s.shape
    if input_ids is not None and tid2eid is not None:
        idx = tid2eid[input_ids.long()].long()
    else:
        if group_count > 1:
            g = sel.view(t, group_count, -1)
            gs = g.amax(-1) if group_select_mode == 0 else g.topk(2, -1).values.sum(-1)
            keep = torch.sort(-gs, dim=-1, stable=True).indices[:, :k_group]
            gmask = torch.zeros(t, group_count, dtype=torch.bool).scatter_(1, keep, True)
            sel = sel.masked_fill(~gmask.repeat_interleave(e // group_count, 1), float("-inf"))
        idx = torch.sort(-sel, dim=-1, stable=True).indices[:, :k]
    w = s.gather(1, idx)
    if norm_type in (1, 2):
        w = w / (w.sum(-1, keepdim=True) + eps)
    return (w * routed_scaling_factor).to(x.dtype), idx.int(), s


@pytest.mark.parametrize(
    ("experts", "options"),
    [
        (
            16,
            {
                "k_group": 2,
                "group_count": 4,
                "group_select_mode": 1,
                "norm_type": 1,
                "routed_scaling_factor": 1.8,
            },
        ),
        (12, {"norm_type": 2, "routed_scaling_factor": 1.5}),
        (
            8,
            {"k_group": 1, "group_count": 4, "norm_type": 1},
        ),  # 2 experts per group: the op refuses, fallback
    ],
)
def test_npu_router_matches_the_reference(experts: int, options: dict) -> None:
    calls = []
    npu = types.SimpleNamespace(
        npu_moe_gating_top_k=lambda *a, **kw: calls.append(1) or fake_gating_top_k(*a, **kw)
    )
    gen = torch.Generator().manual_seed(experts)
    x = torch.randn(30, experts, generator=gen)
    bias = torch.randn(experts, generator=gen) * 0.3
    want = gating_top_k(x, 3, bias=bias, **options)
    got = npu_gating_top_k(x, 3, npu=npu, fallback=gating_top_k, bias=bias, **options)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
    assert len(calls) == (0 if experts == 8 else 1)


def test_npu_router_without_the_op_takes_the_reference() -> None:
    x = torch.randn(5, 16)
    got = npu_gating_top_k(x, 2, npu=types.SimpleNamespace(), fallback=gating_top_k, norm_type=1)
    want = gating_top_k(x, 2, norm_type=1)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_npu_router_leaves_unset_options_out_for_older_builds() -> None:
    """DSV4's top-k layers pass input_ids=None, tid2eid=None; an op without those keywords still runs."""

    def older_op(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                 out_flag=False, routed_scaling_factor=1.0, eps=1e-20):  # fmt: skip
        return fake_gating_top_k(
            x, k, bias=bias, norm_type=norm_type, routed_scaling_factor=routed_scaling_factor
        )

    x, bias = torch.randn(7, 12), torch.randn(12)
    options = {"bias": bias, "input_ids": None, "tid2eid": None, "norm_type": 2, "routed_scaling_factor": 1.5}
    got = npu_gating_top_k(
        x, 3, npu=types.SimpleNamespace(npu_moe_gating_top_k=older_op), fallback=gating_top_k, **options
    )
    want = gating_top_k(x, 3, **options)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
