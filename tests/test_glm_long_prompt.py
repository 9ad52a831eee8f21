"""A 16,384-token prompt on a tiny GLM-4.7-Flash checkpoint, on the CPU: the engine's process stays
under 2 GiB at its peak (MLA's memory is linear in tokens + context: the tokens x context gather of
the 8k-token prompt that once asked for 480 GiB at full size is gone) and its greedy tokens and their
logprobs are transformers' (fed the prompt in 1,024-token chunks over its cache)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import torch
from golden_harness import _cache_kwarg, reference_model

from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm

PROMPT, NEW, VOCAB = 16384, 8, 2048
PEAK_RSS_MIB = 2048

ENGINE = """
import json, resource, sys
from dsv4serve import Engine, SamplingParams
model, prompt = sys.argv[1], json.loads(sys.argv[2])
with Engine(model, dtype="float32", max_total_tokens=len(prompt) + 1024, max_num_seqs=2) as engine:
    params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0, logprobs=True)
    c = engine.generate([prompt], params)[0]
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux
print(json.dumps({"tokens": list(c.token_ids), "logprobs": list(c.logprobs), "peak_rss_mib": rss}))
"""


def _transformers(model_dir: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    model = reference_model(model_dir, "Glm4MoeLiteForCausalLM")
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        kwargs: dict[str, object] = {}
        for start in range(0, len(prompt), 1024):
            chunk = torch.tensor([prompt[start : start + 1024]])
            out = model(input_ids=chunk, use_cache=True, logits_to_keep=1, **kwargs)
            kwargs = _cache_kwarg(out)
        for _ in range(NEW):
            lp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp[tokens[-1]]))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **_cache_kwarg(out))
    return tokens, logprobs


def test_a_16k_prompt_fits_in_2_gib_and_matches_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_glm(tmp_path / "glm", 3, vocab_size=VOCAB, max_position_embeddings=PROMPT + 64)
    rng = random.Random(5)
    prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT)]
    run = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model_dir), json.dumps(prompt), str(NEW)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["peak_rss_mib"] < PEAK_RSS_MIB, got["peak_rss_mib"]
    tokens, logprobs = _transformers(model_dir, prompt)
    assert got["tokens"] == tokens
    assert max(abs(a - b) for a, b in zip(got["logprobs"], logprobs, strict=True)) <= 1e-3
