"""The checkpoint loader's API as the checkpoint tests use it: a model's weights by its config, and the
names and shapes its family's schema declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsv4serve.layers.linear import Weight
from dsv4serve.memory.layout import ServedModelConfig
from dsv4serve.models.deepseek_v4.names import NAMES
from dsv4serve.models.loader import load_weights, loaded_schema
from dsv4serve.models.registry import spec_for

Shape = tuple[int, ...]


def load_checkpoint(model_dir: Path | str, model: ServedModelConfig, **kwargs: Any) -> dict[str, Weight]:
    return load_weights(model_dir, spec_for(model.model_type), model, **kwargs)


def expected_tensors(model: ServedModelConfig) -> dict[str, Shape]:
    """Every tensor of a checkpoint, experts one by one, with its shape."""
    return {n: t.shape for n, t in spec_for(model.model_type).schema(model).items()}


def loaded_tensors(model: ServedModelConfig) -> dict[str, Shape]:
    """What `load_checkpoint` returns, experts stacked, with its shape."""
    spec = spec_for(model.model_type)
    return {n: t.shape for n, t in loaded_schema(spec.schema(model), spec.names(model)).items()}


def int8_names(model: ServedModelConfig) -> set[str]:
    """The checkpoint tensors the model takes as W8A8 int8."""
    return {n for n, t in spec_for(model.model_type).schema(model).items() if t.int8}


def loaded_int8_names(model: ServedModelConfig) -> set[str]:
    """The loaded weights (experts stacked) the model takes as W8A8 int8."""
    spec = spec_for(model.model_type)
    return {n for n, t in loaded_schema(spec.schema(model), spec.names(model)).items() if t.int8}


def expert_slot(name: str) -> tuple[str, int] | None:
    """A DeepSeek-V4 routed expert's tensor -> (its stacked name, its expert index); None for any other."""
    return NAMES.expert(name)
