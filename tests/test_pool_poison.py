"""Pools full of NaN or +-inf serve the same tokens: no masked or padded read reaches the output.

The pools are allocated with `torch.empty`; here every buffer of every pool is filled with NaN, then
+inf, then -inf before the engine serves, and `Engine.generate` (chunked prefills mixed with
decodes, short requests beside long ones, rows and slots reused between calls) must give the tokens
and logprobs of a run whose pools were zero-filled: on the reference backend, and on the Triton
backend run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by conftest.py; on the GPU
with CUDA graphs when DSV4SERVE_TEST_DEVICE=cuda), against the reference backend's zero-filled run.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest
import torch

from dsv4serve import Engine, SamplingParams
from dsv4serve.actors.system import SystemOptions
from dsv4serve.actors.tokenizer_core import load_tokenizer
from dsv4serve.backends.cuda import backend as triton_backend
from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.deepseek_v4.tiny import make_tiny
from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm

FILLS = (math.nan, math.inf, -math.inf)
DEVICE = os.environ.get("DSV4SERVE_TEST_DEVICE", "cpu")  # cuda: the Triton test runs on the GPU, graphs on


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-poison"), seed=6, vocab_size=512)


def _serve(runner: ModelRunner, model_dir: Path, prompts: list[list[int]], max_new: int, fill: float) -> list:
    for buffers in runner.cache.buffers.values():
        for buffer in buffers.values():
            buffer.fill_(fill)
    options = SystemOptions(model_dir, runner.engine, prebuilt=(runner, load_tokenizer(model_dir)))
    params = SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=True)
    with Engine._of(options) as eng:
        completions = eng.generate(prompts, params)
    return [(list(c.token_ids), list(c.logprobs or ())) for c in completions]


def _check_poisoned_runs(
    runner: ModelRunner, model_dir: Path, prompts: list[list[int]], max_new: int, want: list, tol: float
) -> None:
    assert all(math.isfinite(lp) for _, logprobs in want for lp in logprobs)
    for fill in FILLS:
        got = _serve(runner, model_dir, prompts, max_new, fill)
        for (want_ids, want_lp), (got_ids, got_lp) in zip(want, got, strict=True):
            assert got_ids == want_ids, f"pools filled with {fill}"
            assert got_lp == pytest.approx(want_lp, abs=tol), f"pools filled with {fill}"


@pytest.mark.parametrize("state_mode", ["paged", "ring"])
def test_reference_backend_ignores_poisoned_pools(small_vocab_dir: Path, state_mode: str) -> None:
    torch.set_num_threads(1)
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (1, 2, 7, 21, 40)]
    engine = EngineConfig(
        device="cpu",
        dtype="float32",
        page_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        max_total_tokens=256,
        state_mode=state_mode,
    )
    runner = ModelRunner(small_vocab_dir, engine)
    want = _serve(runner, small_vocab_dir, prompts, 8, 0.0)
    _check_poisoned_runs(runner, small_vocab_dir, prompts, 8, want, 1e-5)


def test_glm_ignores_poisoned_pools(tmp_path: Path) -> None:
    """GLM-4.7-Flash's latent pool (MLA over chunked prefills and decodes)."""
    torch.set_num_threads(1)
    model_dir = make_tiny_glm(tmp_path, seed=5, vocab_size=512)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (1, 6, 19, 33)]
    engine = EngineConfig(
        device="cpu",
        dtype="float32",
        page_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=12,
        max_total_tokens=256,
    )
    runner = ModelRunner(model_dir, engine)
    want = _serve(runner, model_dir, prompts, 6, 0.0)
    _check_poisoned_runs(runner, model_dir, prompts, 6, want, 1e-5)


def test_triton_backend_ignores_poisoned_pools(tmp_path: Path) -> None:
    """Tinier still (3 layers, 11 prompt tokens), compared with a zero-filled run of the reference
    backend: the interpreter runs every Triton program in Python, about a second per token."""
    torch.set_num_threads(1)
    shape = {"num_hidden_layers": 3, "compress_ratios": [0, 4, 8], "sliding_window": 4, "index_topk": 1}
    shape |= {"hidden_size": 32, "n_routed_experts": 4, "hc_sinkhorn_iters": 3}
    model_dir = make_tiny(tmp_path, seed=8, vocab_size=512, **shape)
    rng = random.Random(8)
    # 9 tokens cross the window, close a ratio-8 and two ratio-4 windows (the indexer picks 1 of 2);
    # the 2-token request joins its decodes and reads only padded / masked compressed rows
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (9, 2)]
    engine = EngineConfig(
        device="cpu",
        dtype="float32",
        page_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        max_total_tokens=256,
    )
    want = _serve(ModelRunner(model_dir, engine), model_dir, prompts, 3, 0.0)
    runner = ModelRunner(model_dir, engine.with_(device=DEVICE), ops=triton_backend())
    _check_poisoned_runs(runner, model_dir, prompts, 3, want, 1e-4 if DEVICE == "cpu" else 1e-3)
