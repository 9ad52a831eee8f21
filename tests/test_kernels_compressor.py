"""Triton fused compressor against the reference: the compressed entries written and every state row
persisted, on ragged steps that close many windows (chunks, decodes, window 0 of ratio 4), padded window
lists, both state modes, and pools poisoned where no correct read goes (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4serve.attention import dsv4 as reference
from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.backends.cuda.compressor import compressor
from tests.kernel_cases import make_case, on_device, pool_of

STEPS = [[(0, 9), (15, 1), (5, 22), (31, 1), (2, 2)], [(0, 1), (3, 1), (0, 17)]]


def _weights(ratio: int, d: int, hidden: int, gen: torch.Generator, dtype: torch.dtype) -> CompressorWeights:
    coff = 2 if ratio == 4 else 1
    return CompressorWeights(
        wkv_gate=on_device((torch.randn(2 * coff * d, hidden, generator=gen) / hidden**0.5).to(dtype)),
        ape=on_device(torch.randn(ratio, coff * d, generator=gen)),
        norm=on_device(torch.randn(d, generator=gen).to(dtype)),
    )


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("ratio", [4, 16])
@pytest.mark.parametrize("state_mode", ["paged", "ring"])
@pytest.mark.parametrize("poison", [False, True])
def test_compressor_matches_reference(steps: list, ratio: int, state_mode: str, poison: bool) -> None:
    case = make_case(21, steps, page_size=4, state_mode=state_mode, poison=poison, pad_windows=True)
    layer = case.cfg.compress_ratios.index(ratio)
    d, hidden = case.cfg.head_dim, case.cfg.hidden_size
    gen = torch.Generator().manual_seed(22)
    w = _weights(ratio, d, hidden, gen, torch.float32)
    x = on_device(torch.randn(case.batch.num_tokens, hidden, generator=gen))
    state, out = case.buffer(f"{pool_of(ratio)}_state", layer), case.buffer(pool_of(ratio), layer)
    want_state, want_out = state.clone(), out.clone()
    reference.compressor(x, w, want_state, want_out, case.ref, ratio, 1e-6)
    compressor(x, w, state, out, case.fused, ratio, 1e-6, linear=F.linear)
    sentinel = case.step_tables().state_sentinels[ratio]
    keep = torch.ones(state.shape[0], dtype=torch.bool, device=state.device)
    keep[sentinel] = False  # the reference parks the rows nobody keeps on the sentinel slot
    torch.testing.assert_close(state[keep], want_state[keep], atol=1e-5, rtol=1e-5, equal_nan=True)
    keep_out = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    keep_out[0] = False  # and writes padding windows to slot 0
    torch.testing.assert_close(out[keep_out], want_out[keep_out], atol=1e-5, rtol=1e-5, equal_nan=True)
    written = case.batch.windows[ratio].index >= 0
    assert written.any()


def test_compressor_bf16_close_to_reference() -> None:
    case = make_case(23, STEPS[0], page_size=8, dtype="bfloat16")
    d, hidden = case.cfg.head_dim, case.cfg.hidden_size
    gen = torch.Generator().manual_seed(24)
    w = _weights(4, d, hidden, gen, torch.bfloat16)
    x = on_device(torch.randn(case.batch.num_tokens, hidden, generator=gen).bfloat16())
    state, out = case.buffer("c4_state", 1), case.buffer("c4", 1)
    want_state, want_out = state.clone(), out.clone()
    reference.compressor(x, w, want_state, want_out, case.ref, 4, 1e-6)
    compressor(x, w, state, out, case.fused, 4, 1e-6, linear=F.linear)
    assert torch.equal(state[1:], want_state[1:])
    err = (out[1:].float() - want_out[1:].float()).abs().max()
    assert float(err) <= 0.02 * float(want_out[1:].float().abs().max())
