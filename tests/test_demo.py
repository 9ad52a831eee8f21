"""`python -m dsv4serve demo` (the README's main command) and `generate`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch
import trio

from dsv4serve import cli

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^summary: 4 requests, (\d+) tokens in [\d.]+ s, [\d.]+ tokens/s \(.*\)$", re.MULTILINE)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """cli.main configures structlog for the process; put the session's configuration back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_demo_builds_a_cache_and_streams_prompts(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "DSV4SERVE_CACHE": str(cache), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4serve", "demo", "--max-tokens", "6"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"{cache / 'tiny-seed0'} (built)" in out
    summary = SUMMARY.search(out)
    assert summary is not None, out
    num_deltas = sum(1 for ln in out.splitlines() if re.match(r"^\[\d\] \+ ", ln))
    assert 0 < num_deltas <= int(summary[1]) <= 4 * 6
    assert len(re.findall(r"^\[\d\] '.*' -> ", out, re.MULTILINE)) == 4  # one completion line per prompt
    assert (cache / "tiny-seed0" / "config.json").is_file()
    assert [p.name for p in cache.iterdir()] == ["tiny-seed0"]  # no staging directory left behind


def test_tiny_checkpoint_is_built_once(tmp_path: Path) -> None:
    first, built = cli.tiny_checkpoint(tmp_path, seed=1)
    again, built_again = cli.tiny_checkpoint(tmp_path, seed=1)
    assert (first, built, built_again) == (tmp_path / "tiny-seed1", True, False) and again == first


def test_generate_prints_the_completion(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "Hello", "--max-tokens", "5"]
    assert cli.main([*argv, "--temperature", "0", "--max-total-tokens", "512", "--page-size", "16"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and captured.out.endswith("\n")
    assert "finish_reason: length" in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--model", "MODEL", "--prompt", "x", "--temperature", "-1"], "temperature: expected"),
        (["generate", "--model", "MODEL", "--prompt", "x", "--top-p", "2"], "top_p: expected"),
        (["generate", "--model", "/nonexistent", "--prompt", "x"], "does not exist"),
        (["generate", "--model", "MODEL"], "required: --prompt"),
        (["demo", "--max-tokens", "0"], "--max-tokens"),
        (["serve", "--stdio"], "required: --model"),
        (["serve", "--stdio", "--model", "/nonexistent"], "does not exist"),
        (
            ["serve", "--stdio", "--model", "MODEL", "--page-size", "24"],
            "page_size: 24 must be a power of two",
        ),
        (["serve", "--stdio", "--model", "MODEL", "--state-mode", "flat"], "--state-mode"),
        (["demo", "--cache-dir", "CACHE", "--max-tokens", "5000"], "max_model_len (4096)"),  # 4 prompts fail
        # issue 9: tracebacks before
        (["generate", "--model", "MODEL", "--prompt", "x", "--device", "cuda:x"], "device: 'cuda:x'"),
        (
            [
                "generate",
                "--model",
                "MODEL",
                "--prompt",
                "x",
                "--max-tokens",
                "600",
                "--max-total-tokens",
                "512",
            ],
            "max_model_len (512)",
        ),
    ],
)
def test_cli_usage_errors_are_one_line_exit_2(
    argv: list[str], message: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(tiny_model_dir) if a == "MODEL" else a for a in argv]
    if "CACHE" in argv:  # the demo's cache, holding the session's tiny checkpoint
        (tmp_path / "tiny-seed0").symlink_to(tiny_model_dir)
        argv = [str(tmp_path) if a == "CACHE" else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
@pytest.mark.parametrize(
    "command", [["generate", "--prompt", "x"], ["serve", "--stdio"]], ids=["generate", "serve"]
)
def test_a_missing_device_is_one_line_exit_2(
    device: str,
    command: list[str],
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    restore_logging: None,
) -> None:
    """`serve` (its engine core in a process of its own) checks the device before it starts the core: the
    same one line as `generate` in one process, not the core's crash."""
    argv = [*command, "--model", str(tiny_model_dir), "--device", device]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"device: {device!r}" in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_api_refuses_a_missing_device_before_starting_a_core(tiny_model_dir: Path) -> None:
    """`AsyncEngine(device="cuda")` would run its core apart: the ConfigError comes from the front."""
    from dsv4serve import AsyncEngine
    from dsv4serve.config import ConfigError

    async def enter() -> None:
        async with AsyncEngine(tiny_model_dir, device="cuda"):
            pass

    with pytest.raises(ConfigError, match="no CUDA device"):
        trio.run(enter)


def test_help_shows_defaults_and_the_transport(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(default: 0.9)" in out and "(default: 30.0)" in out and "transport" in out
