"""Triton sparse attention against the reference on random ragged steps: windows that cross pages,
prefill chunks mixed with decodes, CSA picks with padding (-1), HCA, SWA-only layers, and pools
poisoned with NaN / inf wherever no correct read goes (interpreter on CPU). Both paths: one program
per (token, heads), and the keys split over programs with a combine (the decode path)."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.attention import dsv4 as reference
from dsv4serve.backends.cuda import sparse as kt
from tests.kernel_cases import Case, kernel_model, make_case, on_device, pool_of

STEPS = [
    [(0, 9), (20, 1), (3, 5), (47, 1)],  # chunks after a cached prefix, decodes, windows crossing pages
    [(0, 1), (0, 2), (63, 1)],  # tiny requests: windows shorter than W, no compressed entry yet
    [(300, 1), (150, 2), (5, 1)],  # long contexts: several compressed chunks per token when split
]


def _indices(case: Case, gen: torch.Generator, topk: int) -> torch.Tensor:
    """Random distinct visible entries per token, padded with -1 (as the indexer returns them)."""
    J = case.batch.max_seq_len // 4
    T = case.batch.num_tokens
    out = torch.full((T, min(topk, J)), -1, dtype=torch.int32)
    for t, pos in enumerate(case.batch.positions.tolist()):
        visible = (pos + 1) // 4
        chosen = torch.randperm(visible, generator=gen)[: out.shape[1]]
        out[t, : chosen.numel()] = chosen.int()
    return on_device(out)


@pytest.fixture(params=["split", "whole"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which kernel path every step takes: keys split over programs (small steps) or not."""
    monkeypatch.setattr(kt, "SPLIT_TOKENS", 1 << 20 if request.param == "split" else 0)
    monkeypatch.setattr(kt, "SPLIT_CONFIG", kt.AttentionConfig(block_n=16, split=16))  # several splits
    return str(request.param)


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("ratio", [0, 4, 16])
@pytest.mark.parametrize("poison", [False, True])
def test_sparse_attention_matches_reference(steps: list, ratio: int, poison: bool, path: str) -> None:
    _check_fp32(make_case(5, steps, page_size=4, poison=poison), ratio, topk=40, seed=6)


def _check_fp32(case: Case, ratio: int, topk: int, seed: int) -> None:
    """The kernel against the reference on one layer of `case` (random fp32 queries and sinks; at
    ratio 4, `topk` random picks per token)."""
    layer = case.cfg.compress_ratios.index(ratio)
    T, H, D = case.batch.num_tokens, case.cfg.num_heads, case.cfg.head_dim
    gen = torch.Generator().manual_seed(seed)
    q = on_device(torch.randn(T, H, D, generator=gen))
    sinks = on_device(torch.randn(H, generator=gen))
    swa = case.buffer("swa", layer)
    cmp = case.buffer(pool_of(ratio), layer) if ratio else None
    idx = _indices(case, gen, topk) if ratio == 4 else None
    ref = reference.sparse_attention(q, swa, cmp, idx, case.ref, sinks, D**-0.5, ratio)
    got = kt.sparse_attention(q, swa, cmp, idx, case.fused, sinks, D**-0.5, ratio)
    assert not ref.isnan().any()
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_sparse_attention_bf16_close_to_fp32_reference(path: str) -> None:
    case = make_case(7, STEPS[0], page_size=8, dtype="bfloat16")
    T, H, D = case.batch.num_tokens, case.cfg.num_heads, case.cfg.head_dim
    gen = torch.Generator().manual_seed(8)
    q = on_device(torch.randn(T, H, D, generator=gen).bfloat16())
    sinks = on_device(torch.randn(H, generator=gen))
    swa, cmp = case.buffer("swa", 1), case.buffer("c4", 1)
    idx = _indices(case, gen, 5)
    ref = reference.sparse_attention(q.float(), swa.float(), cmp.float(), idx, case.ref, sinks, D**-0.5, 4)
    got = kt.sparse_attention(q, swa, cmp, idx, case.fused, sinks, D**-0.5, 4)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("ratio", [0, 4, 16])
