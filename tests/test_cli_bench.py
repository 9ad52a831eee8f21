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
