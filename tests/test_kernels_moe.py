"""Triton routed experts (grouped GEMM over the chosen experts only) against the reference: float,
int8 and MXFP4 (packed, decoded in registers), decode-sized and prefill-sized batches, experts with no
tokens, an expert twice for one token's slots never (top-k ids are distinct) but many tokens on one
expert; int32 ids, as the router gives them (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4serve.backends.cuda import experts as kt
from dsv4serve.backends.cuda.experts import align, align_torch, grouped_mm_experts, routed_experts
from dsv4serve.backends.cuda.triton_utils import ptx_enabled
from dsv4serve.layers.formats import dequantize_mxfp4
from dsv4serve.layers.linear import Mxfp4Weight, quantize_int8
from dsv4serve.moe.experts import gate_up_view, routed_experts_reference, swiglu
from dsv4serve.moe.routing import gating_top_k
from tests.kernel_cases import on_device


def _inputs(tokens: int, experts: int, top_k: int, seed: int, skew: bool = False) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 48, 40
    x = torch.randn(tokens, hidden, generator=gen)
    gate = torch.randn(experts, hidden, generator=gen)
    bias = torch.randn(experts, generator=gen) * (4.0 if skew else 0.1)  # skew: a few hot experts
    weights, ids = gating_top_k(x @ gate.T, top_k, bias=bias, norm_type=2, routed_scaling_factor=1.5)
    w1 = torch.randn(experts, inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    w3 = torch.randn(experts, inter, hidden, generator=gen) / hidden**0.5
    return tuple(on_device(t) for t in (x, weights, ids, w1, w2, w3))


def test_align_puts_every_pair_once_in_a_block_of_its_expert() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]])
    pairs, block_expert = (t.cpu() for t in align(on_device(ids), 8, 4))
    flat = ids.reshape(-1)
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        for p in pairs[b * 4 : (b + 1) * 4].tolist():
            if p < flat.numel():
                assert e < 8 and flat[p] == e
                seen.append(p)
    assert sorted(seen) == list(range(flat.numel()))
    assert pairs[:4].tolist() == [1, 4, 8, 8]  # expert 0: pairs in token order, then padding


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m"), [(1, 256, 6, 16), (64, 256, 6, 16), (37, 8, 3, 4)]
)
@pytest.mark.parametrize("shared", [False, True])
def test_one_program_align_equals_the_torch_align(
    tokens: int, experts: int, top_k: int, block_m: int, shared: bool
) -> None:
    """shared: the one-program align appends each token's shared pair (expert E) itself; the torch
    align gets it concatenated."""
    gen = torch.Generator().manual_seed(tokens)
    ids = on_device(torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]))
    full = torch.cat([ids, torch.full_like(ids[:, :1], experts)], dim=1) if shared else ids
    flat = full.reshape(-1)
    bins = experts + shared
    max_blocks = -(-flat.numel() // block_m) + min(flat.numel(), bins)
    got = align(ids, bins, block_m, shared=shared)
    want = align_torch(flat, bins, block_m, max_blocks)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "skew"), [(1, 8, 2, False), (9, 16, 4, True), (1030, 8, 2, True)]
)
def test_float_experts_match_reference(tokens: int, experts: int, top_k: int, skew: bool) -> None:
    x, weights, ids, w1, w2, w3 = _inputs(tokens, experts, top_k, tokens, skew)
    want = routed_experts_reference(x, weights, ids, w1, w2, w3, 1.0)
    got = routed_experts(x, weights, ids, w1, w2, w3, 1.0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_bf16_experts_close_to_reference() -> None:
    x, weights, ids, w1, w2, w3 = _inputs(11, 8, 2, 5)
    b = [t.bfloat16() for t in (x, weights, w1, w2, w3)]
    want = routed_experts_reference(x, weights, ids, w1, w2, w3, 1.0)
    got = routed_experts(b[0], b[1], ids, b[2], b[3], b[4], 1.0).float()
    assert float((got - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize("tokens", [3, 40])
def test_int8_experts_match_reference(tokens: int) -> None:
    x, weights, ids, w1, w2, w3 = _inputs(tokens, 8, 2, 7)
    q1, q2, q3 = quantize_int8(w1), quantize_int8(w2), quantize_int8(w3)
    want = routed_experts_reference(x, weights, ids, q1, q2, q3, 1.0)
    got = routed_experts(x, weights, ids, q1, q2, q3, 1.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def random_mxfp4(shape: tuple[int, ...], gen: torch.Generator) -> Mxfp4Weight:
    """Random packed e2m1 pairs and ue8m0 scales around 2^-(log2 sqrt(in) + 2): values ~ 1/sqrt(in)."""
    *lead, out, inner = shape
    centre = 127 - round(inner**0.5).bit_length() - 1
    packed = torch.randint(0, 256, (*lead, out, inner // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(centre - 1, centre + 2, (*lead, out, inner // 32), generator=gen).to(torch.uint8)
    return Mxfp4Weight(on_device(packed), on_device(scale))


@triton.jit
def _fp4_halves_kernel(packed_ptr, scale_ptr, even_ptr, odd_ptr, PTX: tl.constexpr):
    n = tl.arange(0, 8)  # 8 rows of two 32-blocks
    even, odd = kt._fp4_halves(packed_ptr + n * 32, scale_ptr + n * 2, n < 8, 0, 64, 2, PTX)
    out = n[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(even_ptr + out, even)
    tl.store(odd_ptr + out, odd)


def test_fp4_decode_is_exact() -> None:
    """Every byte (two e2m1 weights) under scales from 2^-126 to 2^127 decodes to the reference's bf16
    bit for bit (signed zeros, bf16 subnormals and overflow to inf included): on a GPU the PTX path,
    under the interpreter its plain-Triton twin."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    raw = torch.tensor([1, 2, 60, 100, 120, 126, 127, 128, 130, 150, 200, 250, 251, 252, 253, 254])
    packed, raw = packed.view(8, 32), raw.view(8, 2)  # two blocks a row, each its own scale
    want = dequantize_mxfp4(packed, raw.to(torch.uint8), torch.bfloat16)  # (8, 64)
    even, odd = (on_device(torch.empty(8, 32, dtype=torch.bfloat16)) for _ in range(2))
    p, r = on_device(packed), on_device(raw.to(torch.uint8))
    _fp4_halves_kernel[(1,)](p, r, even, odd, PTX=ptx_enabled(p.device))
    for got, ref in ((even, want[:, 0::2]), (odd, want[:, 1::2])):
        assert torch.equal(got.cpu().view(torch.int16), ref.contiguous().view(torch.int16))


