"""Run the same prompts through transformers (the golden reference) and through dsv4serve's
executor core (allocator -> slot messages -> tables -> ModelRunner), recording every position's logits.

The reference is `reference_model`: transformers' DeepseekV4ForCausalLM with its indexer's top-k
patched to the engine's tie rule (highest score first, exact ties to the lowest compressed index).
Its own `torch.topk` choice among exact ties is an artefact of the row's width, which in transformers
is the number of compressed entries cached so far; indexer scores tie exactly whenever every index
head's dot product is negative (the score is then 0), which is common with few index heads.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4serve.attention.core import topk_lowest_ties
from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.memory.allocator import KVAllocator, Refusal
from dsv4serve.protocol import SamplingParams, StepItem, StepPlan

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Trace:
    """Greedy continuation of one prompt and the logits at every position (prompt + generated[:-1])."""

    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)


class LowestTiesScores(torch.Tensor):
    """Indexer scores whose `topk` follows the engine's tie rule (a subclass survives masked_fill)."""

    def topk(  # type: ignore[override]
        self, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
    ) -> torch.return_types.topk:
        assert dim in (-1, self.dim() - 1) and largest, "only the indexer's call is patched"
        scores = self.as_subclass(torch.Tensor)
        indices = topk_lowest_ties(scores, k)  # (..., k), highest first
        return torch.return_types.topk((scores.gather(-1, indices), indices))


def patch_indexer_tie_rule(model: torch.nn.Module) -> int:
    """Make every indexer scorer of a transformers DeepseekV4 model return `LowestTiesScores`, so its
    top-k picks ties as the engine does. Returns the number of scorers patched."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

    scorers = [m for m in model.modules() if isinstance(m, DeepseekV4IndexerScorer)]
    for scorer in scorers:
        forward = scorer.forward
        scorer.forward = lambda *args, _f=forward: _f(*args).as_subclass(LowestTiesScores)  # type: ignore[method-assign]
    return len(scorers)


def reference_model(model_dir: Path, model_class: str = "DeepseekV4ForCausalLM") -> torch.nn.Module:
    """transformers' model of `model_dir` in fp32, eval mode; a DeepSeek-V4 one's indexer on the
    engine's tie rule."""
    import transformers

    model = getattr(transformers, model_class).from_pretrained(model_dir, dtype=torch.float32).eval()
    if model_class == "DeepseekV4ForCausalLM":
        patch_indexer_tie_rule(model)
    return model


def reference_traces(
    model_dir: Path,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    model_class: str = "DeepseekV4ForCausalLM",
) -> list[Trace]:
    model = reference_model(model_dir, model_class)
    traces = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
            trace = Trace([], list(out.logits[0]))
            for step in range(max_new):
                token = int(trace.logits[-1].argmax())
                trace.tokens.append(token)
                if step + 1 < max_new:
                    out = model(input_ids=torch.tensor([[token]]), use_cache=True, **_cache_kwarg(out))
                    trace.logits.append(out.logits[0, -1])
            traces.append(trace)
    return traces


def _cache_kwarg(out: object) -> dict[str, object]:
    """transformers >= 5.23 calls the cache `cache`; older releases `past_key_values`."""
    if hasattr(out, "cache"):
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}  # type: ignore[attr-defined]


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    max_new: int
    computed: int = 0
    trace: Trace = field(default_factory=lambda: Trace([]))

    @property
    def done(self) -> bool:
        return len(self.trace.tokens) >= self.max_new


def engine_traces(
    model_dir: Path,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    engine: EngineConfig,
    chunk: Callable[[str, int], int] = lambda rid, remaining: remaining,
    runner: ModelRunner | None = None,
) -> list[Trace]:
    """All prompts run together: each step holds one item per unfinished request (a prefill chunk of
    `chunk(rid, remaining)` tokens, or a decode), so prefills and decodes mix in one flat batch."""
    runner = runner or ModelRunner(model_dir, engine)
    alloc = KVAllocator(runner.model_cfg, engine, runner.sizes)
    reqs = [_Req(f"r{i}", list(p), max_new) for i, p in enumerate(prompts)]
    step = 0
    while not all(r.done for r in reqs):
        items, locs = [], []
        for r in (r for r in reqs if not r.done):
            n = max(1, min(chunk(r.rid, len(r.tokens) - r.computed), len(r.tokens) - r.computed))
            got = alloc.allocate(r.rid, r.computed, r.computed + n, step)
            assert not isinstance(got, Refusal), got
            locs.append(got)
            sample = r.computed + n == len(r.tokens)
            ids = tuple(r.tokens[r.computed : r.computed + n])
            items.append(
                StepItem(
                    rid=r.rid,
                    prefix_len=r.computed,
                    token_ids=ids,
                    sample=sample,
                    sampling=GREEDY,
                    row=got.row,
                )
            )
        runner.write_locs(locs)
        result = runner.execute(StepPlan(step=step, items=tuple(items)), all_logits=True, keep_logits=True)
        assert result.logits is not None
        offset = 0
        by_rid = {o.rid: o.token_id for o in result.outputs}
        for item in items:
            r = next(r for r in reqs if r.rid == item.rid)
            n = len(item.token_ids)
            r.trace.logits.extend(result.logits[offset : offset + n].float().cpu())
            offset += n
            r.computed += n
            if item.sample:
                r.trace.tokens.append(by_rid[r.rid])
                if not r.done:
                    r.tokens.append(by_rid[r.rid])
        step += 1
    for r in reqs:
        alloc.free(r.rid)
    return [r.trace for r in reqs]


def random_chunker(seed: int, low: int = 1, high: int = 40) -> Callable[[str, int], int]:
    rng = random.Random(seed)
    return lambda rid, remaining: rng.randint(low, high)


def compare(ref: Trace, got: Trace) -> float:
    """Max |logit difference| over every position; asserts the same greedy tokens."""
    assert got.tokens == ref.tokens, f"tokens differ:\nref {ref.tokens}\ngot {got.tokens}"
    assert len(got.logits) == len(ref.logits)
    return max(float((a - b.to(a.device)).abs().max()) for a, b in zip(ref.logits, got.logits, strict=True))
