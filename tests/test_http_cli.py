"""`python -m dsv4serve serve --http` as a process: it serves the openai client, and SIGTERM drains it
(exit status 0)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_http_process_answers_and_drains_on_sigterm(tiny_model_dir: Path) -> None:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "dsv4serve",
        "serve",
        "--http",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--max-total-tokens",
        "4096",
        "--served-model-name",
        "tiny",
    ]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        while True:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, "the server did not start"
            if '"event": "ready"' in line and '"actor": "http"' in line:
                assert json.loads(line)["urls"] == [f"http://127.0.0.1:{port}"]
                break
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
        assert (
            reply.choices[0].finish_reason == "length" and reply.usage and reply.usage.completion_tokens == 4
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert '"event": "stopped"' in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_picks_its_fronts_by_device_and_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --http` without --api-server-count: on an accelerator of one host, a front per 4 CPU
    cores up to 4 (one front lags the core at 64 streams); on the CPU, over hosts, with stdio or one
    process, 1; a given count stays."""
    import os

    from dsv4serve.cli import auto_fronts, build_parser
    from dsv4serve.config import EngineConfig

    def fronts(*flags: str, cores: int = 16) -> int:
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        args = build_parser().parse_args(["serve", "--model", "m", *flags])
        knobs = {f: getattr(args, f) for f in EngineConfig.__dataclass_fields__}
        return auto_fronts(args, EngineConfig(**knobs))

    assert fronts("--http", "--device", "cuda") == 4
    assert fronts("--http", "--device", "cuda:1", cores=8) == 2
    assert fronts("--http", "--device", "cuda", cores=2) == 1
    assert fronts("--http", "--device", "npu", cores=64) == 4
    assert fronts("--http") == 1  # the CPU computes: fronts would take its cores
    assert fronts("--stdio", "--device", "cuda") == 1
    assert fronts("--http", "--device", "cuda", "--single-process") == 1
    hosts = ("--nnodes", "2", "--tensor-parallel-size", "2", "--master-port", "29500")
    assert fronts("--http", "--device", "cuda", *hosts) == 1
    assert fronts("--http", "--api-server-count", "3") == 3
