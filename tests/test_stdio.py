"""`python -m dsv4serve serve --stdio` as a subprocess: bad lines, exactly-once endings, load, cancel."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import trio

from dsv4serve.protocol import RequestError
from dsv4serve.stdio import LineReader

ROOT = Path(__file__).resolve().parents[1]
EVENT_TYPES = {"token", "done", "error", "stats"}
REFUSALS = {"invalid_request", "duplicate_id", "overloaded", "unknown_id"}  # answers to a line, not endings
# A small KV space (16 pages of 16 tokens) so that requests queue and get preempted; max_model_len = 256.
SMALL_KV = ["--max-total-tokens", "256", "--page-size", "16", "--max-num-seqs", "8"]
Event = dict[str, Any]


def serve_command(model_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "dsv4serve", "serve", "--stdio", "--model", str(model_dir), *flags]


def server_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def generate(rid: str, **fields: Any) -> bytes:
    return line({"type": "generate", "id": rid, "temperature": 0, **fields})


def parse_stdout(stdout: bytes) -> list[Event]:
    """Every stdout line must be one JSON event object."""
    events = []
    for raw in stdout.splitlines():
        event = json.loads(raw)
        assert isinstance(event, dict) and event.get("type") in EVENT_TYPES, raw
        events.append(event)
    return events


def endings(events: list[Event]) -> Counter[str]:
    """How many terminal events each request id got (refusals of a line are not endings)."""
    return Counter(
        e["id"] for e in events if e["type"] == "done" or (e["type"] == "error" and e["code"] not in REFUSALS)
    )


# ---------------------------------------------------------------- a live server


class Server:
    """A live `serve --stdio` process: write request lines, read events as they come."""

    def __init__(self, command: list[str], log: IO[bytes]) -> None:
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=ROOT, env=server_env()
        )
        self.events: queue.Queue[Event | None] = queue.Queue()
        self.seen: list[Event] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.events.put(json.loads(raw))  # a non-JSON line fails here and shows as a missing event
        self.events.put(None)

    def send(self, *lines: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"".join(lines))
        self.proc.stdin.flush()

    def until(self, enough: Callable[[list[Event]], bool], timeout: float = 120) -> list[Event]:
        """Read events until `enough(events read in this call)`."""
        got: list[Event] = []
        while not enough(got):
            event = self.events.get(timeout=timeout)
            assert event is not None, "the server closed stdout"
            assert event.get("type") in EVENT_TYPES, event
            got.append(event)
            self.seen.append(event)
        return got

    def stats(self) -> Event:
        self.send(line({"type": "stats"}))
        return self.until(lambda got: bool(got) and got[-1]["type"] == "stats")[-1]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("stdio") / "stderr.jsonl"
    with log_path.open("wb") as log:
        srv = Server(serve_command(tiny_model_dir, *SMALL_KV), log)
        yield srv
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


# ---------------------------------------------------------------- bad lines mixed with good ones, EOF


def test_bad_lines_get_one_error_each_and_valid_requests_end_once(
    server: Server, tiny_model_dir: Path
) -> None:
    """(`server` is unused here: asking for it starts it, so its start-up overlaps this test's own.)"""
    bad_lines = [  # (line, the error event's id, code)
        (b"not json at all", None, "invalid_request"),
        (line({"type": "generate", "id": "w1", "prompt": 123}), "w1", "invalid_request"),
        (line({"type": "frobnicate", "id": "u1"}), "u1", "invalid_request"),
        (line({"type": "generate", "prompt": "no id"}), None, "invalid_request"),
        (generate("n1", prompt="x", max_tokens=-1), "n1", "invalid_request"),
        (generate("g1", prompt="a repeat of a live id"), "g1", "duplicate_id"),
        (generate("f1", prompt="x", bogus=1), "f1", "invalid_request"),
        (generate("v1", prompt_token_ids=[5, 10**6]), "v1", "invalid_request"),
        (generate("p1", prompt="x", top_p=0), "p1", "invalid_request"),
        (generate("t1", prompt="x", logprobs=True, top_logprobs=21), "t1", "invalid_request"),
        (generate("t2", prompt="x", top_logprobs=2), "t2", "invalid_request"),
        (line({"type": "cancel", "id": "nope"}), "nope", "unknown_id"),
        (b'\xff\xfe{"type": "stats"}', None, "invalid_request"),
        (b'[{"type": "stats"}]', None, "invalid_request"),
        (b"{}", None, "invalid_request"),
    ]
    too_long = [  # accepted, then ended by an error: the context is 256 tokens
        (generate("c1", prompt_token_ids=[7] * 300, max_tokens=1), "c1", "context_too_long"),
        (generate("c2", prompt_token_ids=[7] * 200, max_tokens=100), "c2", "context_too_long"),
    ]
    good = [
        generate("g1", prompt="The capital of France is", max_tokens=12),
        generate("g2", prompt_token_ids=[0, 5, 6, 7], max_tokens=4, stream=True),
        generate(
            "g3",
            prompt="Hello",
            max_tokens=5,
            logprobs=True,
            top_logprobs=3,
            temperature=0.8,
            seed=3,
            stop=["zz"],
        ),
        line({"type": "stats"}),
    ]
    lines = [good[0], *(b for b, _, _ in bad_lines[:6]), b"", *good[1:], *(b for b, _, _ in bad_lines[6:])]
    lines += [b for b, _, _ in too_long]
    stdin = b"".join(x if x.endswith(b"\n") else x + b"\n" for x in lines)
    proc = subprocess.run(
        serve_command(tiny_model_dir, *SMALL_KV),
        input=stdin,
        capture_output=True,
        cwd=ROOT,
        env=server_env(),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    events = parse_stdout(proc.stdout)
    errors = Counter((e["id"], e["code"]) for e in events if e["type"] == "error")
    assert errors == Counter((rid, code) for _, rid, code in bad_lines + too_long)
    assert all(e["message"] for e in events if e["type"] == "error")
    assert endings(events) == Counter({"g1": 1, "g2": 1, "g3": 1, "c1": 1, "c2": 1})
    assert [e["type"] for e in events].count("stats") == 1
    done = {e["id"]: e for e in events if e["type"] == "done"}
    assert done["g1"]["finish_reason"] == "length" and len(done["g1"]["token_ids"]) == 12
    streamed = [t for e in events if e["type"] == "token" and e["id"] == "g2" for t in e["token_ids"]]
    assert streamed == done["g2"]["token_ids"] and len(streamed) == 4
    assert len(done["g3"]["logprobs"]) == len(done["g3"]["token_ids"]) == len(done["g3"]["top_logprobs"])
    g3 = done["g3"]
    for chosen, lp, top in zip(g3["token_ids"], g3["logprobs"], g3["top_logprobs"], strict=True):
        assert len(top) == 3 and [x[1] for x in top] == sorted((x[1] for x in top), reverse=True)
        assert all(x[1] == lp for x in top if x[0] == chosen) and lp <= top[0][1]  # [token_id, logprob]
    assert "top_logprobs" not in done["g1"] and "logprobs" not in done["g1"]
    messages = {e["id"]: e["message"] for e in events if e["type"] == "error"}
    assert messages["t1"].startswith("top_logprobs") and messages["t2"].startswith("top_logprobs: needs")
    assert done["g2"]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4}
    assert not [e for e in events if e["type"] == "token" and e["id"] != "g2"]  # only g2 streams


# ---------------------------------------------------------------- load, cancel, shutdown (one server)


def ended(ids: set[str]) -> Callable[[list[Event]], bool]:
    return lambda got: set(endings(got)) >= ids


def test_load_every_request_ends_once_and_pools_end_free(server: Server) -> None:
    rng = random.Random(0)
    ids = [f"load-{i}" for i in range(200)]
    requests = []
    for i, rid in enumerate(ids):
        max_tokens = rng.randint(1, 4)
        if i % 3:
            prompt_ids = [0] + [rng.randrange(1, 129280) for _ in range(rng.randint(3, 30))]
            requests.append(generate(rid, prompt_token_ids=prompt_ids, max_tokens=max_tokens))
        else:
            requests.append(generate(rid, prompt=f"request {i} " * rng.randint(1, 8), max_tokens=max_tokens))
    server.send(*requests, line({"type": "stats"}))
    got = server.until(ended(set(ids)), timeout=120)
    assert endings(got) == Counter(ids)
    assert all(e["finish_reason"] in ("length", "stop") for e in got if e["type"] == "done")
    busy = next(e for e in got if e["type"] == "stats")
    assert busy["waiting"] > 0  # the KV space is small: requests queued
    stats = server.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert {name: pool["used"] for name, pool in stats["pools"].items()} == dict.fromkeys(stats["pools"], 0)


def test_cancel_mid_stream(server: Server) -> None:
    server.send(generate("m1", prompt="The capital of France is", max_tokens=200, stream=True))
    first = server.until(lambda got: any(e["type"] == "token" for e in got))
    server.send(line({"type": "cancel", "id": "m1"}))
    rest = server.until(ended({"m1"}))
    [done] = [e for e in rest if e["type"] == "done"]
    assert done["finish_reason"] == "cancelled" and len(done["token_ids"]) < 200
    streamed = [t for e in first + rest if e["type"] == "token" for t in e["token_ids"]]
    assert streamed == done["token_ids"]
    server.send(line({"type": "cancel", "id": "m1"}))  # ended: no longer live
    [error] = server.until(bool)
    assert (error["type"], error["id"], error["code"]) == ("error", "m1", "unknown_id")


def test_hostile_lines_get_one_error_each_while_a_stream_carries_on(server: Server) -> None:
    """Issue 9: deep nesting killed the server; a huge stop string cost 1.1 GB; others lost their id."""
    deep = "[" * 3000 + "]" * 3000
    hostile = [  # (line, the error's id)
        ('{"type":"generate","id":"h1","prompt":' + deep + "}", None),
        ('{"id":"h2","x":' + deep + ',"type":"generate"}', None),
        ('{"type":"generate","id":"h3","prompt":"x","stop":["' + "s" * 200_000 + '"]}', "h3"),
        ('{"type":"generate","id":"h4","prompt":"x","stop":[' + ",".join(['"s"'] * 5000) + "]}", "h4"),
        ('{"type":"generate","id":"' + "i" * 100_000 + '","prompt":"x"}', None),
        ('{"type":"generate","id":"h6","prompt":"x","temperature":1e400}', "h6"),
        ('{"type":"generate","id":"h7","prompt":"x","top_p":NaN}', "h7"),
        ('{"type":"generate","id":"h8","prompt":"x","top_k":' + "9" * 10_000 + "}", "h8"),
        ('{"type":"generate","id":"h9","prompt":"\\ud800"}', "h9"),
    ]
    server.send(generate("live", prompt="The capital of France is", max_tokens=40, stream=True))
    server.until(lambda got: any(e["type"] == "token" for e in got))
    server.send(*(text.encode() + b"\n" for text, _ in hostile))
    got = server.until(
        lambda got: sum(e["type"] == "error" for e in got) == len(hostile) and "live" in endings(got)
    )
    errors = [e for e in got if e["type"] == "error"]
    assert [e["id"] for e in errors] == [rid for _, rid in hostile]
    assert all(e["code"] == "invalid_request" and len(e["message"]) < 200 for e in errors), errors
    [done] = [e for e in got if e["type"] == "done"]
    assert done["id"] == "live" and len(done["token_ids"]) == 40
    assert server.stats()["running"] == 0  # still serving


def test_shutdown_drains_then_exits_0(server: Server) -> None:
    ids = {"s1", "s2", "s3"}
    server.send(*(generate(rid, prompt=f"drain {rid}", max_tokens=6) for rid in sorted(ids)))
    server.send(line({"type": "shutdown"}), generate("late", prompt="after shutdown"))  # stdin stays open
    assert server.proc.wait(timeout=120) == 0
    got: list[Event] = []
    while (event := server.events.get(timeout=30)) is not None:
        got.append(event)
        server.seen.append(event)
    assert endings(got) == Counter(ids)
    assert all(e["finish_reason"] == "length" for e in got if e["type"] == "done")
    accepted = endings(server.seen)
    assert set(accepted.values()) == {1} and "late" not in accepted


# ---------------------------------------------------------------- line splitting (in process)


class Chunks(trio.abc.ReceiveStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.chunks.pop(0) if self.chunks else b""

    async def aclose(self) -> None:
        pass


async def test_line_reader_splits_chunks_and_skips_overlong_lines() -> None:
    reader = LineReader(
        Chunks([b'{"a"', b": 1}\n\n", b"x" * 10, b"y" * 10 + b"\nok\nlast"]), max_line_bytes=8
    )
    assert await reader.receive_line() == b'{"a": 1}'
    assert await reader.receive_line() == b""
    with pytest.raises(RequestError, match="longer than 8 bytes") as err:
        await reader.receive_line()
    assert err.value.code == "invalid_request"
    assert await reader.receive_line() == b"ok"
    assert await reader.receive_line() == b"last"
    assert await reader.receive_line() is None


# ---------------------------------------------------------------- signals and a closed stdout (issue 9)


def start_server(model_dir: Path, log: IO[bytes], *flags: str) -> Server:
    return Server(serve_command(model_dir, *SMALL_KV, *flags), log)


@pytest.mark.parametrize(("signum", "times", "status"), [(signal.SIGTERM, 1, 0), (signal.SIGINT, 2, 130)])
def test_a_stop_signal_mid_stream_ends_every_request_once(
    tiny_model_dir: Path, tmp_path: Path, signum: signal.Signals, times: int, status: int
) -> None:
    """One signal drains (the long stream finishes); a second one cuts the drain short (what is still
    live ends with `internal`). Either way: one terminal event per request, the documented status,
    no traceback."""
    log_path = tmp_path / "stderr.jsonl"
    with log_path.open("wb") as log:
        srv = start_server(tiny_model_dir, log)
        ids = {"long", "a1", "a2", "a3"}
        srv.send(generate("long", prompt="The capital of France is", max_tokens=200, stream=True))
        srv.send(*(generate(rid, prompt_token_ids=[0, 5, 6, 7], max_tokens=30) for rid in ("a1", "a2", "a3")))
        srv.until(lambda got: any(e["type"] == "token" for e in got))
        for _ in range(times):
            srv.proc.send_signal(signum)
            time.sleep(0.5)  # trio coalesces a signal that repeats before it was read
        assert srv.proc.wait(timeout=120) == status
    got = list(srv.seen)
    while (event := srv.events.get(timeout=30)) is not None:
        got.append(event)
    assert endings(got) == Counter(ids)
    stderr = log_path.read_text()
    assert "Traceback" not in stderr, stderr[-3000:]
    logs = [json.loads(x) for x in stderr.splitlines() if x.startswith("{")]
    assert any(e["event"] == "signal" and e["signal"] == signum.name for e in logs)
    [long_end] = [e for e in got if e["id"] == "long" and e["type"] in ("done", "error")]
    if times == 1:
        assert long_end["type"] == "done" and len(long_end["token_ids"]) == 200
    else:
        assert long_end["type"] == "error" and long_end["code"] == "internal"


def test_a_client_that_closes_stdout_gets_a_quiet_exit(tiny_model_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "stderr.jsonl"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            serve_command(tiny_model_dir, *SMALL_KV),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=ROOT,
            env=server_env(),
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(generate("long", prompt="Hello", max_tokens=200, stream=True))
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["type"] == "token"
        proc.stdout.close()  # the stream goes on writing tokens into a closed pipe
        assert proc.wait(timeout=120) == 0  # stdin is still open: the server left on its own
        proc.stdin.close()
    stderr = log_path.read_text()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert any(json.loads(x)["event"] == "stdout_closed" for x in stderr.splitlines() if x.startswith("{"))
