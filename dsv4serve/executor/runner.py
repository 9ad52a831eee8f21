"""The executor's sync core: weights, device pools, slot tables, one forward + sampling per step.

Owned by the executor actor (which calls it in a worker thread); tests drive it directly.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv4serve.attention.metadata import BatchItem, ForwardBatch, build_forward_batch
from dsv4serve.attention.rope import RopeTables
from dsv4serve.backend import Backend
from dsv4serve.config import EngineConfig, ModelConfig
from dsv4serve.executor.backends import select_backend
from dsv4serve.executor.graphs import DecodeGraphs
from dsv4serve.executor.sampling import SamplingBatch, sample
from dsv4serve.memory.paged import PoolSizes
from dsv4serve.memory.pools import KVPools
from dsv4serve.memory.tables import SlotTables, write_cache_locs_batch
from dsv4serve.models.deepseek_v4 import DeepseekV4
from dsv4serve.models.loader import load_checkpoint
from dsv4serve.protocol import CacheLocs, SampledToken, StepItem, StepPlan
from dsv4serve.quant import Weight, quantize_weights_int8


@dataclass(frozen=True)
class StepResult:
    outputs: tuple[SampledToken, ...]
    logits: torch.Tensor | None = None  # (S, V), or (T, V) with all_logits; only when asked


def request_seed(rid: str, seed: int | None, engine_seed: int) -> int:
    """The sampling seed of a request: its own, else a stable mix of the engine seed and its id."""
    if seed is not None:
        return seed
    return engine_seed ^ zlib.crc32(rid.encode())


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        engine: EngineConfig,
        sizes: PoolSizes | None = None,
        ops: Backend | None = None,
    ) -> None:
        """Load a checkpoint; `ops` overrides the device's backend (tests run Triton's on CPU tensors)."""
        cfg = ModelConfig.from_dir(model_dir)
        dtype = getattr(torch, engine.torch_dtype_name)
        weights = load_checkpoint(Path(model_dir), cfg, dtype=dtype, device=engine.device)
        self._build(cfg, weights, engine, sizes, ops)

    @classmethod
    def from_weights(
        cls,
        cfg: ModelConfig,
        weights: dict[str, Weight],
        engine: EngineConfig,
        sizes: PoolSizes | None = None,
        ops: Backend | None = None,
    ) -> ModelRunner:
        """A runner over weights already on the device, by official name (benchmarks build random ones)."""
        runner = cls.__new__(cls)
        runner._build(cfg, weights, engine, sizes, ops)
        return runner

    def _build(
        self,
        cfg: ModelConfig,
        weights: dict[str, Weight],
        engine: EngineConfig,
        sizes: PoolSizes | None,
        ops: Backend | None,
    ) -> None:
        self.engine, self.model_cfg = engine, cfg
        self.device = torch.device(engine.device)
        self.dtype = getattr(torch, engine.torch_dtype_name)
        self.ops: Backend = ops or select_backend(engine.device)
        self.sizes = sizes or PoolSizes.for_engine(cfg, engine)
        self.pools = KVPools(cfg, self.sizes, engine)
        self.tables = SlotTables(cfg, engine, self.device)
        if engine.weight_quant == "int8":
            weights = quantize_weights_int8(weights)
        rope = RopeTables.build(cfg, engine.resolved_max_model_len(cfg) + 1, self.device)
        self.model = DeepseekV4(cfg, weights, rope, self.ops)
        self.ratios = cfg.compress_ratio_set
        self.tables.point_pad_row_at({p: self.pools.state_sentinel[p] for p in ("c4_state", "c128_state")})
        self.graphs: DecodeGraphs | None = None
        if engine.graphs and self.device.type == "cuda":
            max_len = engine.resolved_max_model_len(cfg)
            self.graphs = DecodeGraphs(
                self._forward_sample,
                self.ratios,
                engine.max_num_seqs,
                max_len,
                self.tables.pad_row,
                self.device,
            )

    def _forward_sample(
        self, batch: ForwardBatch, params: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A whole decode step on the device (what a graph captures): logits, then sampling."""
        logits = self.model.forward(batch, self.pools, self.tables)
        tokens, logprobs = sample(logits, params)
        return tokens, logprobs, logits

    def write_locs(self, locs: Sequence[CacheLocs]) -> None:
        write_cache_locs_batch(self.tables, locs)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, all_logits: bool = False, keep_logits: bool = False) -> StepResult:
        assert all(i.row >= 0 for i in plan.items), "every item needs its table row"
        key = self.graphs.key(plan.items) if self.graphs is not None else None
        if key is not None and self.graphs is not None:  # a decode step: every token samples
            seeds = [request_seed(i.rid, i.sampling.seed, self.engine.seed) for i in plan.items]
            ids, lps, kept = self.graphs.run(key, plan.items, seeds, keep_logits)
            return StepResult(self._outputs(plan.items, ids, lps), kept)
        items = [BatchItem(i.row, i.prefix_len, i.token_ids, i.sample) for i in plan.items]
        batch = build_forward_batch(items, self.ratios, self.device)
        logits = self.model.forward(batch, self.pools, self.tables, all_logits=all_logits)
        sampled = [i for i in plan.items if i.sample]
        if not sampled:
            return StepResult((), logits if keep_logits else None)
        rows = logits if not all_logits else logits[batch.sample_index]
        params = SamplingBatch.build(
            [i.sampling.temperature for i in sampled],
            [i.sampling.top_p for i in sampled],
            [i.sampling.top_k for i in sampled],
            [request_seed(i.rid, i.sampling.seed, self.engine.seed) for i in sampled],
            [i.seq_len for i in sampled],
            self.device,
            want_logprobs=any(i.sampling.logprobs for i in sampled),
        )
        tokens, logprobs = sample(rows, params)
        return StepResult(
            self._outputs(sampled, tokens.tolist(), logprobs.tolist()), logits if keep_logits else None
        )

    @staticmethod
    def _outputs(
        sampled: Sequence[StepItem], tokens: Sequence[int], logprobs: Sequence[float]
    ) -> tuple[SampledToken, ...]:
        return tuple(
            SampledToken(rid=i.rid, token_id=t, logprob=lp if i.sampling.logprobs else None)
            for i, t, lp in zip(sampled, tokens, logprobs, strict=True)
        )
