"""The engine core in a process of its own: the same tokens and counters as in one process; `kill -9`
of the core gives every open stream an error and the server exits 1; the front's death makes the core
cancel its requests, free their memory and exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4serve import Engine, SamplingParams
from dsv4serve.actors.core_process import Frames
from tests.test_http_cli import free_port

PROMPTS = ["Hello", "The quick brown fox", "1 2 3 4", "a"]


def test_core_process_gives_the_same_tokens_and_counters(tiny_model_dir: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, logprobs=True)
    params = [greedy, sampled, greedy, sampled]
    with Engine(tiny_model_dir, max_total_tokens=4096) as one:
        want = one.generate(PROMPTS, params)
    with Engine(tiny_model_dir, max_total_tokens=4096, core_process=True) as two:
        got = two.generate(PROMPTS, params)
        stats = two.stats()
        assert stats.weight_bytes and stats.num_finished == len(PROMPTS)
        assert stats.finished_by_reason == {"length": len(PROMPTS)}
        assert stats.num_generated == 6 * len(PROMPTS)
        deadline = time.monotonic() + 10  # the allocator frees after the last token went out
        while any(used for used, _ in two.pool_usage().values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(used for used, _ in two.pool_usage().values()), two.pool_usage()
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    for a, b in zip(got, want, strict=True):  # batches form by timing: fp32 sums may round apart
        assert (a.logprobs is None) == (b.logprobs is None)
        assert a.logprobs is None or a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_frames_survive_a_stream_split_anywhere() -> None:
    import trio
    import trio.testing

    from dsv4serve.protocol import CancelRequest, Drain, FrontToCore

    async def main() -> None:
        left, right = trio.testing.memory_stream_pair()
        sender, receiver = Frames(left, FrontToCore), Frames(right, FrontToCore)
        batches: list[list[Any]] = [[CancelRequest(rid=f"r{i}") for i in range(n)] for n in (1, 3, 700)]
        batches.append([Drain()])
        for batch in batches:
            await sender.send(batch)
        await left.aclose()
        for batch in batches:
            assert await receiver.receive() == batch
        assert await receiver.receive() is None

    trio.run(main)


# ---------------------------------------------------------------- a live `serve --http`


class Server:
    """`serve --http` as a process; its stderr (the engine core's too) read by a thread."""

    def __init__(self, model_dir: Path, fronts: int = 1) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "dsv4serve", "serve", "--http", "--model", str(model_dir)]
        argv += ["--port", str(self.port), "--max-total-tokens", "4096", "--served-model-name", "tiny"]
        argv += ["--api-server-count", str(fronts)]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, errors="replace")
        self.lines: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.front_pids: dict[int, int] = {}  # front index -> pid (0: the server's own process)
        deadline = time.monotonic() + 120
        while len(self.front_pids) < fronts and time.monotonic() < deadline:
            self.wait_for(lambda e: e.get("event") == "ready" and e.get("actor") == "http", 1)
            self.front_pids = {
                int(e.get("front", 0)): int(e["pid"]) for e in list(self.lines) if e.get("event") == "ready"
            }
        assert len(self.front_pids) == fronts, "the server did not start"
        self.core_pid = self.wait_for_core()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines += _events(line)

    def wait_for_core(self) -> int:
        found = self.wait_for(lambda e: "core_pid" in e, 30)
        assert found is not None, self.tail()
        return int(found["core_pid"])

    def tail(self, n: int = 40) -> str:
        """The last n log events, without the per-request ones: what a failed wait shows."""
        events = [e for e in list(self.lines) if e.get("event") != "request"]
        return "\n".join(json.dumps(e)[:300] for e in events[-n:])

    def wait_for(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((e for e in list(self.lines) if match(e)), None)
            if found is not None:
                return found
            time.sleep(0.05)
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in [self.core_pid, *self.front_pids.values()]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _events(line: str) -> list[dict[str, Any]]:
    """The JSON objects of a stderr line (several processes share the pipe: a line one of them left
    unfinished runs into the next), and any text between them as {"text": ...}."""
    decoder, out, at, last = json.JSONDecoder(), [], 0, 0  # last: where the text not yet kept begins
    while (start := line.find("{", at)) >= 0:
        try:
            event, end = decoder.raw_decode(line, start)
        except json.JSONDecodeError:
            at = start + 1
            continue
        if line[last:start].strip():
            out.append({"text": line[last:start]})
        if isinstance(event, dict):
            out.append(event)
        at = last = end
    if line[last:].strip():
        out.append({"text": line[last:]})
    return out


@contextmanager
def server(model_dir: Path, fronts: int = 1) -> Iterator[Server]:
    srv = Server(model_dir, fronts)
    try:
        yield srv
    finally:
        srv.close()


def _alive(pid: int) -> bool:
    """Running (a zombie no init reaps, in a container, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _open_streams(
    srv: Server, n: int, max_tokens: int = 2000
) -> tuple[list[list[str]], list[threading.Thread], threading.Barrier]:
    """n long streaming completions in threads; each thread's SSE data lines; the barrier is passed
    once every stream has its first token."""
    lines: list[list[str]] = [[] for _ in range(n)]
    started = threading.Barrier(n + 1, timeout=120)
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}

    def run(i: int) -> None:
        first = True
        try:
            with (
                httpx.Client(timeout=120) as http,
                http.stream(
                    "POST", f"http://127.0.0.1:{srv.port}/v1/completions", json=body | {"prompt": f"p{i}"}
                ) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines[i].append(line[6:])
                        if first:
                            first = False
                            started.wait()
        except httpx.HTTPError as exc:  # a reset or a cut stream: recorded, the test decides
            lines[i].append(f"!{type(exc).__name__}")
        finally:
            if first:
                started.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return lines, threads, started


@pytest.mark.parametrize("fronts", [1, 2])
def test_kill_9_of_the_engine_core_errs_every_open_stream_and_the_server_exits_1(
    tiny_model_dir: Path, fronts: int
) -> None:
    """With several front processes too: every front's streams err and none outlives the server."""
    with server(tiny_model_dir, fronts) as srv:
        lines, threads, started = _open_streams(srv, 4 * fronts)
        started.wait()
        os.kill(srv.core_pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=60)
        assert srv.proc.wait(timeout=60) == 1
        for stream in lines:
            assert stream[-1] == "[DONE]", stream[-3:]
            error = json.loads(stream[-2])["error"]
            assert "engine-core process died" in error["message"], error
        assert srv.wait_for(lambda e: e.get("event") == "engine_core_died", 1) is not None
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in srv.front_pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in srv.front_pids.values()), "a front outlived the server"


