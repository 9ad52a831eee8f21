"""Golden tests: dsv4serve's executor core against transformers' DeepseekV4ForCausalLM (fp32, greedy).

Several requests of different lengths run in one flat batch (prefill chunks mixed with decodes),
with whole or randomly chunked prefills, in both compressor-state modes and several page sizes.
Required: identical greedy ids for 32 new tokens and max |logit difference| <= 1e-3 at every
position (prefill and every decode step). The reference's indexer top-k breaks exact ties to the
lowest compressed index, as the engine does (`golden_harness.reference_model`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from golden_harness import Trace, compare, engine_traces, random_chunker, reference_traces

from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.deepseek_v4.tiny import make_tiny

MAX_NEW = 32
DEVICE = os.environ.get("DSV4SERVE_TEST_DEVICE", "cpu")  # the engine's device; the reference runs on the CPU
TOL = 1e-3

# Two shapes: the default tiny model (window 16, ratios 0/4/16, top-k 4) and a second one with a
# shorter window, a smaller top-k, a different layer order and one hash layer.
SHAPES: dict[str, dict[str, Any]] = {
    "default": {},
    "narrow": {
        "num_hidden_layers": 4,
        "compress_ratios": [4, 16, 0, 4],
        "sliding_window": 8,
        "index_topk": 3,
        "num_hash_layers": 1,
        "hidden_size": 48,
        "num_attention_heads": 2,
        "o_groups": 2,
    },
}
PROMPT_LENGTHS = {"default": (1, 5, 17, 64, 130, 200), "narrow": (2, 9, 33, 100, 161)}
RUNS = [  # (state_mode, page_size, chunked)
    ("paged", 8, False),
    ("paged", 4, True),
    ("ring", 16, True),
    ("ring", 8, False),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=sorted(SHAPES), ids=lambda s: f"shape={s}")
def golden(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    shape = request.param
    seed = 1 + sorted(SHAPES).index(shape)
    model_dir = make_tiny(tmp_path_factory.mktemp(f"tiny-{shape}"), seed=seed, **SHAPES[shape])
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 129000) for _ in range(n)] for n in PROMPT_LENGTHS[shape]]
    return model_dir, prompts, reference_traces(model_dir, prompts, MAX_NEW)


def _check(refs: list[Trace], got: list[Trace]) -> None:
    worst = max(compare(ref, g) for ref, g in zip(refs, got, strict=True))
    assert worst <= TOL, f"max |logit difference| {worst}"


@pytest.mark.parametrize(("mode", "page", "chunked"), RUNS, ids=lambda v: str(v))
def test_golden_batched_engine_matches_transformers(
    golden: tuple, mode: str, page: int, chunked: bool
) -> None:
    model_dir, prompts, refs = golden
    engine = EngineConfig(
        device=DEVICE, dtype="float32", page_size=page, max_num_seqs=8, max_total_tokens=4096, state_mode=mode
    )
    chunk = random_chunker(page * 7 + len(prompts), 1, 37) if chunked else (lambda rid, remaining: remaining)
    _check(refs, engine_traces(model_dir, prompts, MAX_NEW, engine, chunk=chunk))


def test_golden_single_token_chunks(golden: tuple) -> None:
    """Prefill one token per step: every window closes in a decode-shaped step."""
    model_dir, prompts, refs = golden
    engine = EngineConfig(
        device=DEVICE, dtype="float32", page_size=4, max_num_seqs=8, max_total_tokens=4096, state_mode="paged"
    )
    short = [i for i, p in enumerate(prompts) if len(p) <= 40]
    got = engine_traces(model_dir, [prompts[i] for i in short], MAX_NEW, engine, chunk=lambda rid, rem: 1)
    _check([refs[i] for i in short], got)


def test_golden_runner_reuses_rows_after_free(golden: tuple, tmp_path: Path) -> None:
    """A second batch on the same runner (rows, slots and stale table entries reused) still matches."""
    model_dir, prompts, refs = golden
    engine = EngineConfig(
        device=DEVICE, dtype="float32", page_size=8, max_num_seqs=4, max_total_tokens=2048, state_mode="paged"
    )
    runner = ModelRunner(model_dir, engine)
    order = [len(prompts) - 1, 0, 2]
    _check(
        [refs[i] for i in order],
        engine_traces(model_dir, [prompts[i] for i in order], MAX_NEW, engine, runner=runner),
    )
    order = [1, 3]
    _check(
        [refs[i] for i in order],
        engine_traces(model_dir, [prompts[i] for i in order], MAX_NEW, engine, runner=runner),
    )


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="two CUDA streams")
def test_golden_step_pieces_on_two_streams(golden: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """DECODE_BESIDE (a decode-sized step's queries and keys chains on two streams, graphs captured
    that way): the logits of one stream bit for bit, so transformers' too."""
    from dsv4serve.backends.cuda import triton_utils

    model_dir, prompts, refs = golden
    engine = EngineConfig(
        device=DEVICE, dtype="float32", page_size=8, max_num_seqs=8, max_total_tokens=4096, state_mode="paged"
    )
    monkeypatch.setattr(triton_utils, "DECODE_BESIDE", False)
    plain = engine_traces(model_dir, prompts, MAX_NEW, engine)
    monkeypatch.setattr(triton_utils, "DECODE_BESIDE", True)
    got = engine_traces(model_dir, prompts, MAX_NEW, engine)
    _check(refs, got)
    for a, b in zip(plain, got, strict=True):
        assert a.tokens == b.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
