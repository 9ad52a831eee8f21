"""The model registry: one `ModelSpec` per `model_type`, the only place the engine names a model family.

A spec bundles what the engine needs of a family: the config parser, the weight schema (declared next
to the model math), the loader, the builder of the math object, its device buffers (from the config's
`kv_layout`, which the allocator, tables and sizing read), and a tiny random checkpoint writer.
A new family adds its model file (config, schema, math), its attention module if new, and one entry
in `SPECS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dsv4serve.config import ConfigError, EngineConfig, ModelConfig, read_json_object
from dsv4serve.layout import ServedModelConfig

if TYPE_CHECKING:  # the registry imports without torch (the CLI lists its model types)
    import torch

    from dsv4serve.memory.paged import PoolSizes
    from dsv4serve.quant import Weight

Weights = dict[str, "Weight"]
Shape = tuple[int, ...]


class ServedModel(Protocol):
    def forward(self, batch: Any, pools: Any, tables: Any, all_logits: bool = False) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    parse_config: Callable[[dict[str, Any]], Any]
    schema: Callable[[Any], dict[str, Shape]]  # checkpoint tensors (names as the loader returns them)
    load: Callable[[Path, Any, torch.dtype, str, str], Weights]  # (dir, cfg, dtype, device, fp4_experts)
    build: Callable[[Any, Weights, EngineConfig, Any], ServedModel]  # (cfg, weights, engine, ops)
    make_pools: Callable[[Any, PoolSizes, EngineConfig], Any]
    make_tiny: Callable[..., Path]  # (out_dir, seed, **config overrides) -> the checkpoint directory
    cuda_graphs: bool = False  # whether the executor may capture its decode steps
    prompt_bos: bool = True  # raw completion prompts start with BOS (GLM's start with nothing)
    fp32_weight: Callable[[str], bool] | None = None  # kept in fp32 (sizing_layout's plan); DSV4: sizing.py


# ------------------------------------------------------------------------------------- DeepSeek-V4


def _dsv4_load(model_dir: Path, cfg: Any, dtype: torch.dtype, device: str, fp4_experts: str) -> Weights:
    from dsv4serve.models.loader import load_checkpoint
    from dsv4serve.progress import shown

    return load_checkpoint(
        model_dir, cfg, dtype=dtype, device=device, fp4_experts=fp4_experts, progress=shown
    )


def _dsv4_build(cfg: Any, weights: Weights, engine: EngineConfig, ops: Any) -> ServedModel:
    import torch

    from dsv4serve.attention.rope import RopeTables
    from dsv4serve.models.deepseek_v4 import DeepseekV4

    rope = RopeTables.build(cfg, engine.resolved_max_model_len(cfg) + 1, torch.device(engine.device))
    return DeepseekV4(cfg, weights, rope, ops)


def _dsv4_pools(cfg: Any, sizes: PoolSizes, engine: EngineConfig) -> Any:
    from dsv4serve.memory.pools import KVPools

    return KVPools(cfg, sizes, engine)


def _dsv4_schema(cfg: Any) -> dict[str, Shape]:
    from dsv4serve.models.weights import expected_tensors

    return expected_tensors(cfg)


def _dsv4_tiny(out_dir: Path | str, seed: int = 0, **overrides: Any) -> Path:
    from dsv4serve.models.tiny import make_tiny

    return make_tiny(out_dir, seed, **overrides)


# ---------------------------------------------------------------------------------- GLM-4.7-Flash


def _glm_parse(raw: dict[str, Any]) -> Any:
    from dsv4serve.models.glm4_moe_lite import GlmConfig

    return GlmConfig.from_dict(raw)


def _glm_schema(cfg: Any) -> dict[str, Shape]:
    from dsv4serve.models.glm4_moe_lite import glm_tensors

    return glm_tensors(cfg)


def _glm_load(model_dir: Path, cfg: Any, dtype: torch.dtype, device: str, fp4_experts: str) -> Weights:
    from dsv4serve.models.glm4_moe_lite import fp32_tensor, glm_tensors, is_mtp_tensor
    from dsv4serve.models.schema_loader import load_by_schema

    del fp4_experts  # GLM checkpoints are float
    return load_by_schema(
        model_dir,
        glm_tensors(cfg),
        skip=lambda name: is_mtp_tensor(name, cfg),
        fp32=fp32_tensor,
        dtype=dtype,
        device=device,
    )


def _glm_build(cfg: Any, weights: Weights, engine: EngineConfig, ops: Any) -> ServedModel:
    from dsv4serve.models.glm4_moe_lite import Glm4MoeLite

    del engine
    return Glm4MoeLite(cfg, weights, ops)


def _glm_pools(cfg: Any, sizes: PoolSizes, engine: EngineConfig) -> Any:
    from dsv4serve.memory.buffers import LayoutBuffers

    return LayoutBuffers(cfg.kv_layout, sizes, engine)


def _glm_tiny(out_dir: Path | str, seed: int = 0, **overrides: Any) -> Path:
    from dsv4serve.models.tiny_glm import make_tiny_glm

    return make_tiny_glm(out_dir, seed, **overrides)


SPECS: dict[str, ModelSpec] = {
    "deepseek_v4": ModelSpec(
        "deepseek_v4",
        ModelConfig.from_dict,
        _dsv4_schema,
        _dsv4_load,
        _dsv4_build,
        _dsv4_pools,
        _dsv4_tiny,
        cuda_graphs=True,
    ),
    "glm4_moe_lite": ModelSpec(
        "glm4_moe_lite",
        _glm_parse,
        _glm_schema,
        _glm_load,
        _glm_build,
        _glm_pools,
        _glm_tiny,
        cuda_graphs=True,
        prompt_bos=False,
        fp32_weight=lambda name: name.endswith(("e_score_correction_bias", "mlp.gate.weight")),
    ),
}
MODEL_TYPES = tuple(SPECS)


def spec_for(model_type: str) -> ModelSpec:
    spec = SPECS.get(model_type)
    if spec is None:
        raise ConfigError(f"model_type: {model_type!r} is not supported (expected one of {MODEL_TYPES})")
    return spec


def config_from_dict(raw: dict[str, Any]) -> ServedModelConfig:
    """The config of the family `raw["model_type"]` names (DeepSeek-V4 when absent)."""
    model_type = raw.get("model_type", "deepseek_v4")
    if not isinstance(model_type, str):
        raise ConfigError(f"model_type: expected a string, got {model_type!r}")
    cfg: ServedModelConfig = spec_for(model_type).parse_config(raw)
    return cfg


def config_from_json_file(file: str | Path) -> ServedModelConfig:
    return config_from_dict(read_json_object(file))


def config_from_dir(model_dir: str | Path) -> ServedModelConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigError(f"model directory {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {str(path)!r} has no config.json")
    return config_from_json_file(path / "config.json")
