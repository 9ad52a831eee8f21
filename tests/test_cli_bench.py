"""`python -m dsv4serve bench`: one JSON object with the measured step times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4serve.cli import main


def test_bench_prints_one_json_object(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench",
        "--model",
        str(tiny_model_dir),
        "--requests",
        "3",
        "--prompt-len",
        "9",
        "--decode-steps",
        "2",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3 and out["prompt_len"] == 9 and out["dtype"] == "float32"
    assert out["prefill_ms"] > 0 and out["decode_step_ms"] > 0 and len(out["tokens"]) == 3


def test_bench_on_a_missing_model_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--model", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_a_corrupt_checkpoint_is_one_line_not_a_traceback(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes()[:1000] if f.suffix == ".safetensors" else f.read_bytes())
    assert main(["bench", "--model", str(bad), "--requests", "1", "--prompt-len", "4"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_overlapped_decode_gives_the_synchronous_tokens(tiny_model_dir: Path) -> None:
    """The benchmark's overlapped decode (each step's input the previous step's token, taken on the
    device, launched before that step is waited for) continues exactly as step-by-step decoding does."""
    from dsv4serve.bench import CoreDriver
    from dsv4serve.config import EngineConfig
    from dsv4serve.executor.runner import ModelRunner

    engine = EngineConfig(device="cpu", page_size=16, max_num_seqs=2, max_num_batched_tokens=64)
    runner = ModelRunner(tiny_model_dir, engine)
    tokens = []
    for overlapped in (False, True):
        core = CoreDriver(runner)
        prompts = {"a": [0, *range(100, 120)], "b": [0, *range(200, 207)]}
        core.prefill(prompts, 64)
        seen = []
        for _ in range(5):
            if overlapped:
                core.decode_overlapped(list(prompts), 2)
            else:
                core.decode(list(prompts), 2)
            seen.append(dict(core.last))
        core.free(list(prompts))
        tokens.append(seen)
    assert tokens[0] == tokens[1] and len({s["a"] for s in tokens[0]}) > 1
