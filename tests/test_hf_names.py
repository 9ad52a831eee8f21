"""transformers' tensor names map onto the official ones: a DeepseekV4ForCausalLM loaded from a tiny
checkpoint gives back exactly the tensors our loader reads from the same directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4serve.models.deepseek_v4.names import NAMES, official_name, official_weights
from dsv4serve.models.loader import _read, read_headers
from dsv4serve.models.registry import config_from_dir
from dsv4serve.models.spec import CheckpointError
from tests.checkpoints import load_checkpoint


def test_transformers_state_dict_maps_to_the_loaders_weights(tiny_model_dir: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    got = official_weights(model.state_dict().items())
    want = load_checkpoint(tiny_model_dir, config_from_dir(tiny_model_dir), dtype=torch.float32)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert isinstance(value, torch.Tensor)
        assert torch.equal(got[name].to(value.dtype), value), name


def test_official_names_are_kept() -> None:
    for name in ("embed.weight", "layers.3.attn.indexer.compressor.ape", "layers.0.ffn.gate.tid2eid"):
        assert official_name(name) == name


def test_mixed_names_of_save_pretrained_map_to_official() -> None:
    """save_pretrained's default format: its conversion mapping run backwards leaves these names."""
    assert official_name("model.embed_tokens.weight") == "embed.weight"
    assert official_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert official_name("model.layers.2.attn.norm.weight") == "layers.2.attn.kv_norm.weight"
    assert (
        official_name("model.layers.2.attn.compressor.norm.weight") == "layers.2.attn.compressor.norm.weight"
    )
    assert official_name("head.weight") == "head.weight"


def test_stacked_experts_are_read_as_per_expert_slices(tmp_path: Path) -> None:
    gate_up, down = torch.randn(3, 8, 5), torch.randn(3, 5, 4)
    save_file(
        {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down},
        str(tmp_path / "model.safetensors"),
    )
    files = [tmp_path / "model.safetensors"]
    headers = read_headers(files, NAMES)
    assert len(headers) == 9 and headers["layers.0.ffn.experts.2.w3.weight"].shape == (4, 5)
    with safe_open(str(files[0]), framework="pt") as handle:
        handles = {files[0]: handle}
        for e in range(3):
            w1, w3 = gate_up[e, :4], gate_up[e, 4:]
            assert torch.equal(_read(handles, headers[f"layers.0.ffn.experts.{e}.w1.weight"]), w1)
            assert torch.equal(_read(handles, headers[f"layers.0.ffn.experts.{e}.w3.weight"]), w3)
            assert torch.equal(_read(handles, headers[f"layers.0.ffn.experts.{e}.w2.weight"]), down[e])


def test_one_tensor_under_two_namings_is_refused(tmp_path: Path) -> None:
    save_file(
        {"embed.weight": torch.zeros(2, 2), "model.embed_tokens.weight": torch.zeros(2, 2)},
        str(tmp_path / "a.safetensors"),
    )
    with pytest.raises(CheckpointError, match=r"embed\.weight: present twice .*model\.embed_tokens\.weight"):
        read_headers([tmp_path / "a.safetensors"], NAMES)
