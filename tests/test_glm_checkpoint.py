"""GLM-4.7-Flash behind the model seam: config, registry, loader errors, MTP skipping, shards, plan, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4serve.config import ConfigError
from dsv4serve.models.glm4_moe_lite.config import GlmConfig
from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm, tiny_glm_config
from dsv4serve.models.registry import config_file, config_from_dict, config_from_json_file
from dsv4serve.models.spec import CheckpointError
from dsv4serve.moe.experts import gate_up_view
from tests.checkpoints import expected_tensors, load_checkpoint, loaded_tensors


def _official() -> Path:
    """The official GLM-4.7-Flash config.json, shipped in the package."""
    return config_file("glm-4.7-flash")


def test_official_config_parses_through_the_registry() -> None:
    cfg = config_from_json_file(_official())
    assert isinstance(cfg, GlmConfig)
    assert (cfg.num_layers, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (47, 768, 512, 64)
    assert cfg.dense_layers == (True,) + (False,) * 46
    assert cfg.eos_token_ids == (154820, 154827, 154829)
    (pool,) = cfg.kv_layout.pools
    assert pool.name == "full" and pool.bytes_per_slot(2) == 47 * 576 * 2 == 54_144
    names = expected_tensors(cfg)
    assert names["layers.0.self_attn.kv_b_proj.weight"] == (8960, 512)
    assert names["layers.1.mlp.experts.63.down_proj.weight"] == (2048, 1536)
    assert not any(n.startswith("layers.47.") for n in names)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"model_type": "llama"}, "model_type"),
        ({"n_group": 3}, "n_group"),
        ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types"),
        ({"kv_lora_rank": -1}, "kv_lora_rank"),
    ],
)
def test_bad_glm_configs_name_the_key(change: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        config_from_dict({**tiny_glm_config(), **change})


def test_loader_skips_mtp_stacks_experts_and_reads_shards(tmp_path: Path) -> None:
    one = make_tiny_glm(tmp_path / "one", 3, vocab_size=512)
    three = make_tiny_glm(tmp_path / "three", 3, vocab_size=512, shards=3)
    assert any(k.startswith("model.layers.3.") for k in load_file(one / "model.safetensors"))  # the MTP block
    cfg = config_from_dict(json.loads((one / "config.json").read_text()))
    a = load_checkpoint(one, cfg, dtype=torch.float32)
    b = load_checkpoint(three, cfg, dtype=torch.float32)
    assert {n: tuple(t.shape) for n, t in a.items()} == loaded_tensors(cfg)
    assert a["layers.1.mlp.experts.w1"].shape == (8, 32, 64)
    both = gate_up_view(a["layers.1.mlp.experts.w1"], a["layers.1.mlp.experts.w3"])  # type: ignore[arg-type]
    assert both is not None  # gate and up stacked as one buffer: one prefill GEMM
    up = load_file(one / "model.safetensors")["model.layers.1.mlp.experts.5.up_proj.weight"]
    assert torch.equal(both[5, 32:], up.float())
    assert all(torch.equal(a[n], b[n]) for n in a)  # type: ignore[arg-type]
    bf16 = load_checkpoint(one, cfg, dtype=torch.bfloat16)
    assert bf16["layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert bf16["layers.1.mlp.experts.w2"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("model.layers.0.self_attn.kv_b_proj.weight"), "missing 1 tensors"),
        (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}), "unexpected"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(3)}), "mis-shaped"),
        (lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(torch.float8_e4m3fn)}), "float8"),
    ],
)
def test_loader_names_bad_tensors(tmp_path: Path, edit, message: str) -> None:
    model_dir = make_tiny_glm(tmp_path, 4, vocab_size=512)
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"))
    cfg = config_from_dict(json.loads((model_dir / "config.json").read_text()))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(model_dir, cfg, dtype=torch.float32)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsv4serve", *args], capture_output=True, text=True, timeout=300
    )


def test_plan_reports_the_official_latent_bytes_per_token() -> None:
    out = _cli("plan", "--config", str(_official()), "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["kv_bytes_per_token"] == 54_144 and plan["bytes_per_request"] == 0
    assert plan["full_slots"] % 128 == 0 and plan["full_slots"] * 54_144 <= plan["token_budget_bytes"]


def test_make_tiny_cli_writes_a_checkpoint_transformers_loads(tmp_path: Path) -> None:
    out = _cli("make-tiny", str(tmp_path / "glm"), "--model", "glm4_moe_lite", "--seed", "5")
    assert out.returncode == 0, out.stderr
    from transformers import Glm4MoeLiteForCausalLM

    model = Glm4MoeLiteForCausalLM.from_pretrained(tmp_path / "glm", dtype=torch.float32)
    ours = load_file(tmp_path / "glm" / "model.safetensors")
    assert torch.equal(model.lm_head.weight, ours["lm_head.weight"])
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj[2]  # transformers fuses gate | up
    assert torch.equal(gate_up[:32], ours["model.layers.1.mlp.experts.2.gate_proj.weight"])


def test_demo_streams_a_tiny_glm_through_the_actors(tmp_path: Path) -> None:
    out = _cli("demo", "--model-type", "glm4_moe_lite", "--max-tokens", "3", "--cache-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "tiny glm4_moe_lite checkpoint" in out.stdout and "summary: 4 requests" in out.stdout
    assert out.stdout.count("] + ") >= 4


def test_glm_text_prompts_get_no_bos(tmp_path: Path) -> None:
    from dsv4serve import Engine, SamplingParams
    from dsv4serve.actors.tokenizer_core import load_tokenizer

    model_dir = make_tiny_glm(tmp_path, 7, vocab_size=129280)
    tok = load_tokenizer(model_dir, require_bos=False)
    with Engine(model_dir, dtype="float32", max_total_tokens=512, max_num_seqs=2) as eng:
        (c,) = eng.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0))
        first = c.token_ids[0]
        (stopped,) = eng.generate(
            [list(c.prompt_token_ids)], SamplingParams(max_tokens=3, temperature=0, stop_token_ids=(first,))
        )
    assert list(c.prompt_token_ids) == tok.encode("The capital of France is", add_special_tokens=False)
    assert stopped.finish_reason == "stop" and list(stopped.token_ids) in ([], [first])
