"""Golden test through the whole engine: Engine.generate (actors, scheduler, allocator, kv_writer,
executor) against transformers' greedy generate, 16 prompts of mixed lengths in one call (on the
device DSV4SERVE_TEST_DEVICE names; on cuda the decode steps replay CUDA graphs).

With a small step budget (chunked prefill) and a small KV capacity (preemptions, recompute) the
output must be identical to a run with ample memory and to transformers, in both state modes.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from golden_harness import reference_model

from dsv4serve import Engine, SamplingParams

DEVICE = os.environ.get("DSV4SERVE_TEST_DEVICE", "cpu")  # cuda: Triton kernels, decode steps in CUDA graphs
MAX_NEW = 16
LENGTHS = (1, 2, 3, 5, 8, 13, 17, 21, 30, 34, 47, 55, 64, 89, 120, 150)
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(16)
    return [[rng.randrange(2, 129000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = reference_model(tiny_model_dir)  # its indexer on the engine's tie rule
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                eos_token_id=1,
                pad_token_id=1,
            )
            out.append(gen[0, len(prompt) :].tolist())
    return out


def _run(model_dir: Path, prompts: list[list[int]], **engine: object) -> tuple[list[list[int]], int]:
    """In one process (every prompt queued before the first step: with the core apart, as on a GPU by
    default, they reach it over several frames, and the KV pressure that forces preemptions may not form)."""
    with Engine(model_dir, dtype="float32", device=DEVICE, core_process=False, **engine) as eng:  # type: ignore[arg-type]
        completions = eng.generate(prompts, GREEDY)
        stats = eng.stats()
        assert all(used == 0 for used, _ in eng.pool_usage().values()), eng.pool_usage()
    assert [list(c.prompt_token_ids) for c in completions] == prompts
    return [list(c.token_ids) for c in completions], stats.num_preemptions


def test_golden_engine_ample_memory_matches_transformers(
    tiny_model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    got, preemptions = _run(tiny_model_dir, prompts, max_num_seqs=16, max_total_tokens=8192, page_size=16)
    assert got == reference
    assert preemptions == 0


@pytest.mark.parametrize("state_mode", ["paged", "ring"])
def test_golden_engine_chunked_and_preempted_matches_transformers(
    tiny_model_dir: Path, prompts: list[list[int]], reference: list[list[int]], state_mode: str
) -> None:
    got, preemptions = _run(
        tiny_model_dir,
        prompts,
        max_num_seqs=16,
        max_num_batched_tokens=48,
        max_total_tokens=256,
        page_size=16,
        state_mode=state_mode,
    )
    assert preemptions > 0, "the small KV capacity was meant to force preemptions"
    assert got == reference


def test_processed_rows_in_graph_steps_equal_eager_ones(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    """Logit processing and structured output beside plain rows: decode steps replaying graphs (on
    cuda; the rows processed after the replay) give the tokens of steps run eagerly."""
    from dsv4serve.chat.grammar import json_output

    kinds = [
        GREEDY,
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias={7: 5.0}, repetition_penalty=1.3),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured=json_output(None, False)),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=3, frequency_penalty=0.5, min_tokens=4),
    ]
    params = [kinds[i % len(kinds)] for i in range(8)]
    runs = []
    for graphs in (True, False):
        with Engine(  # one process: the same batches in both runs (arrival over frames could differ)
            tiny_model_dir,
            device=DEVICE,
            core_process=False,
            dtype="float32",
            max_total_tokens=8192,
            graphs=graphs,
        ) as e:
            runs.append([c.token_ids for c in e.generate(prompts[:8], params)])
    assert runs[0] == runs[1]
