"""W8A8 int8 weights: the reference linear, and a whole model run with quantized projections."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from golden_harness import engine_traces

from dsv4serve.config import ConfigError, EngineConfig
from dsv4serve.layers.linear import Int8Weight, linear, quantize_activation, quantize_int8


def test_int8_linear_is_close_to_the_float_linear_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    for tokens, d_in, d_out in ((1, 64, 32), (17, 256, 96), (5, 1024, 8)):
        x = torch.randn(tokens, d_in, generator=gen)
        w = torch.randn(d_out, d_in, generator=gen) / d_in**0.5
        ref, got = x @ w.T, linear(x, quantize_int8(w))
        assert float((got - ref).norm() / ref.norm()) < 0.02


def test_int8_linear_is_exact_on_int8_representable_inputs() -> None:
    """With int8-valued weights and activations whose max is 127, the scales are 1 and the int8
    product is the float product exactly."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (8, 32), generator=gen).float()
    w[:, 0] = 127.0
    x = torch.randint(-127, 128, (3, 32), generator=gen).float()
    x[:, 0] = 127.0
    assert torch.equal(linear(x, quantize_int8(w)), x @ w.T)


def test_quantization_error_is_within_half_a_step() -> None:
    w = torch.randn(4, 3, 50)
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (4, 3)
    err = (q.qweight.float() * q.scale[..., None] - w).abs()
    assert bool((err <= q.scale[..., None] / 2 + 1e-6).all())
    xq, xs = quantize_activation(torch.randn(6, 50))
    assert xq.dtype == torch.int8 and xs.shape == (6,)


def test_stacked_experts_index_like_tensors() -> None:
    w = torch.randn(3, 8, 16)
    q = quantize_int8(w)
    one = q[1]
    assert isinstance(one, Int8Weight) and one.shape == (8, 16)
    assert torch.equal(one.qweight, quantize_int8(w[1]).qweight)


def test_weight_quant_must_be_known() -> None:
    with pytest.raises(ConfigError, match="weight_quant"):
        EngineConfig(weight_quant="int4")


def test_model_with_int8_projections_tracks_the_float_model(tiny_model_dir: Path) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 129000) for _ in range(n)] for n in (7, 40, 90)]
    engine = EngineConfig(dtype="float32", page_size=8, max_num_seqs=4, max_total_tokens=1024)
    ref = engine_traces(tiny_model_dir, prompts, 4, engine)
    got = engine_traces(tiny_model_dir, prompts, 4, engine.with_(weight_quant="int8"))
    # Measured on this checkpoint: median logit correlation 0.9995, mean 0.993, top-1 agreement 85%
    # over the 137 prompt positions; a wrong scale or layout gives correlations near 0.
    corr, agree = [], []
    for r, g in zip(ref, got, strict=True):
        for a, b in zip(r.logits[: len(r.logits) - 3], g.logits, strict=False):  # prompt positions
            corr.append(float(torch.corrcoef(torch.stack([a, b]))[0, 1]))
            agree.append(int(a.argmax() == b.argmax()))
    corr.sort()
    assert corr[len(corr) // 2] > 0.995 and sum(corr) / len(corr) > 0.97, corr[:5]
    assert sum(agree) / len(agree) > 0.7, f"top-1 agreement {sum(agree)}/{len(agree)}"
