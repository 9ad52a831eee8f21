"""The whole Triton backend in the executor core on CPU tensors (Triton's interpreter) against the
reference backend on the same tiny checkpoint: chunked prefills mixed with decodes, fp32, greedy.
The GPU run of the same kernels is the golden suite with DSV4SERVE_TEST_DEVICE=cuda."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from golden_harness import compare, engine_traces, random_chunker

from dsv4serve.backends.cuda import backend as triton_backend
from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.deepseek_v4.tiny import make_tiny


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 512-token vocabulary: the interpreter runs every program in Python."""
    return make_tiny(tmp_path_factory.mktemp("tiny-v512"), seed=4, vocab_size=512)


def test_triton_backend_matches_reference_backend(small_vocab_dir: Path) -> None:
    """Prompts that cross the window (16) and close ratio-4 and ratio-16 windows, in chunks."""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (2, 21)]
    engine = EngineConfig(device="cpu", dtype="float32", page_size=4, max_num_seqs=3, max_total_tokens=256)
    want = engine_traces(small_vocab_dir, prompts, 4, engine, chunk=random_chunker(5, 3, 9))
    runner = ModelRunner(small_vocab_dir, engine, ops=triton_backend())
    got = engine_traces(small_vocab_dir, prompts, 4, engine, chunk=random_chunker(5, 3, 9), runner=runner)
    worst = max(compare(w, g) for w, g in zip(want, got, strict=True))
    assert worst <= 1e-4, worst