@pytest.mark.parametrize("how", [signal.SIGKILL])
def test_the_front_dying_makes_the_core_cancel_free_and_exit(tiny_model_dir: Path, how: int) -> None:
    with server(tiny_model_dir) as srv:
        _lines, _threads, started = _open_streams(srv, 3)
        started.wait()
        srv.proc.send_signal(how)
        srv.proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _alive(srv.core_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(srv.core_pid), "the engine core outlived its front"
        gone = srv.wait_for(lambda e: e.get("event") == "front_gone", 5)
        assert gone is not None and gone["cancelled"] == 3
        stopped = srv.wait_for(lambda e: e.get("actor") == "core" and e.get("event") == "stopped", 5)
        assert stopped is not None and not any(stopped["pools_used"].values()), stopped


def test_sigterm_to_both_processes_drains(tiny_model_dir: Path) -> None:
    """A service manager signals every process of the service: the core ignores it, the front drains
    through the socket, every stream finishes and the server exits 0."""
    with server(tiny_model_dir) as srv:
        lines, threads, started = _open_streams(srv, 3, max_tokens=40)
        started.wait()
        os.kill(srv.core_pid, signal.SIGTERM)
        os.kill(srv.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert srv.proc.wait(timeout=60) == 0
        for stream in lines:
            assert stream[-1] == "[DONE]" and '"finish_reason":"length"' in stream[-2], stream[-2:]


def test_a_big_batch_crosses_as_several_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    import trio
    import trio.testing

    from dsv4serve.actors import core_process
    from dsv4serve.protocol import FrontToCore, SamplingParams, Tokenized

    monkeypatch.setattr(core_process, "SPLIT_FRAME_BYTES", 4096)
    batch = [
        Tokenized(rid=f"r{i}", prompt_token_ids=tuple(range(500)), params=SamplingParams()) for i in range(9)
    ]

    async def main() -> None:
        left, right = trio.testing.memory_stream_pair()
        sender, receiver = Frames(left, FrontToCore), Frames(right, FrontToCore)
        await sender.send(batch)
        await left.aclose()
        frames = []
        while (got := await receiver.receive()) is not None:
            frames.append(got)
        assert len(frames) > 1 and [m for f in frames for m in f] == batch

    trio.run(main)


# ---------------------------------------------------------------- several front processes


def _metrics(port: int) -> dict[str, float]:
    """/metrics samples by name and labels (`name{label=value}`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_several_fronts_share_the_port_and_sum_their_metrics(tiny_model_dir: Path) -> None:
    """Three front processes accept on one port (a socket each, SO_REUSEPORT): concurrent streams land on
    more than one of them (the kernel spreads connections by address hash: all 24 on one of 3 fronts has
    odds of 3 in 3^24), each gets the same greedy text as alone, and /metrics (whichever front answers
    it) counts every request once."""
    with server(tiny_model_dir, fronts=3) as srv:
        lines, threads, started = _open_streams(srv, 24, max_tokens=8)
        started.wait()
        for t in threads:
            t.join(timeout=120)
        texts = set()
        for stream in lines:
            assert stream[-1] == "[DONE]" and '"finish_reason":"length"' in stream[-2], stream[-2:]
            texts.add("".join(json.loads(d)["choices"][0]["text"] for d in stream[:-1]))
        assert len(texts) > 1  # the prompts differ ("p0".."p23"), so do their texts
        served = {e.get("front") for e in list(srv.lines) if e.get("event") == "request"}
        assert len(served) >= 2, served
        for _ in range(6):  # several scrapes: each may be answered by another front
            m = _metrics(srv.port)
            assert m["dsv4serve_requests_ended_total{reason=length}"] == 24, m
            assert m["dsv4serve_http_requests_total{endpoint=/v1/completions,status=200}"] == 24
            assert m["dsv4serve_generation_tokens_total{}"] == 24 * 8
        # the engine's gauges: the core's status, which a front that had nothing new gets every
        # STATUS_EVERY_S: six scrapes in a row (any fronts) read no request running, soon
        deadline, zeros = time.monotonic() + 20, 0
        while zeros < 6 and time.monotonic() < deadline:
            zeros = zeros + 1 if _metrics(srv.port)["dsv4serve_requests_running{}"] == 0 else 0
            time.sleep(0.05)
        assert zeros == 6


def test_the_fronts_sockets_share_a_port_no_other_server_holds() -> None:
    """One listening socket per front on one port; a port another server holds is refused at once, even
    when that server set SO_REUSEPORT (else the two would split each other's connections)."""
    import socket

    from dsv4serve.http.server import _bind

    socks = _bind("127.0.0.1", 0, 3)
    try:
        port = socks[0].getsockname()[1]
        assert [s.getsockname()[1] for s in socks] == [port] * 3
        with pytest.raises(OSError):
            _bind("127.0.0.1", port, 2)
    finally:
        for s in socks:
            s.close()
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            _bind("127.0.0.1", other.getsockname()[1], 2)


def test_a_front_killed_loses_only_its_streams_and_the_server_goes_on(tiny_model_dir: Path) -> None:
    """kill -9 of one front process: its open streams break, the core cancels their requests and frees
    their memory, the server logs `front_died`, and the other fronts go on answering."""
    with server(tiny_model_dir, fronts=2) as srv:
        lines, threads, started = _open_streams(srv, 16, max_tokens=400)  # live for seconds after the kill
        started.wait()
        victim = srv.front_pids[1]
        os.kill(victim, signal.SIGKILL)
        died = srv.wait_for(lambda e: e.get("event") == "front_died", 60)
        assert died is not None and died["front"] == 1, (_alive(victim), srv.tail())
        # each front has its own socket on the port (SO_REUSEPORT): the kernel spread the streams by
        # address hash, so front 1 most likely held some, but may hold none
        gone = srv.wait_for(lambda e: e.get("event") == "front_gone", 10)
        assert gone is None or gone["front"] == 1, srv.tail()
        cancelled = 0 if gone is None else gone["cancelled"]
        body = {"model": "tiny", "prompt": "again", "max_tokens": 4, "temperature": 0}
        for _ in range(4):  # new connections go to the living front
            r = httpx.post(f"http://127.0.0.1:{srv.port}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        srv.proc.send_signal(signal.SIGTERM)  # the living front's streams drain to the end
        assert srv.proc.wait(timeout=300) == 0
        for t in threads:  # the server is gone: every connection is closed
            t.join(timeout=60)
        ends = [s[-1] if s[-1] in ("[DONE]", "!RemoteProtocolError", "!ReadError") else s[-2:] for s in lines]
        assert all(isinstance(end, str) for end in ends), ends  # done, or cut by the front's death
        assert all('"finish_reason":"length"' in s[-2] for s in lines if s[-1] == "[DONE]")
        assert sum(end != "[DONE]" for end in ends) == cancelled, (ends, cancelled)
        stopped = srv.wait_for(lambda e: e.get("actor") == "core" and e.get("event") == "stopped", 10)
        assert stopped is not None and not any(stopped["pools_used"].values()), stopped


def test_a_core_of_several_fronts_sizes_its_inboxes_for_all_of_them() -> None:
    """Each front's handle caps its own live requests (max_waiting + max_num_seqs): a core serving three
    fronts holds up to three times as many, and its scheduler's inbox is sized for all of them (at most 3
    messages per live request plus 2 per in-flight step: the deadlock rule of actors/system.py)."""
    from dsv4serve.actors.system import SystemOptions, channel_sizes
    from dsv4serve.config import EngineConfig

    options = SystemOptions(Path("."), EngineConfig(max_num_seqs=8), max_waiting=16)
    sched1, (tok3, sched3) = channel_sizes(options)[1], channel_sizes(options, fronts=3)
    live = 3 * (16 + 8)
    assert sched3 >= 3 * live + 2 * options.max_inflight_steps and tok3 >= 2 * live
    assert sched1 < 3 * live
