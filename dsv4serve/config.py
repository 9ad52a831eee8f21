"""Frozen configuration, built once at the boundary.

`ModelConfig` reads a DeepSeek-V4 `config.json` in either spelling (official keys such as
`compress_ratios` / `num_hash_layers` / `rope_scaling`, or the transformers keys `layer_types` /
`mlp_layer_types` / `compress_rates` / `rope_parameters` / `partial_rotary_factor`) and gives the same
result. `EngineConfig` holds the serving knobs. Both raise `ConfigError` naming the offending key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

STATE_MODES = ("paged", "ring")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "npu")
DEFAULT_DTYPES = {"cpu": "float32", "cuda": "bfloat16", "npu": "bfloat16"}  # by device kind
FP4_EXPERTS = ("float", "int8")  # EngineConfig.fp4_experts
QUANTIZE_FORMATS = ("w8a8-msmodelslim", "w8a8-compressed-tensors")  # `quantize --format`


class HasPositions(Protocol):
    @property
    def max_position_embeddings(self) -> int: ...


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the key."""


def read_json_object(file: str | Path) -> dict[str, Any]:
    """A config file's JSON object, or a ConfigError naming the file."""
    try:
        raw = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read config file {str(file)!r}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(file)!r} must hold a JSON object")
    return raw


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Serving knobs.

    device: "cpu" | "cuda" | "npu" (optionally "cuda:1").
    dtype: activation/weight dtype; None picks float32 on the CPU and bfloat16 on accelerators.
    page_size: tokens per page of every paged pool (NPU kernels want 128).
    max_num_seqs: most requests running at once (= rows of the per-request tables).
    max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
    max_total_tokens: KV capacity in raw tokens (the `full` address space); the compressed pools are
        sized from it (c4 = /4, c128 = /128), SWA from the window and the step budget.
    max_model_len: longest request (prompt + output); None = the model's max_position_embeddings,
        capped at max_total_tokens.
    state_mode: compressor state layout, "paged" (own allocator, Ascend cache_mode=1) or "ring"
        (request-scoped rings, cache_mode=2).
    seed: engine-wide sampling seed used when a request gives none.
    graphs: capture decode steps as device graphs (CUDA), by batch-size and context buckets.
    weight_quant: None, or "int8" to quantize the attention and expert projections to W8A8 (dynamic
        per-token activations, per-channel weights) at load.
    fp4_experts: what official MXFP4 routed experts become at load: "float" (dequantized to `dtype`,
        exact) or "int8" (dequantized, then W8A8 per-channel int8).
    """

    device: str = "cpu"
    dtype: str | None = None
    page_size: int = 128
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_total_tokens: int = 65536
    max_model_len: int | None = None
    state_mode: str = "paged"
    seed: int = 0
    weight_quant: str | None = None
    fp4_experts: str = "float"
    graphs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or self.device.split(":")[0] not in DEVICES:
            raise ConfigError(f"device: {self.device!r} is not one of {DEVICES}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {DTYPES}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: expected a positive int, got {value!r}")
        if self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size: {self.page_size} must be a power of two")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ConfigError(f"max_model_len: expected a positive int, got {self.max_model_len!r}")
        if self.state_mode not in STATE_MODES:
            raise ConfigError(f"state_mode: {self.state_mode!r} is not one of {STATE_MODES}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed: expected an int, got {self.seed!r}")
        if not isinstance(self.graphs, bool):
            raise ConfigError(f"graphs: expected a bool, got {self.graphs!r}")
        if self.weight_quant not in (None, "int8"):
            raise ConfigError(f"weight_quant: {self.weight_quant!r} is not None or 'int8'")
        if self.fp4_experts not in FP4_EXPERTS:
            raise ConfigError(f"fp4_experts: {self.fp4_experts!r} is not one of {FP4_EXPERTS}")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return DEFAULT_DTYPES[self.device.split(":")[0]]

    def resolved_max_model_len(self, model: HasPositions) -> int:
        limit = self.max_model_len or model.max_position_embeddings
        return min(limit, model.max_position_embeddings, self.max_total_tokens)

    def with_(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)
