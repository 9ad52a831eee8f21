"""DeepSeek-V4's compressor on the npu backend (`backends/npu/compressor.py`: Ascend's `compressor`, the
custom libraries' fused norm + rope form or CANN's newer unfused one) through the fake `torch_npu`, whose
ops implement the documented semantics in plain PyTorch: against the reference on ragged steps (cached
prefixes and chunks, decodes, window 0, windows read across state pages, padded window lists, poisoned
slots) for the attention's (D 512, ratios 4 and 128) and the indexer's (D 128) compressors, the
fallbacks, and the start-up choice. None of this has run on an Ascend NPU."""

from __future__ import annotations

import warnings

import pytest
import structlog
import torch
from fake_torch_npu import NEWER_COMPRESSOR, install
from kernel_cases import Case, kernel_model, make_case, pool_of

from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.backends import reference, select

REFERENCE = reference.backend()
HIDDEN = 1024
CFG = kernel_model(
    hidden_size=HIDDEN, num_attention_heads=4, head_dim=512, qk_rope_head_dim=64, compress_ratios=[0, 4, 128],
    index_n_heads=4, index_head_dim=128, sliding_window=128,
)  # fmt: skip
# (cached prefix, new tokens): chunks over window ends, decodes closing windows 0 and 1 of ratio 128 from
# stored rows across pages, a first token, a chunk closing ratio 128's window 0 from 126 stored rows
STEP = [(300, 3), (0, 140), (255, 2), (5, 22), (127, 1), (2, 1), (126, 9)]
TARGETS = {"c4": (4, "c4", 512), "c4_index": (4, "c4_index", 128), "c128": (128, "c128", 512)}


def _weights(ratio: int, d: int, gen: torch.Generator) -> CompressorWeights:
    coff = 2 if ratio == 4 else 1
    return CompressorWeights(
        wkv_gate=(torch.randn(2 * coff * d, HIDDEN, generator=gen) / HIDDEN**0.5).to(torch.bfloat16),
        ape=torch.randn(ratio, coff * d, generator=gen),
        norm=torch.rand(d, generator=gen) + 0.5,
    )


def _fp32(w: CompressorWeights) -> CompressorWeights:
    return CompressorWeights(wkv_gate=w.wkv_gate.float(), ape=w.ape, norm=w.norm)


