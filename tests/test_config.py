"""DeepseekV4Config / EngineConfig: official and transformers spellings agree; bad values name their key."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4serve.config import ConfigError, EngineConfig
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.registry import config_file, config_from_dir, config_from_json_file

TYPE_OF_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention"}


def official(name: str) -> dict[str, Any]:
    """An official config.json shipped in the package (`flash`, `pro`)."""
    return json.loads(config_file(f"deepseek-v4-{name}").read_text())


def by_hand_transformers(raw: dict[str, Any], *, hca: int = 128) -> dict[str, Any]:
    """The transformers spelling of an official config, written without transformers."""
    out = {k: v for k, v in raw.items() if k not in ("compress_ratios", "num_hash_layers", "rope_scaling")}
    for key in ("qk_rope_head_dim", "rope_theta", "compress_rope_theta"):
        out.pop(key)
    n = raw["num_hidden_layers"]
    out["layer_types"] = [
        TYPE_OF_RATIO.get(r, "heavily_compressed_attention") for r in raw["compress_ratios"][:n]
    ]
    out["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca}
    out["mlp_layer_types"] = ["hash_moe" if i < raw["num_hash_layers"] else "moe" for i in range(n)]
    out["partial_rotary_factor"] = raw["qk_rope_head_dim"] / raw["head_dim"]
    yarn = {k: v for k, v in raw["rope_scaling"].items() if k != "type"}
    out["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": raw["rope_theta"]},
        "compress": {"rope_type": "yarn", "rope_theta": raw["compress_rope_theta"], **yarn},
    }
    return out


def with_(raw: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for key, value in changes.items():
        if value is _MISSING:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_MISSING = object()


def test_flash_official() -> None:
    cfg = DeepseekV4Config.from_dict(official("flash"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (43, 4096, 64, 512)
    assert cfg.compress_ratios == (0, 0) + (4, 128) * 20 + (4,)  # the 44th (MTP) entry is dropped
    assert len(cfg.c4_layers) == 21 and len(cfg.c128_layers) == 20
    assert cfg.c4_layers[0] == 2 and cfg.c128_layers[0] == 3
    assert (cfg.hca_ratio, cfg.compress_ratio_set) == (128, (4, 128))
    assert (cfg.rope_head_dim, cfg.rope_theta, cfg.compress_rope_theta) == (64, 10000.0, 160000.0)
    assert (cfg.rope_factor, cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow) == (
        16.0,
        65536,
        32.0,
        1.0,
    )
    assert (cfg.num_hash_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (3, 256, 6)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.sliding_window) == (64, 128, 512, 128)
    assert (cfg.eos_token_ids, cfg.expert_dtype, cfg.num_nextn_predict_layers) == ((1,), "fp4", 1)


def test_pro_official() -> None:
    cfg = DeepseekV4Config.from_dict(official("pro"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.o_groups) == (61, 7168, 128, 16)
    assert cfg.compress_ratios == (128, 128) + (4, 128) * 29 + (4,)
    assert len(cfg.c4_layers) == 30 and len(cfg.c128_layers) == 31
    assert (cfg.index_topk, cfg.n_routed_experts, cfg.routed_scaling_factor) == (1024, 384, 2.5)


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_transformers_spelling_gives_the_same_config(name: str) -> None:
    from transformers import DeepseekV4Config as TransformersConfig

    raw = official(name)
    expected = DeepseekV4Config.from_dict(raw)
    via_transformers = TransformersConfig(**copy.deepcopy(raw)).to_dict()  # it edits nested dicts in place
    assert "layer_types" in via_transformers and "compress_ratios" not in via_transformers
    assert DeepseekV4Config.from_dict(via_transformers) == expected
    no_rope_dim = with_(via_transformers, qk_rope_head_dim=_MISSING)  # must come from partial_rotary_factor
    assert DeepseekV4Config.from_dict(no_rope_dim) == expected
    hand = by_hand_transformers(raw)
    assert DeepseekV4Config.from_dict(hand) == expected


def test_top_level_partial_rotary_factor_with_nested_rope_parameters() -> None:
    raw = with_(official("flash"), head_dim=256, qk_rope_head_dim=32)
    hand = by_hand_transformers(raw)  # partial_rotary_factor only at the top level, as a user may write it
    assert "partial_rotary_factor" not in hand["rope_parameters"]["main"]
    assert (
        DeepseekV4Config.from_dict(hand).rope_head_dim == 32 == DeepseekV4Config.from_dict(raw).rope_head_dim
    )


@settings(deadline=None, max_examples=30)
@given(
    ratios=st.lists(st.sampled_from([0, 4, 1]), min_size=1, max_size=12),
    hca=st.sampled_from([8, 16, 128]),
    num_hash=st.integers(0, 12),
)
def test_spellings_agree_on_random_layouts(ratios: list[int], hca: int, num_hash: int) -> None:
    ratios = [hca if r == 1 else r for r in ratios]
    n = len(ratios)
    raw = with_(
        official("flash"), num_hidden_layers=n, compress_ratios=[*ratios, 0], num_hash_layers=num_hash
    )
    cfg = DeepseekV4Config.from_dict(raw)
    assert cfg.compress_ratios == tuple(ratios)
    assert cfg.num_hash_layers == min(num_hash, n)
    assert cfg.hca_ratio == (hca if hca in ratios else 0)
    assert cfg.c128_layers == tuple(i for i, r in enumerate(ratios) if r == hca)
    assert cfg.c4_layers == tuple(i for i, r in enumerate(ratios) if r == 4)
    hand = by_hand_transformers(with_(raw, num_hash_layers=min(num_hash, n)), hca=hca)
    assert DeepseekV4Config.from_dict(hand) == cfg


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"hidden_size": _MISSING}, "hidden_size"),
        ({"num_hidden_layers": "43"}, "num_hidden_layers"),
        ({"num_hidden_layers": 43.0}, "num_hidden_layers"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_attention_heads": -1}, "num_attention_heads"),
        ({"o_groups": 0}, "o_groups"),
        ({"o_groups": 7}, "o_groups"),
        ({"compress_ratios": [0, 3] * 22}, "compress_ratios"),
        ({"compress_ratios": [0, 12] * 22}, "compress_ratios"),
        ({"compress_ratios": [0, 4, 64, 128] * 11}, "compress_ratios"),
        ({"compress_ratios": [0, 4] * 10}, "compress_ratios"),
        ({"compress_ratios": "4,128"}, "compress_ratios"),
        ({"compress_ratios": _MISSING}, "compress_ratios"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"routed_scaling_factor": "big"}, "routed_scaling_factor"),
        ({"eos_token_id": "eos"}, "eos_token_id"),
        ({"rope_scaling": "yarn"}, "rope_scaling"),
        ({"model_type": "deepseek_v3"}, "model_type"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),  # reached a scheduler assert
        ({"index_topk": 0}, "index_topk"),
        ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"eos_token_id": [True]}, "eos_token_id"),
        ({"eos_token_id": 10**7}, "eos_token_id"),
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"rope_scaling": {"type": "yarn", "factor": "16"}}, "factor"),
        ({"rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": []}}, "beta_fast"),
    ],
)
def test_bad_official_values_name_the_key(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        DeepseekV4Config.from_dict(with_(official("flash"), **changes))


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"layer_types": ["sliding_attention", "flash_attention"] * 22}, "layer_types"),
        ({"layer_types": []}, "layer_types"),
        ({"compress_rates": [4, 128]}, "compress_rates"),
        ({"compress_rates": {"heavily_compressed_attention": 100}}, "compress_ratios"),
        ({"mlp_layer_types": 3}, "mlp_layer_types"),
        ({"mlp_layer_types": ["moe", "hash_moe"] + ["moe"] * 41}, "mlp_layer_types"),
        ({"rope_parameters": {"main": 1, "compress": {}}}, "rope_parameters"),
        ({"rope_parameters": {"main": {}, "compress": {"rope_theta": "x"}}}, "rope_theta"),
    ],
)
def test_bad_transformers_values_name_the_key(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        DeepseekV4Config.from_dict(with_(by_hand_transformers(official("flash")), **changes))


def test_spellings_that_disagree_are_refused() -> None:
    raw = by_hand_transformers(official("flash"))
    raw["compress_ratios"] = [0, 0] + [128, 4] * 20 + [4, 0]
    with pytest.raises(ConfigError, match="compress_ratios"):
        DeepseekV4Config.from_dict(raw)


def test_files_and_directories(tmp_path: Path) -> None:
    assert config_from_json_file(config_file("deepseek-v4-flash")).num_layers == 43
    assert config_from_json_file("deepseek-v4-flash").num_layers == 43  # by name
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_json_file(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        config_from_json_file(tmp_path / "list.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_json_file(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        config_from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(official("pro")))
    assert config_from_dir(tmp_path).num_layers == 61
    assert issubclass(ConfigError, ValueError)


def test_engine_config_defaults() -> None:
    cfg = EngineConfig()
    assert (cfg.device, cfg.page_size, cfg.state_mode, cfg.torch_dtype_name) == (
        "cpu",
        128,
        "paged",
        "float32",
    )
    assert EngineConfig(device="npu").torch_dtype_name == "bfloat16"
    assert cfg.with_(page_size=64).page_size == 64
    flash = DeepseekV4Config.from_dict(official("flash"))
    assert (cfg.max_total_tokens, cfg.gpu_memory_utilization) == (None, 0.9)  # sized as the model loads
    assert cfg.with_(max_total_tokens=65536).resolved_max_model_len(flash) == 65536


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"device": "tpu"}, "device"),
        ({"device": 5}, "device"),
        ({"dtype": "int8"}, "dtype"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": 96}, "page_size"),
        ({"page_size": True}, "page_size"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_num_batched_tokens": 1.5}, "max_num_batched_tokens"),
        ({"max_total_tokens": "64k"}, "max_total_tokens"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"state_mode": "flat"}, "state_mode"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_bad_engine_values_name_the_key(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        EngineConfig(**changes)


BAD_VALUES = (
    st.integers(-3, 3)
    | st.integers(min_value=2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.none()
    | st.text(max_size=5)
    | st.lists(st.integers(-2, 200) | st.text(max_size=3), max_size=4)
    | st.dictionaries(
        st.sampled_from(["type", "factor", "rope_type", "x"]), st.integers(-2, 3) | st.text(max_size=3)
    )
)
TINY_KEYS = sorted(by_hand_transformers(official("flash")).keys() | official("flash").keys())


@settings(deadline=None, max_examples=300)
@given(
    spelling=st.sampled_from(["official", "transformers"]),
    changes=st.dictionaries(
        st.sampled_from(TINY_KEYS), BAD_VALUES | st.just(_MISSING), min_size=1, max_size=3
    ),
)
def test_random_bad_configs_are_a_config_error_or_servable(spelling: str, changes: dict[str, Any]) -> None:
    """A random config.json either raises ConfigError naming a key (`key: ...`), or gives a config
    every core accepts (the scheduler used to meet max_position_embeddings 0 in an assert)."""
    from dsv4serve.scheduler import SchedulerCore

    raw = official("flash") if spelling == "official" else by_hand_transformers(official("flash"))
    try:
        cfg = DeepseekV4Config.from_dict(with_(raw, **changes))
    except ConfigError as err:
        assert re.match(r"^[a-z_][a-z0-9_.]*: ", str(err)), str(err)
        return
    engine = EngineConfig(page_size=16, max_num_seqs=2, max_total_tokens=1024)
    SchedulerCore(2, 64, engine.resolved_max_model_len(cfg), 2, cfg.eos_token_ids)
    assert all(0 <= e < cfg.vocab_size for e in cfg.eos_token_ids)
    assert len(cfg.compress_ratios) == cfg.num_layers and cfg.num_hash_layers <= cfg.num_layers