def test_fp4_dequantize_kernel_is_exact() -> None:
    """The prefill path's MXFP4 -> bf16 kernel (stacked experts, in-features not a multiple of its 128
    columns, rows not of its 64) equals the reference's decoding bit for bit."""
    gen = torch.Generator().manual_seed(11)
    w = random_mxfp4((3, 70, 96), gen)
    want = w.to("cpu").dequantized(torch.bfloat16).view(torch.int16)
    assert torch.equal(kt.dequantize_fp4(w).cpu().view(torch.int16), want)
    stack = on_device(torch.zeros(3, 140, 96, dtype=torch.bfloat16))  # into the second half of a stack
    kt.dequantize_fp4(w, stack[:, 70:])
    assert torch.equal(stack[:, 70:].cpu().view(torch.int16), want) and not stack[:, :70].float().any()


@pytest.mark.parametrize(
    ("tokens", "dtype", "shared"),
    [
        (1, torch.float32, False),
        (9, torch.float32, True),
        (5, torch.bfloat16, False),
        (1100, torch.float32, True),
        (1100, torch.bfloat16, True),
    ],
)
def test_mxfp4_experts_match_reference(tokens: int, dtype: torch.dtype, shared: bool) -> None:
    """Packed experts (hidden 96: not a multiple of the 128-wide K tile; inter 64), the reference
    decoding them per call: the same function as the float experts of the decoded values. 1100 tokens
    x 2 slots: the prefill tiles (bf16 on a GPU: decoded to bf16, then torch._grouped_mm). With a
    float shared expert (computed on its own, then added)."""
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter = 8, 96, 64
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = gating_top_k(x @ torch.randn(experts, hidden, generator=gen).T, 2, norm_type=2)
    w1, w3 = (random_mxfp4((experts, inter, hidden), gen) for _ in range(2))
    w2 = random_mxfp4((experts, hidden, inter), gen)
    extra = tuple(on_device(torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(dtype)
                  for s in ((inter, hidden), (hidden, inter), (inter, hidden)))  # fmt: skip
    x, weights, ids = on_device(x.to(dtype)), on_device(weights.to(dtype)), on_device(ids)
    want = routed_experts_reference(x, weights, ids, w1, w2, w3, 1.0, extra if shared else None)
    got = routed_experts(x, weights, ids, w1, w2, w3, 1.0, extra if shared else None)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 2e-2


def test_experts_as_views_of_a_stacked_gate_up_weight() -> None:
    """transformers stores [W1; W3] as one (E, 2I, hidden) tensor: w1 / w3 are strided views of it."""
    x, weights, ids, w1, w2, w3 = _inputs(5, 8, 2, 9)
    gate_up = torch.cat([w1, w3], dim=1)
    inter = w1.shape[1]
    want = routed_experts_reference(x, weights, ids, w1, w2, w3, 1.0)
    got = routed_experts(x, weights, ids, gate_up[:, :inter], w2, gate_up[:, inter:], 1.0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("int8", [False, True])
def test_shared_expert_rides_along_as_one_more_expert(int8: bool) -> None:
    x, weights, ids, w1, w2, w3 = _inputs(6, 8, 2, 11)
    gen = torch.Generator().manual_seed(12)
    shared = tuple(
        on_device(torch.randn(w.shape[1:], generator=gen) / w.shape[-1] ** 0.5) for w in (w1, w2, w3)
    )
    if int8:
        w1, w2, w3 = (quantize_int8(w) for w in (w1, w2, w3))
        shared = tuple(quantize_int8(w) for w in shared)
    want = routed_experts_reference(x, weights, ids, w1, w2, w3, 1.0, shared)  # type: ignore[arg-type]
    got = routed_experts(x, weights, ids, w1, w2, w3, 1.0, shared)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused_tail", [False, True])
def test_fp8_shared_expert_runs_beside_float_routed_ones(
    fused_tail: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An official FP8 shared expert (kept as e4m3 blocks) with float routed experts: not fused into the
    routed kernels (another format), run through the FP8 linear, added: the reference's result.
    FUSED_SHARED_TAIL: its SwiGLU as one kernel and its output added in the routed slot sum, rounded as
    `routed + shared` (bf16: bit for bit the sum of the two computed apart)."""
    from dsv4serve.layers.formats import quantize_fp8_block
    from dsv4serve.layers.linear import Fp8BlockWeight

    monkeypatch.setattr(kt, "FUSED_SHARED_TAIL", fused_tail)
    x, weights, ids, w1, w2, w3 = _inputs(6, 8, 2, 21)
    gen = torch.Generator().manual_seed(22)
    shared = []
    for w in (w1, w2, w3):
        q, s = quantize_fp8_block(torch.randn(w.shape[1:], generator=gen) / w.shape[-1] ** 0.5)
        shared.append(Fp8BlockWeight(on_device(q), on_device(torch.exp2(s.float() - 127))))
    want = routed_experts_reference(x, weights, ids, w1, w2, w3, 1.0, tuple(shared))  # type: ignore[arg-type]
    got = routed_experts(x, weights, ids, w1, w2, w3, 1.0, tuple(shared))  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    x, weights, ids, w1, w2, w3 = _inputs(200, 8, 2, 23)  # bf16: enough sums to catch a missed rounding
    xb, wb = x.bfloat16(), weights.bfloat16()
    w1b, w2b, w3b = (w.bfloat16() for w in (w1, w2, w3))
    routed = routed_experts(xb, wb, ids, w1b, w2b, w3b, 1.0)
    own = kt.linear(kt._swiglu_rows(kt.linear(xb, shared[0]), kt.linear(xb, shared[2]), 1.0), shared[1])
    if fused_tail:  # the slot sum adds the shared output as torch's bf16 `+` would
        got = routed_experts(xb, wb, ids, w1b, w2b, w3b, 1.0, tuple(shared))  # type: ignore[arg-type]
        assert torch.equal(got, routed + own) and not torch.equal(got, routed)


def test_bf16_prefill_sized_experts_close_to_reference() -> None:
    """More than 2048 pairs: the prefill tiles (and on CUDA, torch._grouped_mm), shared expert added."""
    x, weights, ids, w1, w2, w3 = _inputs(1100, 8, 2, 13)
    shared = (w1[0], w2[0], w3[0])
    want = routed_experts_reference(x, weights, ids, w1, w2, w3, 1.0, shared)
    b = [t.bfloat16() for t in (x, weights, w1, w2, w3)]
    got = routed_experts(b[0], b[1], ids, b[2], b[3], b[4], 1.0, (b[2][0], b[3][0], b[4][0])).float()
    assert float((got - want).norm() / want.norm()) < 2e-2


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("with_shared", [False, True])
@pytest.mark.parametrize("stacked", [False, True])
def test_grouped_mm_experts_equal_the_torch_formulation(with_shared: bool, stacked: bool) -> None:
    """The prefill path's fused SwiGLU and weighted un-permute (and the shared expert's output added in
    the same kernel) against the same math as separate torch ops over the same GEMMs (bf16), and close
    to the fp32 reference; gate and up as two GEMMs, or as one over a stacked [W1; W3] weight."""
    x, weights, ids, w1, w2, w3 = _inputs(300, 8, 3, 21)
    gen = torch.Generator().manual_seed(22)
    shared = tuple(
        on_device(torch.randn(w.shape[1:], generator=gen) / w.shape[-1] ** 0.5) for w in (w1, w2, w3)
    )
    b = [t.bfloat16() for t in (x, w1, w2, w3)]
    if stacked:
        w13 = torch.cat([b[1], b[3]], dim=1)
        b[1], b[3] = w13[:, : w1.shape[1]], w13[:, w1.shape[1] :]
    assert (gate_up_view(b[1], b[3]) is not None) == stacked
    bs = tuple(t.bfloat16() for t in shared) if with_shared else None
    got = grouped_mm_experts(b[0], weights, ids, b[1], b[2], b[3], 0.8, bs)
    order = torch.sort(ids.reshape(-1), stable=True).indices
    offs = torch.cumsum(torch.bincount(ids.reshape(-1), minlength=8), 0).to(torch.int32)
    rows = b[0][order // 3]
    gate = torch._grouped_mm(rows, b[1].transpose(1, 2), offs=offs).clamp(max=0.8)
    up = torch._grouped_mm(rows, b[3].transpose(1, 2), offs=offs).clamp(min=-0.8, max=0.8)
    y = torch._grouped_mm(F.silu(gate) * up, b[2].transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order, None].bfloat16()
    by_pair = torch.empty_like(y)
    by_pair[order] = y
    want = by_pair.view(300, 3, -1).float().sum(1).bfloat16()
    if bs is not None:
        want = want + swiglu(b[0], *bs, limit=0.8)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=3.2e-2)  # an ulp of h (exp) may move a value
    assert float((got != want).float().mean()) < 0.01  # the same rounding: nearly every value bitwise
    ref = routed_experts_reference(x, weights, ids, w1, w2, w3, 0.8, shared if with_shared else None)
    assert float((got.float() - ref).norm() / ref.norm()) < 2e-2


def test_gate_up_view_only_for_w3_right_after_w1() -> None:
    w13 = torch.randn(4, 10, 6)
    w1, w3 = w13[:, :5], w13[:, 5:]
    view = gate_up_view(w1, w3)
    assert view is not None and torch.equal(view, w13)
    assert gate_up_view(w3, w1) is None  # w1 after w3
    assert gate_up_view(w1, w3.clone()) is None  # apart
    assert gate_up_view(w13[:, :4], w13[:, 5:9]) is None  # a gap between them
    other = torch.randn(4, 10, 6)
    assert gate_up_view(w1, other[:, 5:]) is None  # the same strides, another buffer


def _expert_weights(fmt: str, experts: int, hidden: int, inter: int, gen: torch.Generator) -> tuple:
    """Random w1, w2, w3 stacks: MXFP4 packed, int8 (W8A8) or float (any other `fmt`)."""
    if fmt == "mxfp4":
        w1, w3 = (random_mxfp4((experts, inter, hidden), gen) for _ in range(2))
        return w1, random_mxfp4((experts, hidden, inter), gen), w3
    floats = tuple(
        on_device(torch.randn(experts, *s, generator=gen) / s[-1] ** 0.5)
        for s in ((inter, hidden), (hidden, inter), (inter, hidden))
    )
    return tuple(quantize_int8(w) for w in floats) if fmt == "int8" else floats


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("fmt", ["float", "int8", "mxfp4", "shared"])
def test_decode_experts_summed_in_k_slices_match_reference(
    fmt: str, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode kernels' K loops summed in slices (gate/up 3, down 2: the last slice shorter, hidden
    224 not a multiple of the float K tile), one program taking every slice or one a slice (partials
    summed by each tile's last program; int8 always splits): the reference's result, with experts of
    no pairs in the grid."""
    monkeypatch.setattr(kt, "DECODE_SLICES", {"float": (3, 2), "int8": (3, 2), "mxfp4": (3, 2)})
    monkeypatch.setattr(kt, "SPLIT_BELOW", 1 << 30 if split else 0)
    gen = torch.Generator().manual_seed(31)
    experts, hidden, inter, tokens = 8, 224, 160, 5
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = gating_top_k(x @ torch.randn(experts, hidden, generator=gen).T, 2, norm_type=2)
    w1, w2, w3 = _expert_weights(fmt, experts, hidden, inter, gen)
    shared = tuple(w[experts - 1] for w in (w1, w2, w3)) if fmt == "shared" else None  # type: ignore[index]
    x, weights, ids = on_device(x), on_device(weights), on_device(ids)
    block_k = kt._tiles(tokens * 3, True, fmt == "int8", fmt == "mxfp4")[2]
    assert kt._slices(hidden, block_k, 3)[0] == 3 and kt._slices(inter, block_k, 2)[0] == 2
    want = routed_experts_reference(x, weights, ids, w1, w2, w3, 1.0, shared)  # type: ignore[arg-type]
    got = routed_experts(x, weights, ids, w1, w2, w3, 1.0, shared)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["float", "mxfp4"])
def test_a_token_gets_the_same_bits_whether_its_slices_split_or_not(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slices are a function of the weights' shape; whether programs split them depends on the
    step: a token alone (split) and among others (one program per tile) gets the same bits (fp32,
    where a changed order of the sums shows: 256-deep K loops, four slices of the 32-wide tile)."""
    gen = torch.Generator().manual_seed(41)
    experts, hidden, inter, tokens = 4, 256, 256, 6
    x = on_device(torch.randn(tokens, hidden, generator=gen))
    weights, ids = gating_top_k(x @ on_device(torch.randn(experts, hidden, generator=gen)).T, 2)
    w1, w2, w3 = _expert_weights(fmt, experts, hidden, inter, gen)
    monkeypatch.setattr(kt, "DECODE_SLICES", {"float": (4, 4), "mxfp4": (4, 4), "int8": (1, 1)})
    assert kt._slices(hidden, kt._tiles(tokens * 2, True, False, fmt == "mxfp4")[2], 4)[0] == 4
    monkeypatch.setattr(kt, "SPLIT_BELOW", 1 << 30)
    alone = routed_experts(x[3:4], weights[3:4], ids[3:4], w1, w2, w3, 1.0)  # type: ignore[arg-type]
    split = routed_experts(x, weights, ids, w1, w2, w3, 1.0)  # type: ignore[arg-type]
    monkeypatch.setattr(kt, "SPLIT_BELOW", 0)
    whole = routed_experts(x, weights, ids, w1, w2, w3, 1.0)  # type: ignore[arg-type]
    assert torch.equal(alone[0], whole[3]) and torch.equal(split, whole)


def test_prefill_workspace_is_one_layers_experts_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend reserves, beside the KV, what a prefill-sized step decodes at once: one layer's
    three MXFP4 stacks in bf16 (the largest stack, thrice); nothing without MXFP4 experts."""
    gen = torch.Generator().manual_seed(3)
    weights = {
        "layers.0.ffn.experts.w1": random_mxfp4((4, 64, 96), gen),
        "layers.0.ffn.experts.w2": random_mxfp4((4, 96, 64), gen),
        "layers.0.attn.wq": torch.zeros(8, 8),
    }
    assert kt.prefill_workspace(weights) == 3 * 2 * 4 * 64 * 96
    assert kt.prefill_workspace({"w": torch.zeros(4, 64, 96)}) == 0
    monkeypatch.setattr(kt, "FP4_PREFILL_DEQUANTIZED", False)
    assert kt.prefill_workspace(weights) == 0