def _buffers(case: Case, ratio: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `ratio`'s state and entry buffers of `name` (c4, c4_index, c128) as [slots, width]."""
    layer = case.cfg.compress_ratios.index(ratio)
    return case.buffer(f"{name}_state", layer), case.buffer(name, layer)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("poison", [False, True], ids=["", "poison"])
def test_compressor_on_its_op_is_the_reference(
    monkeypatch: pytest.MonkeyPatch, fused: bool, target: str, poison: bool
) -> None:
    """bf16 activations and weights at the op's dimensions, pages of 16, padded window lists: every state
    row a later step reads and every entry written equal the reference's (computed in fp32 from the
    same bf16 inputs), within bf16's rounding of the entries; the op called once."""
    calls = install(monkeypatch, fused_compressor=fused)
    ratio, name, d = TARGETS[target]
    case = make_case(31, STEP, page_size=16, dtype="bfloat16", poison=poison, cfg=CFG, pad_windows=True)
    gen = torch.Generator().manual_seed(32)
    w = _weights(ratio, d, gen)
    x = torch.randn(case.batch.num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    state, out = _buffers(case, ratio, name)
    want_state, want_out = state.clone(), out.clone()
    REFERENCE.dsv4.compressor(x.float(), _fp32(w), want_state, want_out, case.ref, ratio, 1e-6)
    select("npu").dsv4.compressor(x, w, state, out, case.fused, ratio, 1e-6)
    assert calls["compressor" if fused else NEWER_COMPRESSOR] == 1
    assert calls[NEWER_COMPRESSOR if fused else "compressor"] == 0
    # slot 0 is both pools' sentinel: the reference parks unkept state rows and padding windows there
    torch.testing.assert_close(state[1:], want_state[1:], rtol=1e-5, atol=1e-5, equal_nan=True)
    assert (case.batch.windows[ratio].index >= 0).sum() > 1  # windows close, some from stored rows
    got, want = out[1:].float(), want_out[1:].float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=3e-2, equal_nan=True)
    finite = want.isfinite()
    assert (got[finite] - want[finite]).abs().mean() < 2e-3


def test_a_steps_compressors_share_one_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention's and the indexer's ratio-4 compressors of every layer: one plan a step."""
    install(monkeypatch)
    case = make_case(33, STEP, page_size=16, dtype="bfloat16", cfg=CFG)
    gen = torch.Generator().manual_seed(34)
    x = torch.randn(case.batch.num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    compressor = select("npu").dsv4.compressor
    shared = compressor.keywords["shared"]  # type: ignore[attr-defined]
    compressor(x, _weights(4, 512, gen), *_buffers(case, 4, "c4"), case.fused, 4, 1e-6)
    plan = shared.items[("compressor", 4)]
    compressor(x, _weights(4, 128, gen), *_buffers(case, 4, "c4_index"), case.fused, 4, 1e-6)
    assert shared.items[("compressor", 4)] is plan and plan.cu_seqlens.shape == (case.batch.num_tokens + 1,)
    assert plan.cu_seqlens[: len(STEP) + 1].tolist() == [0, *torch.tensor([n for _, n in STEP]).cumsum(0)]


@pytest.mark.parametrize("why", ["fp32", "ring", "page 8", "hidden 64"])
def test_calls_outside_the_ops_limits_take_the_reference(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """fp32, the ring state mode (cache_mode 2: not on A3, another ring), pages not a multiple of 16, a
    hidden size the op does not take: the reference's own result, the op never called."""
    calls = install(monkeypatch)
    cfg = kernel_model(compress_ratios=[0, 4, 16]) if why == "hidden 64" else CFG
    case = make_case(
        35, STEP, page_size=8 if why == "page 8" else 16, dtype="float32" if why == "fp32" else "bfloat16",
        state_mode="ring" if why == "ring" else "paged", cfg=cfg,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(36)
    hidden, d = cfg.hidden_size, cfg.head_dim
    w = CompressorWeights(
        wkv_gate=torch.randn(4 * d, hidden, generator=gen) / hidden**0.5,
        ape=torch.randn(4, 2 * d, generator=gen),
        norm=torch.rand(d, generator=gen) + 0.5,
    )
    dtype = torch.float32 if why == "fp32" else torch.bfloat16
    w = CompressorWeights(wkv_gate=w.wkv_gate.to(dtype), ape=w.ape, norm=w.norm)
    x = torch.randn(case.batch.num_tokens, hidden, generator=gen).to(dtype)
    state, out = case.buffer("c4_state", 1), case.buffer(pool_of(4), 1)
    want_state, want_out = state.clone(), out.clone()
    REFERENCE.dsv4.compressor(x, w, want_state, want_out, case.ref, 4, 1e-6)
    select("npu").dsv4.compressor(x, w, state, out, case.ref, 4, 1e-6)
    assert torch.equal(state, want_state) and torch.equal(out, want_out)
    assert calls["compressor"] == calls[NEWER_COMPRESSOR] == 0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_the_compressors_generation_is_chosen_and_logged_once(
    monkeypatch: pytest.MonkeyPatch, all_logs: structlog.testing.LogCapture, fused: bool
) -> None:
    """The custom library's fused form where present, else CANN's newer op; one log line saying which."""
    install(monkeypatch, fused_compressor=fused)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both present or one: no fallback warning
        compressor = select("npu").dsv4.compressor
    assert compressor is not REFERENCE.dsv4.compressor
    assert compressor.keywords["fused"] is fused  # type: ignore[attr-defined]
    lines = [e for e in all_logs.entries if e["event"] == "npu_compressor"]
    assert len(lines) == 1 and lines[0]["fused_norm_rope"] is fused


def test_without_either_compressor_the_reference_runs_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch, missing=("compressor",))
    with pytest.warns(RuntimeWarning, match="compressor") as caught:
        ops = select("npu")
    assert len(caught) == 1 and ops.dsv4.compressor is REFERENCE.dsv4.compressor