@pytest.mark.parametrize("split", [False, True])
def test_sparse_attention_slot_blocks_of_several_tiles(
    head_dim: int, ratio: int, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window of 40 keys in 16-key tiles, each walk gathering the slots of a block of tiles at once:
    4 tiles per block whole, 2 per 32-key split, the last tile of a block part-filled, a token's 70
    picks over two blocks. head_dim 48 leaves the epilogue's tile wider than the head."""
    monkeypatch.setattr(kt, "SPLIT_TOKENS", 1 << 20 if split else 0)
    monkeypatch.setattr(kt, "SPLIT_CONFIG", kt.AttentionConfig(block_n=16, split=32))
    monkeypatch.setattr(kt, "CONFIG", kt.AttentionConfig(block_n=16))
    cfg = kernel_model(sliding_window=40, head_dim=head_dim)
    case = make_case(9, [(0, 9), (300, 1), (150, 2), (61, 3)], page_size=4, poison=True, cfg=cfg)
    _check_fp32(case, ratio, topk=70, seed=10)


@pytest.mark.parametrize("ratio", [4, 16])
def test_whole_kernel_entries_over_several_slot_blocks(ratio: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-program-per-token kernel with slot blocks of 32 entries (the 24-key window in 16-key
    tiles, the smallest a GPU's tl.dot takes: 2 tiles per block): at 601 tokens of context ratio 16
    gives 37 entries (a full block and 5 over), ratio 4 up to 70 picks (3 blocks); the tokens at
    300-301 fill most of one block (18 entries), those at 61-63 hold 3-4."""
    monkeypatch.setattr(kt, "SPLIT_TOKENS", 0)
    monkeypatch.setattr(kt, "CONFIG", kt.AttentionConfig(block_n=16))
    cfg = kernel_model(sliding_window=24)
    case = make_case(17, [(600, 1), (300, 2), (61, 3)], page_size=4, poison=True, cfg=cfg)
    assert (case.batch.positions.max().item() + 1) // 16 > 32  # more HCA entries than one block holds
    _check_fp32(case, ratio, topk=70, seed=14)


@pytest.mark.parametrize("ratio", [0, 4, 16])
def test_sparse_attention_prefill_tiles_bf16(ratio: int) -> None:
    """A bf16 step of more than PREFILL_TOKENS tokens takes PREFILL_CONFIG (all heads per program,
    64-key tiles, slot blocks of several tiles) and stays close to the fp32 reference."""
    case = make_case(11, [(0, 70), (200, 3), (40, 1)], page_size=8, dtype="bfloat16",
                     cfg=kernel_model(sliding_window=100))  # fmt: skip
    assert case.batch.num_tokens > kt.PREFILL_TOKENS
    layer = case.cfg.compress_ratios.index(ratio)
    T, H, D = case.batch.num_tokens, case.cfg.num_heads, case.cfg.head_dim
    gen = torch.Generator().manual_seed(12)
    q = on_device(torch.randn(T, H, D, generator=gen).bfloat16())
    sinks = on_device(torch.randn(H, generator=gen))
    swa = case.buffer("swa", layer)
    cmp = case.buffer(pool_of(ratio), layer) if ratio else None
    idx = _indices(case, gen, 60) if ratio == 4 else None
    ref = reference.sparse_attention(
        q.float(), swa.float(), None if cmp is None else cmp.float(), idx, case.ref, sinks, D**-0.5, ratio
    )
    got = kt.sparse_attention(q, swa, cmp, idx, case.fused, sinks, D**-0.5, ratio)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - ref).norm() / ref.norm()) < 1e-2


def test_key_tiles_under_16_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="block_n 8"):
        kt.AttentionConfig(block_n=8)


def test_split_of_tiles_not_a_power_of_two_is_refused() -> None:
    with pytest.raises(ValueError, match="split 48"):
        kt.AttentionConfig(block_n=16, split=48)
    with pytest.raises(ValueError, match="split 40"):
        kt.AttentionConfig(block_n=16, split=40)
