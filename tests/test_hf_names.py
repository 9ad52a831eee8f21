"""transformers' tensor names map onto the official ones: a DeepseekV4ForCausalLM loaded from a tiny
checkpoint gives back exactly the tensors our loader reads from the same directory."""

from __future__ import annotations

from pathlib import Path

import torch

from dsv4serve.config import ModelConfig
from dsv4serve.models.hf_names import official_name, official_weights
from dsv4serve.models.loader import load_checkpoint


def test_transformers_state_dict_maps_to_the_loaders_weights(tiny_model_dir: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    got = official_weights(model.state_dict().items())
    want = load_checkpoint(tiny_model_dir, ModelConfig.from_dir(tiny_model_dir), dtype=torch.float32)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert isinstance(value, torch.Tensor)
        assert torch.equal(got[name].to(value.dtype), value), name


def test_official_names_are_kept() -> None:
    for name in ("embed.weight", "layers.3.attn.indexer.compressor.ape", "layers.0.ffn.gate.tid2eid"):
        assert official_name(name) == name
