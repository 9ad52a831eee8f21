"""The engine's knobs (`EngineConfig`, frozen, built once at the boundary) and `ConfigError`.

A model family's config (its `config.json`) is the family's own (models/<family>/config.py).
"""

from __future__ import annotations

import json
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

STATE_MODES = ("paged", "ring")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "npu")
DEFAULT_DTYPES = {"cpu": "float32", "cuda": "bfloat16", "npu": "bfloat16"}  # by device kind
FP4_EXPERTS = ("float", "int8", "mxfp4")  # EngineConfig.fp4_experts
FP8_LINEARS = ("float", "fp8")  # EngineConfig.fp8_linears
QUANTIZE_FORMATS = ("w8a8-msmodelslim", "w8a8-compressed-tensors")  # `quantize --format`
CPU_MAX_TOTAL_TOKENS = 65536  # the cpu's KV capacity unless max_total_tokens says otherwise


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


def knob(default: Any, help: str, *, choices: tuple[str, ...] | None = None, positive: bool = False) -> Any:
    """An EngineConfig field: its default, the help text its command-line flag shows, its choices, and
    whether an int must be >= 1."""
    return field(default=default, metadata={"help": help, "choices": choices, "positive": positive})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Serving knobs, the one place each is declared: every field is a keyword of `Engine` and
    `AsyncEngine` and a command-line flag (`max_num_seqs` -> `--max-num-seqs`; a bool that is on by
    default -> `--no-graphs`), with the help text and default written here. A bad value raises
    ConfigError naming the field."""

    device: str = knob("cpu", "cpu, cuda, cuda:N or npu")
    dtype: str | None = knob(
        None, "activations and weights (default: float32 on cpu, else bfloat16)", choices=DTYPES
    )
    page_size: int = knob(128, "tokens per page of every paged pool, a power of two", positive=True)
    max_num_seqs: int = knob(64, "most requests running at once", positive=True)
    max_num_batched_tokens: int = knob(2048, "token budget of one step", positive=True)
    max_total_tokens: int | None = knob(
        None,
        "KV capacity in raw tokens, every other pool sized from it (default: what gpu_memory_utilization "
        f"leaves on a cuda or npu device, {CPU_MAX_TOTAL_TOKENS} on the cpu)",
        positive=True,
    )
    gpu_memory_utilization: float = knob(
        0.9, "share of the device's memory the engine may fill (weights, activations, graphs, KV)"
    )
    max_model_len: int | None = knob(
        None,
        "longest request, prompt + output (default: the model's, capped at max_total_tokens)",
        positive=True,
    )
    state_mode: str = knob(
        "paged", "compressor state: paged (own allocator) or ring (request-scoped)", choices=STATE_MODES
    )
    seed: int = knob(0, "engine sampling seed (for requests that give none)")
    weight_quant: str | None = knob(None, "quantize the W8A8 projections at load", choices=("int8",))
    fp4_experts: str = knob(
        "float",
        "official MXFP4 experts: dequantized (exact), as int8, or kept packed (mxfp4: W4A16)",
        choices=FP4_EXPERTS,
    )
    fp8_linears: str = knob(
        "float",
        "official FP8 linears: dequantized at load, or kept as FP8 blocks (fp8: W8A8)",
        choices=FP8_LINEARS,
    )
    indexer_quant: str | None = knob(
        None,
        "DeepSeek-V4's lightning indexer in int8, as Ascend serves it: keys and queries Hadamard-rotated "
        "and quantized per token (cpu and npu devices)",
        choices=("int8",),
    )
    graphs: bool = knob(True, "capture decode steps as device graphs (CUDA)")
    tensor_parallel_size: int = knob(
        1,
        "ranks that split each layer (heads, MLP intermediates): processes on devices N..N+TP-1",
        positive=True,
    )
    data_parallel_size: int = knob(
        1, "engine cores (processes), each with its own requests and KV, behind one front door", positive=True
    )
    expert_parallel_size: int = knob(
        1,
        "ranks that split the routed experts whole: 1 (each rank a slice of every expert) or TP x DP",
        positive=True,
    )
    expert_dispatch: str = knob(
        "gather",
        "experts spread over data-parallel cores: every core's tokens all-gathered and the outputs "
        "reduce-scattered (gather), or each token sent only to its experts' ranks (all_to_all; "
        "tensor_parallel_size 1)",
        choices=("gather", "all_to_all"),
    )
    nnodes: int = knob(
        1,
        "hosts the engine spans: tensor_parallel_size / nnodes ranks of its one core on each, or (with "
        "data_parallel_size > 1) data_parallel_size / nnodes cores each (host 0 serves, the others run "
        "`dsv4serve ranks`)",
        positive=True,
    )
    node_rank: int = knob(0, "this host's index among nnodes (`dsv4serve ranks` on hosts 1 ..)")
    master_addr: str = knob("127.0.0.1", "host 0's address, where the ranks of several hosts meet")
    master_port: int = knob(
        0,
        "host 0's port where the ranks of several hosts meet (the next ones: its ranks' links, or front f's "
        "cores at + 1 + f); 0: a free one, one host only",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_knob(f, getattr(self, f.name))
        if self.device.split(":")[0] not in DEVICES:
            raise ConfigError(f"device: {self.device!r} is not one of {DEVICES}")
        if self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size: {self.page_size} must be a power of two")
        ranks = self.tensor_parallel_size * self.data_parallel_size
        if self.expert_parallel_size not in (1, ranks):
            raise ConfigError(
                f"expert_parallel_size: {self.expert_parallel_size} must be 1 or tensor_parallel_size x "
                f"data_parallel_size ({ranks})"
            )
        if self.expert_dispatch == "all_to_all" and self.tensor_parallel_size > 1:
            raise ConfigError("expert_dispatch: all_to_all needs tensor_parallel_size 1")
        if self.nnodes > 1:
            tp, dp = self.tensor_parallel_size, self.data_parallel_size
            if (tp % self.nnodes if dp == 1 else dp % self.nnodes) or (dp > 1 and dp < self.nnodes):
                raise ConfigError(
                    f"nnodes: {self.nnodes} hosts split tensor_parallel_size ({tp}) evenly with "
                    f"data_parallel_size 1, or data_parallel_size ({dp}) evenly (each core's "
                    "tensor-parallel ranks on its host)"
                )
            if not 0 < self.master_port < 65535:
                raise ConfigError(f"master_port: several hosts need a port, got {self.master_port}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank: {self.node_rank} is not in [0, nnodes {self.nnodes})")
        if self.indexer_quant is not None and self.device.startswith("cuda"):
            raise ConfigError(
                "indexer_quant: int8 index keys are Ascend's format; the cuda backend's indexer kernels "
                "read them in the model's dtype (use device cpu or npu)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization: expected a number in (0, 1], got {self.gpu_memory_utilization!r}"
            )

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each host: the engine's tensor_parallel_size x data_parallel_size over nnodes."""
        return self.tensor_parallel_size * self.data_parallel_size // self.nnodes

    @property
    def tp_spans_hosts(self) -> bool:
        """Tensor parallelism over several hosts (one core; host 0 its leader, the others its ranks)."""
        return self.nnodes > 1 and self.data_parallel_size == 1

    @property
    def host_cores(self) -> range:
        """The data-parallel ranks whose engine cores run on this host (node_rank): every one on one host;
        with tensor parallelism over hosts, the only core, on host 0; with data parallelism over hosts,
        data_parallel_size / nnodes each, in order (each core's tensor-parallel ranks beside it)."""
        if self.tp_spans_hosts:
            return range(1 if self.node_rank == 0 else 0)
        per = self.data_parallel_size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return DEFAULT_DTYPES[self.device.split(":")[0]]

    @property
    def kv_tokens(self) -> int:
        """max_total_tokens, once sized (`executor.runner.sized_engine` sizes an engine that left it out)."""
        assert self.max_total_tokens is not None, "the KV capacity is sized when the model loads"
        return self.max_total_tokens

    def resolved_max_model_len(self, model: HasPositions) -> int:
        limit = self.max_model_len or model.max_position_embeddings
        return min(limit, model.max_position_embeddings, self.kv_tokens)

    def with_(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)


_TYPES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "int": (int, "an int"),
    "float": ((int, float), "a number"),
    "str": (str, "a string"),
    "bool": (bool, "a bool"),
}


def _check_knob(f: Field[Any], value: Any) -> None:
    kind, what = _TYPES[str(f.type).removesuffix(" | None")]
    if value is None and str(f.type).endswith(" | None"):
        return
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{f.name}: expected {what}, got {value!r}")
    if f.metadata["positive"] and value < 1:  # type: ignore[operator]
        raise ConfigError(f"{f.name}: expected a positive int, got {value!r}")
    if f.metadata["choices"] and value not in f.metadata["choices"]:
        raise ConfigError(f"{f.name}: {value!r} is not one of {f.metadata['choices']}")
