"""DeepSeek-V4's config: `config.json` in either spelling, in plain numbers, and its KV layout.

`DeepseekV4Config` reads the official keys (`compress_ratios`, `num_hash_layers`, `rope_scaling`) or
the transformers keys (`layer_types`, `mlp_layer_types`, `compress_rates`, `rope_parameters`,
`partial_rotary_factor`) and gives the same result; a bad value raises `ConfigError` naming its key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from dsv4serve.config import ConfigError
from dsv4serve.memory.layout import BufferSpec, KVLayout, PoolSpec

LAYER_TYPE_TO_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}


@dataclass(frozen=True, slots=True)
class DeepseekV4Config:
    """DeepSeek-V4 architecture, in plain numbers. Field names follow the official checkpoint."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per layer; 0 = sliding window only
    num_hash_layers: int  # the first `num_hash_layers` MoE layers route by tid2eid
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float  # YaRN factor of the compress rope; 1.0 = no YaRN
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    max_position_embeddings: int
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    num_nextn_predict_layers: int = 0
    expert_dtype: str | None = None
    quantization: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    model_type: str = "deepseek_v4"
    index_quant: str | None = None  # the engine's `indexer_quant` (not config.json's): "int8" keys

    @property
    def c4_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == 4)

    @property
    def c128_layers(self) -> tuple[int, ...]:
        """The HCA layers (ratio `hca_ratio`, which is 128 in the official models)."""
        return tuple(i for i, r in enumerate(self.compress_ratios) if r not in (0, 4))

    @property
    def compress_ratio_set(self) -> tuple[int, ...]:
        """The distinct non-zero ratios, ascending (e.g. (4, 128))."""
        return tuple(sorted({r for r in self.compress_ratios if r}))

    @property
    def hca_ratio(self) -> int:
        """The heavily-compressed ratio (128 in the official models; smaller in tiny test models).

        Its pool, table and slot-message field are called `c128` whatever the value; 0 if no HCA layer.
        """
        others = [r for r in self.compress_ratio_set if r != 4]
        return others[0] if others else 0

    def layers_with_ratio(self, ratio: int) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == ratio)

    @property
    def kv_layout(self) -> KVLayout:
        """DSV4's pools: full, swa, c4, c128, c4_state, c128_state (those with no layer left out).

        The memory layer sizes, allocates and tables them from this; the model resolves its buffers
        and tables by these names (model.py).
        """
        dim, idim, hca = self.head_dim, self.index_head_dim, self.hca_ratio
        c4, c128 = self.c4_layers, self.c128_layers
        pools = [
            PoolSpec("full", "raw"),
            PoolSpec(
                "swa",
                "raw",
                window=self.sliding_window,
                buffers=(BufferSpec("swa", dim, tuple(range(self.num_layers))),),
            ),
        ]
        if c4:
            pools.append(
                PoolSpec(
                    "c4",
                    "compressed",
                    4,
                    buffers=(BufferSpec("c4", dim, c4), *self._index_buffers(idim, c4)),
                )
            )
        if hca:
            pools.append(PoolSpec("c128", "compressed", hca, buffers=(BufferSpec("c128", dim, c128),)))
        if c4:
            pools.append(
                PoolSpec(
                    "c4_state",
                    "state",
                    4,
                    buffers=(
                        BufferSpec("c4_state", 4 * dim, c4, dtype="float32"),
                        BufferSpec("c4_index_state", 4 * idim, c4, dtype="float32"),
                    ),
                )
            )
        if hca:
            pools.append(
                PoolSpec(
                    "c128_state",
                    "state",
                    hca,
                    buffers=(BufferSpec("c128_state", 2 * dim, c128, dtype="float32"),),
                )
            )
        return KVLayout(tuple(pools))

    def _index_buffers(self, idim: int, c4: tuple[int, ...]) -> tuple[BufferSpec, ...]:
        """The indexer's keys at the c4 slots: in the KV dtype, or int8 rows with an fp16 scale each."""
        if self.index_quant is None:
            return (BufferSpec("c4_index", idim, c4),)
        scales = BufferSpec("c4_index_scale", 1, c4, dtype="float16")
        return (BufferSpec("c4_index", idim, c4, dtype="int8"), scales)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        model_type = raw.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ConfigError(f"model_type: {model_type!r} is not supported (expected 'deepseek_v4')")
        num_layers = _int(raw, "num_hidden_layers")
        head_dim = _int(raw, "head_dim", 512)
        rope = _rope_fields(raw, head_dim)
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
            raise ConfigError(f"eos_token_id: expected an int or a list of ints, got {eos!r}")
        cfg = cls(
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=_int(raw, "hidden_size"),
            num_layers=num_layers,
            num_heads=_int(raw, "num_attention_heads"),
            head_dim=head_dim,
            rope_head_dim=rope.pop("rope_head_dim"),
            q_lora_rank=_int(raw, "q_lora_rank"),
            o_groups=_int(raw, "o_groups"),
            o_lora_rank=_int(raw, "o_lora_rank"),
            sliding_window=_int(raw, "sliding_window", 128),
            compress_ratios=_compress_ratios(raw, num_layers),
            num_hash_layers=_num_hash_layers(raw, num_layers),
            n_routed_experts=_int(raw, "n_routed_experts"),
            n_shared_experts=_int(raw, "n_shared_experts", 1),
            num_experts_per_tok=_int(raw, "num_experts_per_tok"),
            moe_intermediate_size=_int(raw, "moe_intermediate_size"),
            scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=_float(raw, "routed_scaling_factor", 1.0),
            swiglu_limit=_float(raw, "swiglu_limit", 10.0),
            index_n_heads=_int(raw, "index_n_heads", 64),
            index_head_dim=_int(raw, "index_head_dim", 128),
            index_topk=_int(raw, "index_topk", 512),
            hc_mult=_int(raw, "hc_mult", 4),
            hc_sinkhorn_iters=_int(raw, "hc_sinkhorn_iters", 20),
            hc_eps=_float(raw, "hc_eps", 1e-6),
            rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
            max_position_embeddings=_int(raw, "max_position_embeddings", 1048576),
            bos_token_id=_int(raw, "bos_token_id", 0),
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("torch_dtype", raw.get("dtype", "bfloat16"))),
            num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", 0),
            expert_dtype=raw.get("expert_dtype"),
            quantization=raw.get("quantization_config"),
            **rope,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Every field in range, so nothing downstream meets a value it cannot serve."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{_KEYS.get(f.name, f.name)}: expected a non-negative int, got {value!r}")
            if f.type == "float" and not (isinstance(value, float) and math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"{_KEYS.get(f.name, f.name)}: expected a positive finite number, got {value!r}"
                )
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_KEYS.get(name, name)}: must be positive, got {getattr(self, name)}")
        for name, ids in (("bos_token_id", (self.bos_token_id,)), ("eos_token_id", self.eos_token_ids)):
            if not ids or not all(isinstance(i, int) and 0 <= i < self.vocab_size for i in ids):
                raise ConfigError(f"{name}: expected token ids in [0, vocab_size), got {list(ids)}")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= self.head_dim:
            raise ConfigError(f"qk_rope_head_dim: {self.rope_head_dim} must be even and <= head_dim")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"o_groups: {self.o_groups} must divide num_attention_heads * head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("num_experts_per_tok: larger than n_routed_experts")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ConfigError(f"scoring_func: {self.scoring_func!r} is not supported")
        if self.sliding_window < 1:
            raise ConfigError(f"sliding_window: must be >= 1, got {self.sliding_window}")


