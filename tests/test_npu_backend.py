"""The npu backend on the CPU: the missing-torch_npu error, and its ops against the reference ops
through a fake `torch_npu` whose functions implement the documented semantics in plain PyTorch
(torch_npu's op-plugin docs: npu_dynamic_quant, npu_quant_matmul, npu_moe_init_routing_v2,
npu_grouped_matmul, npu_moe_token_unpermute). This checks our
wrappers' plumbing (layouts, transposes, dtypes, routing index bookkeeping), not the real kernels:
none of this has run on an Ascend NPU."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dsv4serve.backends import reference, select
from dsv4serve.backends.npu import NPU_OPS
from dsv4serve.layers.linear import Int8Weight, quantize_int8

REFERENCE = reference.backend()

# --- the fake torch_npu, written from the documented semantics ------------------------------------


def fake_dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dtype in (torch.float16, torch.bfloat16) and x.dim() > 1
    scale = x.float().abs().amax(-1) / 127.0  # rowMax(|x|) / DTYPE_MAX, fp32
    q = torch.round(x.float() / scale[..., None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def fake_quant_matmul(x1, x2, scale, *, pertoken_scale=None, output_dtype=None):
    assert x1.dtype == x2.dtype == torch.int8 and x1.dim() == x2.dim() == 2
    assert x1.shape[1] == x2.shape[0] and scale.shape == (x2.shape[1],)
    assert pertoken_scale is not None and pertoken_scale.dtype == torch.float32
    assert pertoken_scale.shape == (x1.shape[0],)
    # A2/A3 rows with a per-token scale: fp32/bf16 scale -> bf16, fp32 scale -> fp16
    allowed = {torch.bfloat16: (torch.float32, torch.bfloat16), torch.float16: (torch.float32,)}
    assert scale.dtype in allowed[output_dtype], (scale.dtype, output_dtype)
    y = (x1.double() @ x2.double()) * scale.double() * pertoken_scale.double()[:, None]
    return y.to(output_dtype)


def fake_init_routing_v2(
    x, expert_idx, *, active_num=-1, expert_num=-1, expert_tokens_num_type=0, expert_tokens_num_flag=False
):
    assert expert_idx.dtype == torch.int32 and expert_tokens_num_type == 1 and expert_tokens_num_flag
    num_tokens, top_k = expert_idx.shape
    assert active_num == num_tokens * top_k
    flat = expert_idx.flatten().long()
    order = torch.sort(flat, stable=True).indices  # flat ids t*K+k in expert order
    expanded_x = x[order // top_k]
    expanded_row_idx = torch.empty(num_tokens * top_k, dtype=torch.int32)
    expanded_row_idx[order] = torch.arange(order.numel(), dtype=torch.int32)
    counts = torch.bincount(flat, minlength=expert_num)
    return expanded_x, expanded_row_idx, counts, None


def fake_grouped_matmul(
    x, weight, *, scale=None, per_token_scale=None, group_list=None, group_list_type=0,
    group_type=-1, split_item=0, output_dtype=None,
):  # fmt: skip
    assert len(x) == len(weight) == 1 and group_type == 0 and split_item in (2, 3)
    assert group_list_type == 1 and group_list.dtype == torch.int64
    xs, w = x[0], weight[0]
    assert xs.dim() == 2 and w.dim() == 3 and w.shape[1] == xs.shape[1]
    assert int(group_list.sum()) == xs.shape[0] and group_list.shape == (w.shape[0],)
    if xs.dtype == torch.int8:
        out_dtype = output_dtype
        assert {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}[out_dtype] == scale[0].dtype
        assert per_token_scale[0].dtype == torch.float32
    else:
        out_dtype = xs.dtype if output_dtype is None else output_dtype
        assert w.dtype == xs.dtype == out_dtype and scale is None
    out, start = torch.zeros(xs.shape[0], w.shape[-1], dtype=out_dtype), 0
    for e, count in enumerate(group_list.tolist()):
        rows = xs[start : start + count]
        if xs.dtype == torch.int8:
            acc = rows.double() @ w[e].double()
            y = acc * scale[0][e].double() * per_token_scale[0][start : start + count, None].double()
        else:
            y = rows.float() @ w[e].float()
        out[start : start + count] = y.to(out_dtype)
        start += count
    return [out]


def fake_token_unpermute(permuted_tokens, sorted_indices, probs=None):
    num_tokens, top_k = probs.shape
    assert sorted_indices.dtype == torch.int32 and sorted_indices.shape == (num_tokens * top_k,)
    gathered = permuted_tokens[sorted_indices.long()].view(num_tokens, top_k, -1)  # (T, K, H)
    return (gathered.float() * probs.float()[..., None]).sum(1).to(permuted_tokens.dtype)


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Install the fake torch_npu; returns how often each op was called."""
    calls: dict[str, int] = dict.fromkeys(NPU_OPS, 0)
    impls = {
        "npu_dynamic_quant": fake_dynamic_quant,
        "npu_quant_matmul": fake_quant_matmul,
        "npu_moe_init_routing_v2": fake_init_routing_v2,
        "npu_grouped_matmul": fake_grouped_matmul,
        "npu_moe_token_unpermute": fake_token_unpermute,
    }
    module = types.ModuleType("torch_npu")
    for name, fn in impls.items():

        def counted(*args, _name=name, _fn=fn, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        setattr(module, name, counted)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return calls


# --- import guard ------------------------------------------------------------------------------


def test_npu_backend_without_torch_npu_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    with pytest.raises(RuntimeError, match=r"pip install 'dsv4serve\[npu\]'"):
        select("npu")


def test_npu_backend_names_missing_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    with pytest.raises(RuntimeError, match="npu_quant_matmul"):
        select("npu:0")


def test_cpu_backend_does_not_import_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert select("cpu").linear is REFERENCE.linear


# --- linear ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_is_exact_on_integer_inputs(fake_npu: dict[str, int], dtype: torch.dtype) -> None:
    """int8-valued weights and activations with a 127 in every row: all scales are 1."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (24, 40), generator=gen).float()
    w[:, 3] = 127.0
    x = torch.randint(-127, 128, (2, 5, 40), generator=gen).float()
    x[..., 7] = -127.0
    qw, xd = quantize_int8(w), x.to(dtype)
    got = select("npu").linear(xd, qw)
    assert got.dtype == dtype and got.shape == (2, 5, 24)
    assert torch.equal(got, REFERENCE.linear(xd, qw))
    assert fake_npu["npu_quant_matmul"] == 1 and fake_npu["npu_dynamic_quant"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_matches_the_reference_on_random_inputs(
    fake_npu: dict[str, int], dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    ops = select("npu")
    for tokens, d_in, d_out in ((1, 64, 32), (17, 256, 96), (3, 96, 200)):
        x = torch.randn(tokens, d_in, generator=gen).to(dtype)
        qw = quantize_int8(torch.randn(d_out, d_in, generator=gen))
        ref = REFERENCE.linear(x, qw).float()
        got = ops.linear(x, qw).float()
        assert got.dtype == ref.dtype and float((got - ref).abs().max() / ref.abs().max()) < 1e-2
    assert fake_npu["npu_quant_matmul"] == 3


def test_fp32_and_float_weights_take_the_reference(fake_npu: dict[str, int]) -> None:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 32, generator=gen), torch.randn(16, 32, generator=gen)
    ops = select("npu")
    assert torch.equal(ops.linear(x, quantize_int8(w)), REFERENCE.linear(x, quantize_int8(w)))
    assert torch.equal(ops.linear(x, w), REFERENCE.linear(x, w))
    assert fake_npu["npu_quant_matmul"] == 0


# --- routed experts ----------------------------------------------------------------------------


def _moe_inputs(seed: int, tokens: int, experts: int = 6, top_k: int = 3, hidden: int = 32, inter: int = 24):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])  # (T, k)
    weights = torch.rand(tokens, top_k, generator=gen)
    w1 = torch.randn(experts, inter, hidden, generator=gen) / hidden**0.5
    w3 = torch.randn(experts, inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return x, weights, ids, w1, w2, w3


@pytest.mark.parametrize("tokens", [1, 5, 40, 100])
@pytest.mark.parametrize("stacked", [False, True])
def test_float_routed_experts_match_the_reference_in_fp32(
    fake_npu: dict[str, int], tokens: int, stacked: bool
) -> None:
    """Gate and up as two grouped GEMMs, or as one over a stacked [W1; W3] (the loaders' layout)."""
    x, weights, ids, w1, w2, w3 = _moe_inputs(tokens, tokens)
    if stacked:
        w13 = torch.cat([w1, w3], dim=1)
        w1, w3 = w13[:, : w1.shape[1]], w13[:, w1.shape[1] :]
    ref = REFERENCE.routed_experts(x, weights, ids, w1, w2, w3, 0.5)  # low limit: the clamp bites
    got = select("npu").routed_experts(x, weights, ids, w1, w2, w3, 0.5)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert fake_npu["npu_grouped_matmul"] == (2 if stacked else 3)
    assert fake_npu["npu_moe_token_unpermute"] == 1


def test_routed_experts_with_unused_experts_and_int64_ids(fake_npu: dict[str, int]) -> None:
    x, weights, ids, w1, w2, w3 = _moe_inputs(7, 9, experts=16, top_k=2)
    ids = ids % 5  # experts 5..15 get no tokens; (T, k) may repeat an expert per token
    ref = REFERENCE.routed_experts(x, weights, ids, w1, w2, w3, 10.0)
    got = select("npu").routed_experts(x, weights, ids, w1, w2, w3, 10.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_routed_experts_match_the_reference(fake_npu: dict[str, int], dtype: torch.dtype) -> None:
    x, weights, ids, w1, w2, w3 = _moe_inputs(3, 20)
    x, weights = x.to(dtype), weights.to(dtype)
    q1, q2, q3 = quantize_int8(w1), quantize_int8(w2), quantize_int8(w3)
    ref = REFERENCE.routed_experts(x, weights, ids, q1, q2, q3, 1.0).float()
    got = select("npu").routed_experts(x, weights, ids, q1, q2, q3, 1.0)
    assert got.dtype == dtype
    assert float((got.float() - ref).abs().max() / ref.abs().max()) < 3e-2
    assert fake_npu["npu_dynamic_quant"] == 2 and fake_npu["npu_grouped_matmul"] == 3


def test_int8_experts_with_fp32_activations_take_the_fallback(fake_npu: dict[str, int]) -> None:
    x, weights, ids, w1, w2, w3 = _moe_inputs(4, 6)
    q1, q2, q3 = quantize_int8(w1), quantize_int8(w2), quantize_int8(w3)
    ref = REFERENCE.routed_experts(x, weights, ids, q1, q2, q3, 1.0)
    got = select("npu").routed_experts(x, weights, ids, q1, q2, q3, 1.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert fake_npu["npu_grouped_matmul"] == 0 and isinstance(q1[0], Int8Weight)
