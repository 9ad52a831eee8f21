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
