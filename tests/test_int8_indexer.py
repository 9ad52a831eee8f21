"""DeepSeek-V4's int8 lightning indexer (`indexer_quant="int8"`, attention/int8_index.py): the rotation,
the per-row quantization, the scores against the model-dtype indexer's, the engine's int8 key pool,
and where the option is refused. Its Ascend ops: tests/test_npu_golden.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4serve import Engine, SamplingParams
from dsv4serve.attention import core
from dsv4serve.attention.hadamard import hadamard_transform
from dsv4serve.attention.int8_index import Int8Rows, int8_scores, quantize_rows, rotate_quantize, store_rows
from dsv4serve.config import ConfigError, EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.registry import config_from_dir, config_from_json_file, with_index_quant


def test_rows_quantize_per_row_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * torch.rand(64, 1, generator=g) * 10
    x[3] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    assert torch.equal(scale, x.abs().amax(-1) / 127)
    assert (q.float() * scale[:, None] - x).abs().le(scale[:, None] / 2 + 1e-6).all()
    assert q.abs().amax(-1)[scale > 0].eq(127).all()  # each row's largest reaches the range's end
    assert not q[3].any() and scale[3] == 0  # an all-zero row: zeros, no NaN


def test_the_rotation_keeps_dot_products() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 128, generator=g, dtype=torch.float64)
    k = torch.randn(7, 128, generator=g, dtype=torch.float64)
    assert torch.allclose(hadamard_transform(q) @ hadamard_transform(k).T, q @ k.T, atol=1e-10)


def test_int8_picks_are_the_model_dtype_picks_but_near_ties() -> None:
    """The int8 scores track the bf16 ones (rotation + quantization error a few percent of the score
    spread) and the top-64 of 512 keys keeps over 90% of the same entries."""
    g = torch.Generator().manual_seed(2)
    T, Hi, Di, J, K = 16, 16, 128, 512, 64
    q = torch.randn(T, Hi, Di, generator=g).bfloat16()
    keys = torch.randn(J, Di, generator=g).bfloat16()
    head_w = torch.randn(T, Hi, generator=g).abs() * Hi**-0.5
    exact = core.indexer_scores(q, keys.expand(T, J, Di), head_w, Di**-0.5)
    pool = Int8Rows(torch.zeros(J, Di, dtype=torch.int8), torch.zeros(J, 1, dtype=torch.float16))
    store_rows(pool, torch.arange(J), keys)
    qi, q_scale = rotate_quantize(q)
    k_scale = pool.scale[:, 0].expand(T, J)
    got = int8_scores(qi, q_scale, pool.data.expand(T, J, Di), k_scale, head_w * Di**-0.5)
    spread = exact.std(dim=-1, keepdim=True)
    assert ((got - exact).abs() / spread).max() < 0.1
    picks = core.topk_lowest_ties(got, K)
    want = core.topk_lowest_ties(exact, K)
    kept = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(picks, want, strict=True))
    assert kept / (T * K) > 0.9, kept / (T * K)


def test_the_engine_keeps_int8_keys_and_greedy_does_not_depend_on_the_batch(tiny_model_dir: Path) -> None:
    """The index-key pool is int8 with an fp16 scale per entry (bytes per c4 slot: Di + 2 a layer instead
    of 4 Di in fp32); long prompts (the indexer choosing 4 of up to 37 entries) give each request the same
    greedy tokens alone as together."""
    prompts = [[3 + (i * 7 + j) % 500 for j in range(n)] for i, n in enumerate((150, 97, 41))]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine(tiny_model_dir, indexer_quant="int8") as eng:
        together = [r.token_ids for r in eng.generate(prompts, greedy)]
        alone = [eng.generate([p], greedy)[0].token_ids for p in prompts]
    assert together == alone
    runner = ModelRunner(tiny_model_dir, EngineConfig(indexer_quant="int8", max_total_tokens=1024))
    assert {t.dtype for t in runner.cache.buffers["c4_index"].values()} == {torch.int8}
    assert {t.dtype for t in runner.cache.buffers["c4_index_scale"].values()} == {torch.float16}
    cfg = config_from_dir(tiny_model_dir)
    assert isinstance(cfg, DeepseekV4Config)
    c4 = {p.name: p for p in with_index_quant(cfg, "int8").kv_layout.pools}["c4"]
    plain = {p.name: p for p in cfg.kv_layout.pools}["c4"]
    layers, idim = len(cfg.c4_layers), cfg.index_head_dim
    assert plain.bytes_per_slot(4) - c4.bytes_per_slot(4) == layers * (4 * idim - idim - 2)


def test_the_option_is_refused_where_it_has_no_meaning(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="indexer_quant: glm4_moe_lite has no lightning indexer"):
        with_index_quant(config_from_json_file(_glm_config(tmp_path)), "int8")
    with pytest.raises(ConfigError, match="indexer_quant: int8 index keys are Ascend's format"):
        EngineConfig(device="cuda", indexer_quant="int8")
    with pytest.raises(ConfigError, match="indexer_quant: 'fp4' is not one of"):
        EngineConfig(indexer_quant="fp4")


def _glm_config(tmp_path: Path) -> Path:
    import json

    from dsv4serve.models.glm4_moe_lite.tiny import tiny_glm_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_glm_config()))
    return path
