"""Golden tests: GLM-4.7-Flash through dsv4serve against transformers' Glm4MoeLiteForCausalLM (fp32, greedy).

Two tiny shapes and seeds: q_lora_rank set with grouped routing (n_group 4, topk_group 2), and
q_lora_rank None (a plain q_proj) with two dense layers. Prompts of 1..200 tokens run in one flat
batch, whole or in random chunks (prefill chunks mixed with decodes); then through Engine.generate
with a small step budget and KV capacity that force chunked prefill and preemptions. Required:
identical greedy ids for 32 new tokens and max |logit difference| <= 1e-3 at every position. The
engine runs on the device DSV4SERVE_TEST_DEVICE names (on cuda: Triton kernels, decode steps replayed
from CUDA graphs); the reference on the CPU.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from golden_harness import Trace, compare, engine_traces, random_chunker, reference_traces

from dsv4serve import Engine, SamplingParams
from dsv4serve.config import EngineConfig
from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm

MAX_NEW = 32
TOL = 1e-3
VOCAB = 2048
SHAPES: dict[str, dict[str, Any]] = {
    "grouped": {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
    "no_q_lora": {
        "q_lora_rank": None,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 2,
        "num_attention_heads": 2,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 16,
        "v_head_dim": 12,
        "hidden_size": 48,
    },
}
PROMPT_LENGTHS = {"grouped": (1, 6, 23, 77, 200), "no_q_lora": (2, 13, 50, 131)}
REFERENCE = "Glm4MoeLiteForCausalLM"
DEVICE = os.environ.get("DSV4SERVE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module", params=sorted(SHAPES), ids=lambda s: f"shape={s}")
def golden(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    shape = request.param
    seed = 11 + sorted(SHAPES).index(shape)
    model_dir = make_tiny_glm(
        tmp_path_factory.mktemp(f"glm-{shape}"), seed, vocab_size=VOCAB, **SHAPES[shape]
    )
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS[shape]]
    return model_dir, prompts, reference_traces(model_dir, prompts, MAX_NEW, REFERENCE)


def _check(refs: list[Trace], got: list[Trace]) -> float:
    worst = max(compare(ref, g) for ref, g in zip(refs, got, strict=True))
    assert worst <= TOL, f"max |logit difference| {worst}"
    return worst


@pytest.mark.parametrize(("page", "chunked"), [(8, False), (4, True)], ids=["whole", "chunked"])
def test_glm_golden_batched_matches_transformers(golden: tuple, page: int, chunked: bool) -> None:
    model_dir, prompts, refs = golden
    engine = EngineConfig(
        device=DEVICE, dtype="float32", page_size=page, max_num_seqs=8, max_total_tokens=4096
    )
    chunk = random_chunker(page + len(prompts), 1, 37) if chunked else (lambda rid, remaining: remaining)
    _check(refs, engine_traces(model_dir, prompts, MAX_NEW, engine, chunk=chunk))


def test_glm_engine_generate_chunked_and_preempted(golden: tuple) -> None:
    """The whole engine: a step budget of 48 tokens and 320 KV slots for 12 prompts of up to 200 tokens."""
    model_dir, prompts, refs = golden
    many = prompts + [p[: max(1, len(p) // 3)] for p in prompts] + [p[::-1] for p in prompts[:4]]
    many = many[:12]
    expected = [t.tokens for t in refs] + [
        t.tokens for t in reference_traces(model_dir, many[len(refs) :], MAX_NEW, REFERENCE)
    ]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=())
    with Engine(  # in one process: every prompt queued before the first step (see test_golden_engine._run)
        model_dir,
        device=DEVICE,
        core_process=False,
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=48,
        max_total_tokens=320,
        page_size=16,
    ) as eng:
        completions = eng.generate(many, params)
        assert eng.stats().num_preemptions > 0, "the small KV capacity was meant to force preemptions"
        assert all(used == 0 for used, _ in eng.pool_usage().values()), eng.pool_usage()
    got = [list(c.token_ids) for c in completions]
    # the engine stops at an EOS id (config's list), transformers' traces do not: compare up to it
    eos = {1, 2}
    for ref, g in zip(expected, got, strict=True):
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert g == ref[:cut]
