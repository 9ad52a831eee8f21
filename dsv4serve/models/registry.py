"""The model registry: `model_type` -> the family's `ModelSpec`, the one place the engine lists families.

Adding a family is its package (`models/<family>/`, whose `__init__` defines the spec) and one line in
`SPECS` here, or a `register(spec)` call (tests register a toy family that way). The official configs
each family ships (`configs/*.json`) are reachable by name: `plan --config deepseek-v4-flash`.
Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from dsv4serve.config import ConfigError, read_json_object
from dsv4serve.memory.layout import ServedModelConfig
from dsv4serve.models import deepseek_v4, glm4_moe_lite
from dsv4serve.models.spec import ModelSpec

SPECS: dict[str, ModelSpec[Any]] = {
    deepseek_v4.SPEC.model_type: deepseek_v4.SPEC,
    glm4_moe_lite.SPEC.model_type: glm4_moe_lite.SPEC,
}
DEFAULT_MODEL_TYPE = deepseek_v4.SPEC.model_type  # a config.json without `model_type`


def register(spec: ModelSpec[Any]) -> None:
    """Serve `spec.model_type` with `spec` (a family outside this package)."""
    SPECS[spec.model_type] = spec


def model_types() -> tuple[str, ...]:
    return tuple(SPECS)


def spec_for(model_type: str) -> ModelSpec[Any]:
    spec = SPECS.get(model_type)
    if spec is None:
        raise ConfigError(f"model_type: {model_type!r} is not supported (expected one of {model_types()})")
    return spec


def config_from_dict(raw: dict[str, Any]) -> ServedModelConfig:
    """The config of the family `raw["model_type"]` names (DeepSeek-V4 when absent)."""
    model_type = raw.get("model_type", DEFAULT_MODEL_TYPE)
    if not isinstance(model_type, str):
        raise ConfigError(f"model_type: expected a string, got {model_type!r}")
    cfg: ServedModelConfig = spec_for(model_type).config(raw)
    return cfg


def official_configs() -> dict[str, Path]:
    """Every family's shipped official `config.json`, by name (e.g. `deepseek-v4-flash`)."""
    return {name: path for spec in SPECS.values() for name, path in spec.official_configs().items()}


def config_file(name_or_path: str | Path) -> Path:
    """An official config's file by its name (`deepseek-v4-flash`), else the path itself."""
    text = str(name_or_path)
    if "/" in text or text.endswith(".json"):
        return Path(text)
    return official_configs().get(text, Path(text))


def config_from_json_file(file: str | Path) -> ServedModelConfig:
    """The config in a `config.json` file, or an official config by name (`deepseek-v4-flash`)."""
    return config_from_dict(read_json_object(config_file(file)))


def config_from_dir(model_dir: str | Path) -> ServedModelConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigError(f"model directory {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {str(path)!r} has no config.json")
    return config_from_json_file(path / "config.json")


def with_index_quant(cfg: ServedModelConfig, index_quant: str | None) -> ServedModelConfig:
    """The config with the engine's `indexer_quant` (its index-key pool's format): only a family with a
    lightning indexer (DeepSeek-V4) takes one."""
    if index_quant is None:
        return cfg
    if "index_quant" not in {f.name for f in fields(cfg)}:  # type: ignore[arg-type]
        raise ConfigError(f"indexer_quant: {cfg.model_type} has no lightning indexer")
    return replace(cfg, index_quant=index_quant)  # type: ignore[type-var]
