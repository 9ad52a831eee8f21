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