_POSITIVE = (  # int fields that must be >= 1 (the rest may be 0)
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "hc_sinkhorn_iters",
    "max_position_embeddings",
    "original_max_position_embeddings",
)
_KEYS = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim",
}


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ConfigError(f"{key}: missing from config.json")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    return value


def _float(raw: dict[str, Any], key: str, default: float | None = None) -> float:
    value = raw.get(key, default)
    if value is None:
        raise ConfigError(f"{key}: missing from config.json")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    return float(value)


def _compress_ratios(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    if "layer_types" in raw and raw["layer_types"] is not None:
        types, key = raw["layer_types"], "layer_types"
        given = raw.get("compress_rates") or {}
        if not isinstance(given, dict):
            raise ConfigError(f"compress_rates: expected an object, got {given!r}")
        rates = {**{k: v for k, v in LAYER_TYPE_TO_RATIO.items() if v}, **given}
        rates["sliding_attention"] = 0
        if not isinstance(types, list) or not all(isinstance(t, str) and t in rates for t in types):
            raise ConfigError(f"layer_types: expected a list of known layer types, got {types!r}")
        ratios = [rates[t] for t in types]
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
            raise ConfigError(f"compress_rates: expected an int per layer type, got {given!r}")
    elif "compress_ratios" in raw:
        ratios, key = raw["compress_ratios"], "compress_ratios"
        if not isinstance(ratios, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in ratios
        ):
            raise ConfigError(f"compress_ratios: expected a list of ints, got {ratios!r}")
        ratios = [0 if r == 1 else r for r in ratios]  # some checkpoints spell "no compressor" as 1
    else:
        raise ConfigError("compress_ratios: missing (neither compress_ratios nor layer_types is present)")
    if len(ratios) < num_layers:
        raise ConfigError(f"{key}: {len(ratios)} entries for {num_layers} layers")
    ratios = ratios[:num_layers]  # the official list has one more entry per MTP layer
    for r in ratios:
        if r not in (0, 4) and (r < 8 or r & (r - 1)):
            raise ConfigError(f"compress_ratios: {r} is not 0, 4, or a power of two >= 8")
    if len({r for r in ratios if r not in (0, 4)}) > 1:
        raise ConfigError(f"compress_ratios: at most one heavily-compressed ratio besides 4, got {ratios}")
    if "layer_types" in raw and isinstance(raw.get("compress_ratios"), list):
        official = [0 if r == 1 else r for r in raw["compress_ratios"][:num_layers]]
        if official != ratios:
            raise ConfigError("compress_ratios: disagrees with layer_types / compress_rates")
    return tuple(ratios)


def _num_hash_layers(raw: dict[str, Any], num_layers: int) -> int:
    types = raw.get("mlp_layer_types")
    if types is None:
        return min(_int(raw, "num_hash_layers", 3), num_layers)
    if (
        not isinstance(types, list)
        or len(types) < num_layers
        or any(t not in ("hash_moe", "moe") for t in types)
    ):
        raise ConfigError(f"mlp_layer_types: expected {num_layers} of 'hash_moe' / 'moe', got {types!r}")
    n = sum(1 for t in types[:num_layers] if t == "hash_moe")
    if list(types[:n]) != ["hash_moe"] * n:
        raise ConfigError("mlp_layer_types: hash_moe layers must come first")
    return n


def _rope_fields(raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Main + compress rope from either `rope_scaling` (official) or `rope_parameters` (transformers)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, comp = params.get("main") or {}, params["compress"]
        if not isinstance(main, dict):
            raise ConfigError(f"rope_parameters.main: expected an object, got {main!r}")
        rope_theta = _float(main, "rope_theta", _float(raw, "rope_theta", 10000.0))
        compress_theta = _float(comp, "rope_theta", _float(raw, "compress_rope_theta", 160000.0))
        yarn = comp if comp.get("rope_type", comp.get("type")) == "yarn" else {}
        top = raw.get("partial_rotary_factor")  # transformers copies it into main / compress
        factor_src = comp.get("partial_rotary_factor", main.get("partial_rotary_factor", top))
    else:
        rope_theta = _float(raw, "rope_theta", 10000.0)
        compress_theta = _float(raw, "compress_rope_theta", 160000.0)
        scaling = raw.get("rope_scaling") or (params if isinstance(params, dict) else None) or {}
        if not isinstance(scaling, dict):
            raise ConfigError(f"rope_scaling: expected an object, got {scaling!r}")
        yarn = scaling if scaling.get("type", scaling.get("rope_type")) == "yarn" else {}
        factor_src = raw.get("partial_rotary_factor")
    if "qk_rope_head_dim" in raw:
        rope_head_dim = _int(raw, "qk_rope_head_dim")
    elif factor_src is not None:
        factor = _float({"partial_rotary_factor": factor_src}, "partial_rotary_factor")
        rope_head_dim = int(head_dim * factor) if math.isfinite(factor) else -1
    else:
        rope_head_dim = 64
    attention_factor = yarn.get("attention_factor", 1.0)
    if yarn and attention_factor not in (None, 1.0):
        raise ConfigError(f"rope_parameters.attention_factor: DeepSeek-V4 uses 1.0, got {attention_factor}")
    yarn = {k: v for k, v in yarn.items() if v is not None}  # a null means the default
    return {
        "rope_head_dim": rope_head_dim,
        "rope_theta": rope_theta,
        "compress_rope_theta": compress_theta,
        "rope_factor": _float(yarn, "factor", 1.0),
        "original_max_position_embeddings": _int(yarn, "original_max_position_embeddings", 65536),
        "beta_fast": _float(yarn, "beta_fast", 32.0),
        "beta_slow": _float(yarn, "beta_slow", 1.0),
    }
