"""A made-up third model family, whole in one file: the proof that a family is one spec.

ToyLM: token embeddings, then per layer a pre-norm single-head causal attention over one paged pool
(each position caches its key and value as one row, `[k | v]`) with a residual, then a final norm and
the head. Everything the engine needs of it is here: its config (with its KV layout), its weight schema,
its math, its tiny checkpoint writer and its `ModelSpec`; `registry.register(ToySpec())` serves it.
It uses only op families every model has (linear, rms_norm): the reference backend serves it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.config import ConfigError
from dsv4serve.layers.linear import Weights, plain
from dsv4serve.memory.layout import BufferSpec, KVLayout, PoolSpec
from dsv4serve.models.spec import CheckpointNames, ModelContext, ModelSpec, Schema, TensorSpec
from dsv4serve.models.tiny import copy_tokenizer, write_json, write_safetensors

MODEL_TYPE = "toy_lm"
EPS = 1e-6


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"
    model_type: str = MODEL_TYPE

    @property
    def kv_layout(self) -> KVLayout:
        """One pool: every raw position keeps its row [k | v] in every layer."""
        rows = BufferSpec("kv", 2 * self.hidden_size, tuple(range(self.num_layers)))
        return KVLayout((PoolSpec("tokens", "raw", buffers=(rows,)),))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ToyConfig:
        try:
            return cls(
                raw["vocab_size"],
                raw["hidden_size"],
                raw["num_hidden_layers"],
                raw["max_position_embeddings"],
                tuple(raw["eos_token_id"]),
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"toy config: {exc}") from None


def tensors(cfg: ToyConfig) -> Schema:
    h = cfg.hidden_size
    out: Schema = {
        "embed.weight": TensorSpec((cfg.vocab_size, h)),
        "head.weight": TensorSpec((cfg.vocab_size, h)),
    }
    out["norm.weight"] = TensorSpec((h,), fp32=True)
    for i in range(cfg.num_layers):
        out[f"layers.{i}.norm.weight"] = TensorSpec((h,), fp32=True)
        for proj in ("wq", "wk", "wv", "wo"):
            out[f"layers.{i}.{proj}.weight"] = TensorSpec((h, h), linear=True)
    return out


class ToyLM:
    """The math: pre-norm causal attention layers over the `tokens` pool."""

    def __init__(self, cfg: ToyConfig, weights: Weights, ctx: ModelContext) -> None:
        self.cfg, self.ops = cfg, ctx.ops
        self.w = {name: plain(weights, name) for name in weights}
        self.table = ctx.tables.table("tokens")  # raw position -> slot
        self.caches = ctx.cache.flat("kv")  # layer -> (slots, 2H)

    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        ops, w, h = self.ops, self.w, self.cfg.hidden_size
        rows = batch.rows[batch.token_req]  # (T,)
        write = self.table[rows, batch.positions].long()  # (T,)
        n = max(batch.max_seq_len, 1)
        keys = self.table[rows][:, :n].long()  # (T, N) slots of each token's positions 0..N-1
        visible = torch.arange(n, device=write.device)[None, :] <= batch.positions[:, None]  # (T, N)
        x = w["embed.weight"][batch.input_ids]  # (T, H)
        for i in range(self.cfg.num_layers):
            p = f"layers.{i}."
            y = ops.rms_norm(x, w[p + "norm.weight"], EPS)
            q = ops.linear(y, w[p + "wq.weight"])
            cache = self.caches[i]
            cache[write] = torch.cat(
                [ops.linear(y, w[p + "wk.weight"]), ops.linear(y, w[p + "wv.weight"])], -1
            )
            kv = cache[keys].masked_fill(~visible[..., None], 0.0)  # (T, N, 2H): selected, never multiplied
            scores = torch.einsum("th,tnh->tn", q, kv[..., :h]) / math.sqrt(h)
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            x = x + ops.linear(torch.einsum("tn,tnh->th", probs, kv[..., h:]), w[p + "wo.weight"])
        if not all_logits:
            x = x[batch.sample_index]
        return ops.linear(ops.rms_norm(x, w["norm.weight"], EPS), w["head.weight"])


def reference_logits(cfg: ToyConfig, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The same math over a whole sequence at once, no cache: the last position's logits."""
    h = cfg.hidden_size

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight

    x = weights["embed.weight"][torch.tensor(ids)]  # (L, H)
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        y = norm(x, weights[p + "norm.weight"])
        q, k, v = (y @ weights[p + f"{proj}.weight"].T for proj in ("wq", "wk", "wv"))
        probs = torch.softmax((q @ k.T / math.sqrt(h)).masked_fill(~causal, float("-inf")), -1)
        x = x + (probs @ v) @ weights[p + "wo.weight"].T
    return norm(x[-1], weights["norm.weight"]) @ weights["head.weight"].T


def make_tiny_toy(out_dir: Path | str, seed: int = 0, **overrides: Any) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = {"model_type": MODEL_TYPE, "vocab_size": 129280, "hidden_size": 16, "num_hidden_layers": 2}
    raw |= {"max_position_embeddings": 512, "eos_token_id": [1], **overrides}
    gen = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.randn(spec.shape, generator=gen)
        * (0.1 if len(spec.shape) == 1 else spec.shape[-1] ** -0.5)
        + (1.0 if name.endswith("norm.weight") else 0.0)
        for name, spec in tensors(ToyConfig.from_dict(raw)).items()
    }
    weights["head.weight"] *= 8.0  # a peaked next-token distribution: greedy ties are unlikely
    write_json(out / "config.json", raw)
    write_safetensors(weights, out)
    copy_tokenizer(out)
    return out


class ToySpec(ModelSpec[ToyConfig]):
    model_type = MODEL_TYPE

    def config(self, raw: dict[str, Any]) -> ToyConfig:
        return ToyConfig.from_dict(raw)

    def schema(self, cfg: ToyConfig) -> Schema:
        return tensors(cfg)

    def names(self, cfg: ToyConfig) -> CheckpointNames:
        return CheckpointNames(experts=re.compile(r"(?!)(.)(.)(.)"), parts={})  # no routed experts

    def build(self, cfg: ToyConfig, weights: Weights, ctx: ModelContext) -> ToyLM:
        return ToyLM(cfg, weights, ctx)

    def make_tiny(self, out_dir: Path | str, seed: int = 0, **overrides: Any) -> Path:
        return make_tiny_toy(out_dir, seed, **overrides)


def read_config(model_dir: Path) -> ToyConfig:
    return ToyConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
