"""The tiny random checkpoint: official layout, loadable by transformers with every value intact."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4serve.models.deepseek_v4.tiny import make_tiny, tiny_config
from dsv4serve.models.registry import config_from_dir
from tests.checkpoints import expected_tensors, expert_slot

# official name -> transformers name, mirroring transformers' conversion_mapping["deepseek_v4"]
HF_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"^embed\.", "embed_tokens."),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"(compressor|indexer)\.norm\.", r"\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]


def hf_name(name: str) -> str:
    if name == "head.weight":
        return "lm_head.weight"
    for pattern, replacement in HF_RENAMES:
        name = re.sub(pattern, replacement, name)
    return "model." + name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0)


def read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return out


def test_config_uses_official_keys_and_agrees_with_transformers_keys(tiny: Path) -> None:
    raw = json.loads((tiny / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v4" and raw["architectures"] == ["DeepseekV4ForCausalLM"]
    assert raw["compress_ratios"] == [0, 4, 16, 4, 16, 0]  # trailing entry for the MTP layer
    assert raw["layer_types"][1:3] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    assert raw["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    assert raw["rope_scaling"]["type"] == "yarn" and raw["rope_scaling"]["factor"] == 16
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["num_nextn_predict_layers"]) == (0, 1, 0)
    model = config_from_dir(tiny)
    assert model.compress_ratios == (0, 4, 16, 4, 16) and model.hca_ratio == 16
    assert model.num_hash_layers == 2 and model.vocab_size == 129280
    assert model.rope_factor == 16 and model.original_max_position_embeddings == 256
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)


def test_overrides_and_derived_layer_types() -> None:
    cfg = tiny_config(num_hidden_layers=3, compress_ratios=[4, 128, 0])
    assert cfg["compress_ratios"] == [4, 128, 0, 0]
    assert cfg["layer_types"] == [
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "sliding_attention",
    ]
    assert cfg["compress_rates"]["heavily_compressed_attention"] == 128
    assert tiny_config(num_hidden_layers=7)["compress_ratios"] == [0, 4, 16, 4, 16, 4, 16, 0]
    with pytest.raises(ValueError, match="heavily-compressed"):
        tiny_config(compress_ratios=[0, 4, 16, 32, 16])


def test_writes_every_official_tensor_with_sensible_values(tiny: Path) -> None:
    tensors = read_all(tiny)
    model = config_from_dir(tiny)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_tensors(model)
    assert (
        "layers.1.attn.indexer.compressor.ape" in tensors
        and "layers.2.attn.indexer.wq_b.weight" not in tensors
    )
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64 and "layers.2.ffn.gate.bias" in tensors
    for name, value in tensors.items():
        if name.endswith(("attn_sink", ".ape", "_base", "gate.bias")):
            assert value.abs().min() > 0 and value.std() > 0.1, name
    tid2eid = tensors["layers.1.ffn.gate.tid2eid"]
    assert int(tid2eid.min()) >= 0 and int(tid2eid.max()) < model.n_routed_experts
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()  # distinct experts per token
    assert len(set(tid2eid[:, 0].tolist())) == model.n_routed_experts


def test_seeded_and_deterministic(tiny: Path, tmp_path: Path) -> None:
    again, other = read_all(make_tiny(tmp_path / "a", seed=0)), read_all(make_tiny(tmp_path / "b", seed=1))
    ours = read_all(tiny)
    assert all(torch.equal(ours[k], again[k]) for k in ours)
    assert not torch.equal(ours["layers.0.attn.wq_a.weight"], other["layers.0.attn.wq_a.weight"])


def test_bfloat16_keeps_official_fp32_tensors(tmp_path: Path) -> None:
    tensors = read_all(make_tiny(tmp_path, dtype="bfloat16", vocab_size=1024, num_hidden_layers=2))
    assert tensors["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert tensors["norm.weight"].dtype == torch.bfloat16
    for name in (
        "hc_head_fn",
        "layers.1.hc_ffn_scale",
        "layers.1.attn.attn_sink",
        "layers.1.attn.compressor.ape",
    ):
        assert tensors[name].dtype == torch.float32, name
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_sharded_output_has_a_complete_index(tmp_path: Path) -> None:
    make_tiny(tmp_path, shards=3, vocab_size=1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (tmp_path / "model.safetensors").exists()
    tensors = read_all(tmp_path)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_transformers_loads_every_tensor_unchanged(tiny: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    hf, info = DeepseekV4ForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    assert hf.config.layer_types[2] == "heavily_compressed_attention"
    assert hf.config.compress_rates["heavily_compressed_attention"] == 16
    state = hf.state_dict()
    ours = read_all(tiny)
    checked = set()
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in ours.items():
        slot = expert_slot(name)
        if slot:
            experts.setdefault(slot[0], {})[slot[1]] = value
            continue
        assert torch.equal(state[hf_name(name)], value), name
        checked.add(hf_name(name))
    for layer in range(hf.config.num_hidden_layers):
        p = f"layers.{layer}.ffn.experts."
        w1, w2, w3 = (torch.stack([experts[p + w][e] for e in range(8)]) for w in ("w1", "w2", "w3"))
        q = f"model.layers.{layer}.mlp.experts."
        assert torch.equal(state[q + "gate_up_proj"], torch.cat([w1, w3], dim=1))
        assert torch.equal(state[q + "down_proj"], w2)
        checked |= {q + "gate_up_proj", q + "down_proj"}
    assert checked == set(state), sorted(set(state) ^ checked)[:10]


def test_tokenizer_loads_with_transformers(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert len(tok) == 129280
    ids = tok("Hello, DeepSeek!").input_ids
    assert tok.decode(ids) == "Hello, DeepSeek!"


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention on a busy 2-core box
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_forward_is_not_degenerate(tiny: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(tiny)
    ids = torch.randint(2, 129280, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    logits = out.logits[0]
    assert torch.isfinite(logits).all() and 0.3 < float(logits.std()) < 10
    assert len(set(logits.argmax(-1).tolist())) > 24  # greedy tokens vary across positions
    for h in out.hidden_states:  # (B, S, hc, D) residual streams stay O(1)
        rms = float(h.float().pow(2).mean().sqrt())
        assert 0.2 < rms < 20, rms
