"""The benchmark scripts still run: `benchmarks/bench_decode.py --dry-run` (the whole flow at tiny
dimensions on the CPU) for each model family, its JSON complete (speed is measured on a GPU, not here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "--dry-run",
    "--contexts",
    "48",
    "--batches",
    "1",
    "3",
    "--prefills",
    "2x24",
    "--engine-contexts",
    "48",
]


@pytest.mark.parametrize(
    ("model", "weights"),
    [
        ("deepseek_v4", "bf16"),
        ("glm4_moe_lite", "bf16"),
        ("deepseek_v4", "official"),
        ("deepseek_v4", "w8a8"),
    ],
)
def test_bench_decode_dry_run(model: str, weights: str) -> None:
    """official: MXFP4 experts resident packed (transformers on the values they encode: the same
    greedy run), FP8 linears' values; the roofline counts the packed experts' bytes. w8a8: the int8
    projections resident as int8."""
    setting = ["--set", "experts.SPLIT_BELOW=0"] if weights == "official" else []
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--model", model, *ARGS,
         "--steps", "3", "--profile", "--weights", weights, *setting],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["set"] == ({"experts.SPLIT_BELOW": 0} if setting else {})
    assert report["model"] == model and list(report["prefill"]) == ["2x24"] and report["weights"] == weights
    resident = report["resident_weight_bytes"]
    assert ("mxfp4" in resident) == ("fp8" in resident) == (weights == "official"), resident
    assert ("int8" in resident) == (weights == "w8a8"), resident
    assert list(report["decode"]) == ["b1_ctx48", "b3_ctx48"] and list(report["engine"]) == [
        "b1_ctx48",
        "b3_ctx48",
    ]
    for entry in report["decode"].values():
        assert entry["core_ms"] > 0 and entry["roofline_ms"] > 0 and entry["bytes"]["kv"] > 0
        moe_layers = 3 if model == "glm4_moe_lite" else 4  # 4 layers; GLM-4.7-Flash's first is dense
        assert entry["hf_ms"] > 0 and len(entry["distinct_experts"]) == moe_layers


def test_bench_decode_refuses_a_constant_it_does_not_have() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--dry-run", "--set",
         "linear.NO_SUCH=1"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "no constant 'NO_SUCH'" in done.stderr


def test_bench_long_prompt_dry_run() -> None:
    """The long-prompt benchmark's flow at tiny GLM dimensions: the prompt served in chunks through the
    engine, transformers on the same prompt, both with the same greedy first token."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_long_prompt.py"), "--dry-run", "--tokens", "700",
         "--chunk", "256", "--new-tokens", "4"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    engine = report["engine"]
    assert engine["ttft_ms"] > 0 and len(engine["tokens"]) == 4 and engine["same_first_token_both_runs"]
    assert report["transformers"]["ttft_ms"] > 0 and report["same_first_token_as_hf"]


def test_bench_ranks_prints_each_ranks_share(tiny_model_dir: Path) -> None:
    """Two ranks with expert parallelism: each holds half the routed experts and of the split attention,
    the embeddings whole."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_ranks.py"), "--model", str(tiny_model_dir), "--ep"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    whole, ranks = report["by_group"]["whole"], report["by_group"]["ranks"]
    for rank in ranks:
        assert rank["routed_experts"] * 2 == whole["routed_experts"]
        assert rank["embed_head"] == whole["embed_head"] and rank["attention"] < whole["attention"]
