"""The executor's sync core: weights, device pools, slot tables, one forward + sampling per step.

Owned by the executor actor (which calls it in a worker thread); tests drive it directly.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.backends import Backend, HostCopy, Transfers, select
from dsv4serve.config import CPU_MAX_TOTAL_TOKENS, ConfigError, EngineConfig
from dsv4serve.executor.grammar import Grammars
from dsv4serve.executor.graphs import DecodeGraphs, GraphKey
from dsv4serve.executor.inputs import SamplingFlags, host_words, spans
from dsv4serve.executor.processing import LogitProcessing, Prepared
from dsv4serve.executor.ranks import (
    Followers,
    Joined,
    Lockstep,
    Place,
    agree_min,
    idle_plan,
    join_group,
    leave_group,
)
from dsv4serve.executor.sampling import SamplingBatch, sample, top_logprobs
from dsv4serve.layers.linear import Weight, quantize_weights_int8, resident_bytes
from dsv4serve.layers.parallel import Shard
from dsv4serve.memory.buffers import LayoutBuffers
from dsv4serve.memory.layout import ServedModelConfig
from dsv4serve.memory.paged import PoolSizes
from dsv4serve.memory.sizing import GIB, activation_reserve, engine_pool_sizes, kv_budget, kv_tokens_for
from dsv4serve.memory.tables import SlotTables, write_cache_locs_batch
from dsv4serve.models.loader import load_weights, loaded_schema
from dsv4serve.models.progress import shown
from dsv4serve.models.registry import config_from_dir, spec_for, with_index_quant
from dsv4serve.models.spec import ModelContext, ModelSpec
from dsv4serve.protocol import (
    CacheLocs,
    RankLaunch,
    RankWriteLocs,
    SampledToken,
    StepItem,
    StepPlan,
    TopLogprob,
)


@dataclass(frozen=True)
class StepResult:
    outputs: tuple[SampledToken, ...]
    logits: torch.Tensor | None = None  # (S, V), or (T, V) with all_logits; only when asked


@dataclass(frozen=True)
class PendingStep:
    """A step queued on the device. `wait()` blocks until its ids are on the host (the GIL is
    released meanwhile) and returns the step's result (later calls return the same result: the host
    buffer of the copy may serve a later step after the first)."""

    sampled: tuple[StepItem, ...]
    copy: HostCopy  # of the (2 + 2k, S) float64 outputs: ids, logprobs, k top ids, k top logprobs
    logits: torch.Tensor | None
    result: list[StepResult] = dataclasses.field(default_factory=list)  # filled by the first wait()

    @classmethod
    def of(
        cls, sampled: Sequence[StepItem], out: torch.Tensor, logits: torch.Tensor | None, transfers: Transfers
    ) -> PendingStep:
        return cls(tuple(sampled), transfers.download(out), logits)

    def ready(self) -> bool:
        """Whether `wait()` would return at once (the step's outputs are on the host)."""
        return bool(self.result) or self.copy.ready()

    def wait(self) -> StepResult:
        if self.result:  # a second call: the buffer may already serve a later step
            return self.result[0]
        rows, columns = self.copy.read(lambda host: (host.shape[0], host.T.tolist()))  # (S, 2 + 2k)
        k = (rows - 2) // 2
        outputs = tuple(_sampled(i, c, k) for i, c in zip(self.sampled, columns, strict=True))
        self.result.append(StepResult(outputs, self.logits))
        return self.result[0]


def _sampled(item: StepItem, out: list[float], k: int) -> SampledToken:
    """One request's SampledToken from its column of a step's output (ids, logprob, k top pairs)."""
    spec = item.sampling
    n = min(spec.top_logprobs, k)
    top = tuple(TopLogprob(int(out[2 + j]), out[2 + k + j]) for j in range(n)) if n else None
    return SampledToken(
        rid=item.rid, token_id=int(out[0]), logprob=out[1] if spec.logprobs else None, top_logprobs=top
    )


def sized_engine(
    engine: EngineConfig, model: ServedModelConfig, memory: tuple[int, int] | None, workspace: int = 0
) -> EngineConfig:
    """`engine` with its KV capacity decided: its own max_total_tokens, else (a device with memory of its
    own, `memory` = (free, total) bytes with the weights loaded) what gpu_memory_utilization leaves
    beside `workspace` bytes the backend's ops take for a while (`Backend.workspace`), else the cpu's
    default."""
    if engine.max_total_tokens is not None:
        return engine
    if memory is None:
        return engine.with_(max_total_tokens=CPU_MAX_TOTAL_TOKENS)
    free, total = memory
    budget = kv_budget(model, engine, free, total) - workspace
    tokens = kv_tokens_for(model, engine, budget)
    if tokens < engine.max_num_batched_tokens:
        raise ConfigError(
            f"gpu_memory_utilization: {engine.gpu_memory_utilization} of {total / GIB:.1f} GiB, less "
            f"{(total - free) / GIB:.1f} GiB in use (weights, other processes) and "
            f"{activation_reserve(model, engine) / GIB:.1f} GiB for activations"
            + (f" and {workspace / GIB:.1f} GiB of op workspace" if workspace else "")
            + f", leaves {budget / GIB:.2f} "
            f"GiB for the KV: {tokens} tokens, fewer than max_num_batched_tokens "
            f"({engine.max_num_batched_tokens}); raise it, or set max_total_tokens"
        )
    return engine.with_(max_total_tokens=tokens)


def request_seed(rid: str, seed: int | None, engine_seed: int) -> int:
    """The sampling seed of a request: its own, else a stable mix of the engine seed and its id."""
    if seed is not None:
        return seed
    return engine_seed ^ zlib.crc32(rid.encode())


class ModelRunner:
    followers: Followers | None  # this core's other tensor-parallel ranks (its leader's)
    lockstep: Lockstep | None  # steps in lockstep with the other data-parallel cores (their leaders')
    tables: SlotTables

    def __init__(
        self,
        model_dir: str | Path,
        engine: EngineConfig,
        sizes: PoolSizes | None = None,
        ops: Backend | None = None,
        place: Place | None = None,
    ) -> None:
        """Load a checkpoint; `ops` overrides the device's backend (tests run Triton's on CPU tensors).
        Several ranks (tensor_parallel_size or data_parallel_size > 1, `ranks.py`): a core's leader
        (tp_rank 0; `place` None for the only core) starts its other tensor-parallel ranks, each of which
        builds its own runner at its `place`; every rank holds its share."""
        cfg = with_index_quant(config_from_dir(model_dir), engine.indexer_quant)
        ops = ops or select(engine.device)  # a device this machine lacks fails before any weight loads
        followers = None
        if engine.tensor_parallel_size * engine.data_parallel_size > 1:
            place = place or Place.first(engine)
            if place.tp_rank == 0 and engine.tensor_parallel_size > 1:
                followers = Followers.start(str(model_dir), engine, place)
            try:
                self._load(cfg, model_dir, engine, sizes, ops, place, followers)
            except BaseException:
                if followers is not None:  # none of them may outlive a leader that failed to start
                    followers.kill()
                raise
            return
        self._load(cfg, model_dir, engine, sizes, ops, None, None)

    def _load(
        self,
        cfg: ServedModelConfig,
        model_dir: str | Path,
        engine: EngineConfig,
        sizes: PoolSizes | None,
        ops: Backend,
        place: Place | None,
        followers: Followers | None,
    ) -> None:
        """Join the engine's ranks (at `place`, if several), load this rank's share and build on it."""
        joined = Joined(Shard())
        if place is not None:
            joined = join_group(engine, ops.collectives, place)
            engine = engine.with_(device=place.device(engine))
            if joined.leaders is not None:  # steps in lockstep with the other cores: no device graphs
                engine = engine.with_(graphs=False)
        shard = joined.shard
        dtype = getattr(torch, engine.torch_dtype_name)
        spec = spec_for(cfg.model_type)
        weights = load_weights(
            model_dir,
            spec,
            cfg,
            dtype=dtype,
            device=engine.device,
            fp4_experts=engine.fp4_experts,
            fp8_linears=engine.fp8_linears,
            progress=shown,
            shard=shard,
        )
        self._build(cfg, weights, engine, sizes, ops, Path(model_dir), shard)
        self.followers = followers
        if followers is not None:
            followers.wait_ready()
        if joined.leaders is not None and place is not None and place.tp_rank == 0:
            idle = idle_plan(self.tables.pad_row)
            self.lockstep = Lockstep(joined.leaders, self._launch_everywhere, idle)

    @classmethod
    def from_weights(
        cls,
        cfg: ServedModelConfig,
        weights: dict[str, Weight],
        engine: EngineConfig,
        sizes: PoolSizes | None = None,
        ops: Backend | None = None,
    ) -> ModelRunner:
        """A runner over weights already on the device, by schema name (benchmarks build random ones)."""
        runner = cls.__new__(cls)
        runner._build(cfg, weights, engine, sizes, ops, None, Shard())
        return runner

    def _build(
        self,
        cfg: ServedModelConfig,
        weights: dict[str, Weight],
        engine: EngineConfig,
        sizes: PoolSizes | None,
        ops: Backend | None,
        model_dir: Path | None,  # its tokenizer serves structured output (None: none is served)
        shard: Shard,
    ) -> None:
        self.device = torch.device(engine.device)
        self.ops: Backend = ops or select(engine.device)
        self.followers = self.lockstep = None
        spec = spec_for(cfg.model_type)
        if engine.weight_quant == "int8":
            weights = quantize_weights_int8(weights, _int8_names(spec, cfg))
        self.weight_bytes = resident_bytes(weights)  # by format, as held on the device
        memory = self.ops.transfers.memory(self.device)  # the weights in place
        engine = sized_engine(engine, cfg, memory, self.ops.workspace(weights))
        if shard.size > 1:  # what every rank can hold
            engine = engine.with_(max_total_tokens=agree_min(engine.kv_tokens, self.device))
        self.engine, self.model_cfg = engine, cfg
        self.sizes = sizes or engine_pool_sizes(cfg, engine)
        self.cache = LayoutBuffers(cfg.kv_layout, self.sizes, engine)
        self.tables = SlotTables(cfg, engine, self.device, self.ops.transfers.upload)
        self.tables.point_pad_row_at(self.cache.state_sentinel)
        context = ModelContext(engine, self.ops, self.cache, self.tables, shard)
        self.model = spec.build(cfg, weights, context)
        compressed = [p.ratio for p in cfg.kv_layout.pools if p.index == "compressed"]
        self.ratios = tuple(sorted(compressed))
        self.last_tokens = torch.zeros(engine.max_num_seqs + 1, dtype=torch.int64, device=self.device)
        grammars = Grammars(model_dir, cfg.vocab_size, cfg.eos_token_ids)
        self.processing = LogitProcessing(engine.max_num_seqs + 1, cfg.eos_token_ids, self.device, grammars)
        self.graphs: DecodeGraphs | None = None
        self._last_key: tuple[StepPlan | None, GraphKey | None] = (None, None)
        if engine.graphs and self.ops.graphs is not None and self.ops.graphs.supports(self.device):
            max_len = engine.resolved_max_model_len(cfg)
            self.graphs = DecodeGraphs(
                self._forward_sample,
                self.ops,
                self.ratios,
                engine.max_num_seqs,
                max_len,
                self.tables.pad_row,
                self.device,
                (cfg.vocab_size, getattr(torch, engine.torch_dtype_name)),
            )
            self.graphs.capture(self.graphs.startup_keys())  # every rank alike, in the same order

    def _forward_sample(
        self, batch: ForwardBatch, params: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole decode step on the device (what a graph captures): (2 + 2k, S) outputs, logits."""
        batch = self._lookahead_inputs(batch)
        logits = self.model.forward(batch)
        return self._sample(batch, logits, params), logits

    def _lookahead_inputs(self, batch: ForwardBatch) -> ForwardBatch:
        """Input ids with every LOOKAHEAD replaced by the token its request's previous step sampled."""
        ids = batch.input_ids
        kept = self.last_tokens[batch.rows[batch.token_req]]  # (T,)
        return dataclasses.replace(batch, input_ids=torch.where(ids >= 0, ids, kept))

    def _sample(
        self,
        batch: ForwardBatch,
        logits: torch.Tensor,
        params: SamplingBatch,
        processing: Prepared | None = None,
    ) -> torch.Tensor:
        """Sample the rows (S, V), remember each request's token (a lookahead's input), and return
        (2 + 2k, S) float64: ids, logprobs, then k = params.num_top rows of top ids and of top logprobs.
        `processing`: the step's logit processing (rows among the sampled ones)."""
        chosen_from = None if processing is None else self.processing.apply(logits, processing)
        tokens, logprobs = sample(logits, params, chosen_from)
        if processing is not None:
            self.processing.record(processing, tokens)
        self.last_tokens[batch.rows[batch.token_req[batch.sample_index]]] = tokens
        rows = [tokens[None].double(), logprobs[None].double()]
        if params.num_top:
            top_ids, top_lps = top_logprobs(logits, params.num_top)  # (S, k)
            rows += [top_ids.T.double(), top_lps.T.double()]
        return torch.cat(rows)

    def write_locs(self, locs: Sequence[CacheLocs]) -> None:
        if self.followers is not None:
            self.followers.send(RankWriteLocs(tuple(locs)))
        write_cache_locs_batch(self.tables, locs)

    def close(self, abort: bool = False) -> None:
        """Stop stepping with the other cores (`abort`: at once, the engine stopping on an error;
        else once every core is done), then the core's other ranks, if any; then it leaves the group."""
        if self.lockstep is not None:
            self.lockstep.close(abort)
            self.lockstep = None
        if self.followers is not None:
            self.followers.close()
            self.followers = None
        leave_group()

    def replays(self, plan: StepPlan) -> bool:
        """Whether `launch(plan)` replays a graph already captured: an upload and a graph launch, a
        short host call (no forward in Python, no capture, no logit processing to prepare)."""
        key = self._graph_key(plan)
        if key is None or self.graphs is None or key not in self.graphs.graphs:
            return False
        return not any(i.sampling.processes_logits for i in plan.items)

    def _graph_key(self, plan: StepPlan) -> GraphKey | None:
        """The graph `plan` replays (None: eager), computed once for `replays` and `launch` of a plan
        (the last plan's key is kept, one atomic tuple: `replays` runs on the trio thread)."""
        last_plan, last_key = self._last_key
        if last_plan is plan:
            return last_key
        key = self.graphs.key(plan.items) if self.graphs is not None else None
        self._last_key = (plan, key)
        return key

    def execute(self, plan: StepPlan, all_logits: bool = False, keep_logits: bool = False) -> StepResult:
        return self.launch(plan, all_logits, keep_logits).wait()

    def launch(self, plan: StepPlan, all_logits: bool = False, keep_logits: bool = False) -> PendingStep:
        """Queue the step on the device (and on the other ranks, which run it on their shares) and return
        at once; `wait()` on the result gives its tokens. Under tensor parallelism a step that fails
        leaves the ranks out of step: RanksBroken. With the experts spread over the data-parallel
        cores, the step waits for the cores' next common step (`Lockstep`)."""
        if self.lockstep is not None:
            return self.lockstep.launch(plan, all_logits, keep_logits)
        return self._launch_everywhere(plan, all_logits, keep_logits)

    def _launch_everywhere(self, plan: StepPlan, all_logits: bool, keep_logits: bool) -> PendingStep:
        """The step on this core's other ranks (in order), then on this one."""
        if self.followers is None:
            return self._launch(plan, all_logits, keep_logits)
        self.followers.send(RankLaunch(plan=plan, all_logits=all_logits), plan.step)
        try:
            return self._launch(plan, all_logits, keep_logits)
        except Exception as exc:
            raise self.followers.failed(plan.step, exc) from exc

    @torch.inference_mode()
    def _launch(self, plan: StepPlan, all_logits: bool, keep_logits: bool) -> PendingStep:
        """Queue the step on this rank's device and return at once; `wait()` on the result gives its tokens.

        A decode step replays its captured graph; others run eagerly. Lookahead items take their
        input from the previous step's sampled tokens on the device, so a step can be launched
        before the one it follows has finished.
        """
        assert all(i.row >= 0 for i in plan.items), "every item needs its table row"
        key = self._graph_key(plan)
        if key is not None and self.graphs is not None:  # a decode step: every token samples
            seeds = [request_seed(i.rid, i.sampling.seed, self.engine.seed) for i in plan.items]
            out, logits = self.graphs.launch(key, plan.items, seeds)
            processing = self.processing.prepare(plan.items, logits.shape[-1])  # while the graph runs
            if processing is not None:  # the replay's forward, then every row sampled again, processed
                graph = self.graphs.last
                assert graph is not None
                out = self._sample(graph.batch, logits, graph.params, processing)
            kept = logits[: len(plan.items)].clone() if keep_logits else None
            return PendingStep.of(plan.items, out[:, : len(plan.items)], kept, self.ops.transfers)
        sampled = tuple(i for i in plan.items if i.sample)
        seeds = [request_seed(i.rid, i.sampling.seed, self.engine.seed) for i in sampled]
        layout, words = host_words(plan.items, seeds, self.ratios)
        max_len = max((i.seq_len for i in plan.items), default=0)
        words = self.ops.transfers.upload(words, self.device)  # one copy: the batch and the sampled rows
        batch, params = layout.views(words, max_len, SamplingFlags.of(plan.items), spans(plan.items))
        if plan.cores_tokens:  # the MoE layers' exchange over the data-parallel cores is sized by it
            batch = dataclasses.replace(batch, cores_tokens=plan.cores_tokens)
        if any(i.is_lookahead for i in plan.items):
            batch = self._lookahead_inputs(batch)
        logits = self.model.forward(batch, all_logits=all_logits)
        kept = logits if keep_logits else None
        transfers = self.ops.transfers
        if not sampled:
            return PendingStep.of(
                (), torch.zeros(2, 0, dtype=torch.float64, device=self.device), kept, transfers
            )
        rows = logits if not all_logits else logits[batch.sample_index]
        processing = self.processing.prepare(sampled, rows.shape[-1])
        return PendingStep.of(sampled, self._sample(batch, rows, params, processing), kept, transfers)


def _int8_names(spec: ModelSpec[Any], cfg: ServedModelConfig) -> set[str]:
    """The loaded weights `weight_quant="int8"` quantizes: the projections the schema marks int8."""
    names = {n for n, t in loaded_schema(spec.schema(cfg), spec.names(cfg)).items() if t.int8}
    if not names:
        raise ConfigError(f"weight_quant: int8 is not supported for {cfg.model_type} (no W8A8 projections)")
    return names
