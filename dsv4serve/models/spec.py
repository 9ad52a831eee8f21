"""A model family as the engine sees it: one `ModelSpec`, its config and its weight schema.

A family is one package `models/<family>/` whose `__init__` defines a `ModelSpec` subclass: how its
`config.json` parses (the config carries the KV layout the memory layer works from), its checkpoint's
tensors declared once (`Schema`: shape, official storage format, the fp32 rule, which projections take
W8A8 int8), how its checkpoints name them, its math (`build`), its chat template and its tiny random
checkpoint writer. `registry.py` maps `model_type` to the spec: one line per family.

This module and a family's `__init__`, config and schema import neither torch nor transformers, so
`plan` and the command line's error paths stay fast; the rest loads inside the spec's methods.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, TypeVar

from dsv4serve.memory.layout import ServedModelConfig

if TYPE_CHECKING:
    import torch

    from dsv4serve.attention.metadata import ForwardBatch
    from dsv4serve.backends import Backend
    from dsv4serve.chat import ChatTemplate
    from dsv4serve.config import EngineConfig
    from dsv4serve.layers.linear import Weights
    from dsv4serve.layers.parallel import Shard
    from dsv4serve.memory.buffers import LayoutBuffers
    from dsv4serve.memory.tables import SlotTables

Shape = tuple[int, ...]
# How the official checkpoint stores a tensor: bf16, fp32, int64, FP8 e4m3 with a ue8m0 scale per
# 128x128 block, or MXFP4 (e2m1 pairs, an e8m0 scale per 32).
DiskFormat = Literal["bf16", "fp32", "int64", "fp8", "mxfp4"]
# How tensor parallelism splits a tensor over its ranks: output rows (column-parallel), input columns
# (row-parallel: the partial products are summed), or not at all (every rank holds it whole).
Split = Literal["rows", "cols"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One checkpoint tensor, declared once: what the loader checks and keeps, `plan` counts, the tiny
    writer and `quantize` write."""

    shape: Shape
    disk: DiskFormat = "bf16"
    fp32: bool = False  # kept in fp32 in memory whatever the engine dtype (int64 stays int64)
    int8: bool = False  # a projection the model math takes as W8A8 int8 (`Int8Weight`)
    linear: bool = False  # the weight of a Linear module (a compressed-tensors `Linear` target)
    group: str = "other"  # `plan`'s breakdown of the weights
    split: Split | None = None  # its rank's share under tensor parallelism (None: whole on every rank)
    split_unit: int = 1  # rows / columns kept together (one head's); a routed expert is split whole
    # over the ranks with expert parallelism, else its intermediate by `split`


Schema = dict[str, TensorSpec]  # tensor name (as the family's loader names it) -> its spec


class CheckpointError(ValueError):
    """A checkpoint is unreadable or does not match its schema; the message names the files or tensors."""


@dataclass(frozen=True)
class CheckpointNames:
    """How a family's checkpoint files name their tensors. Names lose a leading `model.` first."""

    experts: re.Pattern[str]  # a routed expert's tensor: groups (stem, expert index, part)
    parts: dict[str, str]  # part -> the stacked tensor's leaf: w1 (gate), w2 (down), w3 (up)
    skip: Callable[[str], bool] = lambda name: False  # tensors the engine does not read (MTP)
    rename: Callable[[str], str] = lambda name: name  # another writer's name -> the schema's
    # a file's tensor holding every expert -> per-expert (name, expert, first row, end row), else None
    split: Callable[[str, Shape], list[tuple[str, int, int, int]] | None] = lambda name, shape: None

    def expert(self, name: str) -> tuple[str, int] | None:
        """A routed expert's tensor -> (its stacked tensor's name, its expert index); else None."""
        m = self.experts.match(name)
        return (f"{m[1]}.{self.parts[m[3]]}", int(m[2])) if m else None


class ServedModel(Protocol):
    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits (S, vocab) of the tokens that sample, or (T, vocab) of every token."""
        ...


@dataclass(frozen=True)
class ModelContext:
    """What a model is built over besides its config and weights: the engine's knobs, the backend's op
    families, and the KV cache's buffers and slot tables (which the model resolves once, by the pool
    and buffer names its layout declares)."""

    engine: EngineConfig
    ops: Backend
    cache: LayoutBuffers
    tables: SlotTables
    shard: Shard = field(default_factory=lambda: _one_rank())  # this rank's share (tensor parallel)


def _one_rank() -> Shard:
    from dsv4serve.layers.parallel import Shard

    return Shard()


C = TypeVar("C", bound=ServedModelConfig)


class ModelSpec(ABC, Generic[C]):
    """Everything the engine knows of one model family."""

    model_type: ClassVar[str]
    prompt_bos: ClassVar[bool] = True  # raw completion prompts start with BOS
    msmodelslim_float: ClassVar[tuple[str, ...]] = ()  # int8-able projections msModelSlim keeps float

    @abstractmethod
    def config(self, raw: dict[str, Any]) -> C:
        """The family's config from a `config.json` object (ConfigError naming a bad key)."""

    @abstractmethod
    def schema(self, cfg: C) -> Schema:
        """Every tensor of a checkpoint, experts one by one as on disk."""

    @abstractmethod
    def names(self, cfg: C) -> CheckpointNames: ...

    @abstractmethod
    def build(self, cfg: C, weights: Weights, ctx: ModelContext) -> ServedModel:
        """The model over loaded weights (experts stacked: `loader.load_weights`)."""

    def check_weights(self, cfg: C, weights: Weights) -> None:
        """Checks of loaded values beyond shapes and dtypes (CheckpointError); none by default."""

    @abstractmethod
    def make_tiny(self, out_dir: Path | str, seed: int = 0, **overrides: Any) -> Path:
        """A random tiny checkpoint (config, tokenizer, weights) written to `out_dir`."""

    def chat_template(self, model_dir: Path) -> ChatTemplate:
        """The chat template of a checkpoint directory (by default none: chat requests are refused)."""
        from dsv4serve.chat import NoTemplate

        return NoTemplate(self.model_type)

    def official_configs(self) -> dict[str, Path]:
        """The official `config.json`s shipped in the family's `configs/` folder, by name."""
        try:
            folder = resources.files(type(self).__module__).joinpath("configs")
        except TypeError:  # a spec defined in a plain module (a test's): no configs folder
            return {}
        if not folder.is_dir():
            return {}
        return {
            f.name.removesuffix(".json"): Path(str(f)) for f in folder.iterdir() if f.name.endswith(".json")
        }
