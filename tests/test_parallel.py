"""Tensor and expert parallelism (issue 30) on the CPU over gloo: ranks are processes, each holding its
share of the weights (`layers/parallel.py`), fed rank 0's table writes and launches (`executor/ranks.py`).

Greedy fp32 tokens of TP=2 and TP=2 with EP=2 equal one process's on tiny DeepSeek-V4 and GLM
checkpoints, with chunked prefill and preemptions; the same through `serve --http`; a rank killed
mid-stream fails the open requests and stops the engine. Below: each cut of a weight against the same
cut of its float value, and the routes to a rank's experts."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from dsv4serve import AsyncEngine, Engine, RequestError, SamplingParams, logs
from dsv4serve.actors.system import EngineCoreDied
from dsv4serve.config import ConfigError, EngineConfig
from dsv4serve.layers.formats import decode_e8m0, quantize_fp8_block, quantize_mxfp4
from dsv4serve.layers.linear import Fp8BlockWeight, Mxfp4Weight, quantize_int8
from dsv4serve.layers.parallel import Shard, ShardError
from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm
from dsv4serve.protocol import TokenEvent

GREEDY = SamplingParams(max_tokens=40, temperature=0)
# (tensor_parallel_size, data_parallel_size, expert_parallel_size)
LAYOUTS = [(2, 1, 1), (2, 1, 2), (1, 2, 1), (1, 2, 2)]


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_glm(tmp_path_factory.mktemp("glm-tp"), seed=3, num_hidden_layers=2)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 5000) for _ in range(n)] for n in (1, 9, 33, 70, 131, 150)]


def _tokens(model: Path, tp: int, dp: int, ep: int, **knobs: Any) -> tuple[list[tuple[int, ...]], int]:
    """Greedy tokens of `_prompts(7)`, and how many preemptions the run had."""
    parallel = {"tensor_parallel_size": tp, "data_parallel_size": dp, "expert_parallel_size": ep}
    with Engine(model, **parallel, **knobs) as engine:
        tokens = [c.token_ids for c in engine.generate(_prompts(7), GREEDY)]
        return tokens, engine.stats().num_preemptions


@pytest.mark.parametrize("family", ["deepseek_v4", "glm4_moe_lite"])
def test_ranks_give_one_process_tokens(family: str, tiny_model_dir: Path, glm_dir: Path) -> None:
    """Chunked prefill (32-token steps) and a KV of 256 tokens for six requests of 41 to 190 tokens:
    some are preempted and recomputed."""
    model = tiny_model_dir if family == "deepseek_v4" else glm_dir
    knobs = {"max_num_batched_tokens": 32, "max_total_tokens": 256, "page_size": 16}
    one, preempted = _tokens(model, 1, 1, 1, **knobs)
    assert preempted > 0
    layouts = LAYOUTS + ([(2, 2, 4)] if family == "deepseek_v4" else [])  # 4 ranks: 2 cores of 2
    for tp, dp, ep in layouts:
        assert _tokens(model, tp, dp, ep, **knobs)[0] == one, (tp, dp, ep)
    assert _tokens(model, 1, 2, 2, expert_dispatch="all_to_all", **knobs)[0] == one, "all_to_all"


def test_an_idle_core_joins_every_step(glm_dir: Path) -> None:
    """One request for two data-parallel cores with the experts spread over both: the idle core runs a
    padding step beside each of the other's (its experts still compute the request's tokens)."""
    prompt = _prompts(5)[4]
    with Engine(glm_dir, max_total_tokens=4096) as engine:
        want = engine.generate([prompt], GREEDY)[0].token_ids
    with Engine(glm_dir, max_total_tokens=4096, data_parallel_size=2, expert_parallel_size=2) as engine:
        assert engine.generate([prompt], GREEDY)[0].token_ids == want


@pytest.mark.parametrize("ranks", [["--tensor-parallel-size", "2"], ["--data-parallel-size", "2"]])
def test_serve_http_with_two_ranks(tiny_model_dir: Path, ranks: list[str]) -> None:
    import httpx

    from tests.test_http_cli import free_port

    prompt = _prompts(1)[3]
    with Engine(tiny_model_dir, max_total_tokens=4096) as engine:
        want = engine.generate([prompt], GREEDY)[0].text
    port = free_port()
    argv = [sys.executable, "-m", "dsv4serve", "serve", "--http", "--model", str(tiny_model_dir)]
    argv += ["--port", str(port), "--max-total-tokens", "4096", *ranks, "--expert-parallel-size", "2"]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = _healthy(port, 120)
        body = {"model": tiny_model_dir.name, "prompt": prompt, "max_tokens": 40, "temperature": 0}
        got = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0


@pytest.mark.parametrize("case", ["ok", "flags", "fronts", "token", "rank", "garbage"])
def test_a_core_of_another_host_is_checked_by_its_hello(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a front makes of a dialing peer's hello: a core of this engine is taken (its frames follow);
    one with other engine flags (another page size) or another count of fronts stops the start, naming
    the cause; a wrong token, a rank not expected or bytes that are no hello: a stranger, closed on."""
    import trio.testing

    from dsv4serve.actors.core_process import engine_digest, hello_frame
    from dsv4serve.actors.front import _hello

    monkeypatch.setenv("DSV4SERVE_RANK_TOKEN", "s3cret")
    hosts = {"data_parallel_size": 2, "expert_parallel_size": 2, "nnodes": 2, "master_port": 5000}
    engine = EngineConfig(page_size=16, **hosts)
    digest = engine_digest(dataclasses.replace(engine, page_size=32) if case == "flags" else engine)
    if case == "token":
        monkeypatch.setenv("DSV4SERVE_RANK_TOKEN", "wrong")
    hello = hello_frame(0 if case == "rank" else 1, 2 if case == "fronts" else 1, digest)
    sent = b"GET / HTTP/1.1\r\n\r\n" if case == "garbage" else hello

    async def main() -> tuple[int | None, Any]:
        ours, theirs = trio.testing.memory_stream_pair()
        await theirs.send_all(sent)
        await theirs.send_eof()
        return await _hello(ours, b"s3cret", [1], engine, 1)  # type: ignore[arg-type]

    if case in ("flags", "fronts"):
        cause = "other engine flags" if case == "flags" else "dials 2 fronts, this host runs 1"
        with pytest.raises(EngineCoreDied, match=cause):
            trio.run(main)
        return
    rank, _ = trio.run(main)
    assert rank == (1 if case == "ok" else None)


def test_a_local_core_dying_while_the_other_hosts_load_stops_the_start(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host 0's core dies while host 0 waits for the other hosts' cores (none ever comes here): the start
    fails at once with the core's exit, not after the 900 s the other hosts get to load."""
    import threading

    monkeypatch.setenv("DSV4SERVE_RANK_TOKEN", "s3cret")
    layout = {"data_parallel_size": 2, "expert_parallel_size": 2, "nnodes": 2, "master_port": _master_port()}

    earlier = set(_pids(tiny_model_dir, b'"dp_rank":0'))  # an earlier test's, exiting

    def kill_core_0() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pids = [pid for pid in _pids(tiny_model_dir, b'"dp_rank":0') if pid not in earlier]
            if pids:
                time.sleep(1.0)  # loading, or waiting for its peers
                os.kill(pids[0], signal.SIGKILL)
                return
            time.sleep(0.1)

    threading.Thread(target=kill_core_0, daemon=True).start()
    begin = time.monotonic()
    with pytest.raises(BaseException) as caught:
        Engine(tiny_model_dir, max_total_tokens=4096, **layout).close()
    assert _died_of(caught.value, "exited with code -9"), caught.value
    assert time.monotonic() - begin < 120


def _master_port() -> int:
    from tests.test_http_cli import free_port

    port = free_port()
    while port + 2 >= 65535:
        port = free_port()
    return port


def _died_of(exc: BaseException, cause: str) -> bool:
    """Whether `exc` is, or (in exception groups) holds, an EngineCoreDied saying `cause`."""
    if isinstance(exc, BaseExceptionGroup):
        return any(_died_of(e, cause) for e in exc.exceptions)
    return isinstance(exc, EngineCoreDied) and cause in str(exc)


def _healthy(port: int, within_s: float) -> str:
    """The server's URL once its /health answers 200 (or `within_s` passed)."""
    import httpx

    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
    else:
        raise AssertionError(f"no healthy server on port {port} within {within_s} s")
    return url


@pytest.mark.parametrize("family", ["deepseek_v4", "glm4_moe_lite"])
def test_ranks_on_two_hosts_give_one_process_tokens(
    family: str, tiny_model_dir: Path, glm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 over two hosts (both this one, as the second host sees it: `dsv4serve ranks --node-rank 1`
    with the same flags): host 1's rank joins host 0's rendezvous and, once loaded, connects to host 0
    with the shared token; the tokens are one process's. A rank without the token is refused."""
    from tests.test_http_cli import free_port

    model = tiny_model_dir if family == "deepseek_v4" else glm_dir
    knobs = {"max_num_batched_tokens": 32, "max_total_tokens": 256, "page_size": 16}
    one = _tokens(model, 1, 1, 1, **knobs)[0]
    port = free_port()
    while port + 1 >= 65535:
        port = free_port()
    hosts = {"tensor_parallel_size": 2, "nnodes": 2, "master_port": port, **knobs}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in hosts.items()]
    monkeypatch.setenv("DSV4SERVE_RANK_TOKEN", "s3cret")
    stranger = subprocess.Popen(  # a rank with the wrong token: host 0 closes on it, takes the next
        [sys.executable, "-c", _STRANGER, str(port + 1)], env=os.environ | {"DSV4SERVE_RANK_TOKEN": "no"}
    )
    argv = [sys.executable, "-m", "dsv4serve", "ranks", "--model", str(model), "--node-rank", "1", *flags]
    host1 = subprocess.Popen(argv)  # loads, then connects: long after the stranger, already waiting
    try:
        assert _tokens(model, 2, 1, 1, nnodes=2, master_port=port, **knobs)[0] == one
        assert stranger.wait(timeout=60) == 0  # refused: closed on
        assert host1.wait(timeout=60) == 0  # host 0's engine stopped its rank
    finally:
        for proc in (stranger, host1):
            if proc.poll() is None:
                proc.kill()


def test_data_parallel_cores_on_two_hosts_give_one_process_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP=2 with EP=2 over two hosts (both this one): host 0's front starts core 0; host 1's
    `dsv4serve ranks --node-rank 1` starts core 1, which dials the front with the shared token and joins
    the experts' collectives; the tokens are one process's, and host 1 exits 0 once the engine stops.
    A peer without the token is closed on first."""
    from tests.test_http_cli import free_port

    knobs = {"max_num_batched_tokens": 32, "max_total_tokens": 256, "page_size": 16}
    one = _tokens(tiny_model_dir, 1, 1, 1, **knobs)[0]
    port = free_port()
    while port + 1 >= 65535:
        port = free_port()
    hosts = {"data_parallel_size": 2, "expert_parallel_size": 2, "nnodes": 2, "master_port": port, **knobs}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in hosts.items()]
    monkeypatch.setenv("DSV4SERVE_RANK_TOKEN", "s3cret")
    stranger = subprocess.Popen(
        [sys.executable, "-c", _STRANGER_CORE, str(port + 1)], env=os.environ | {"DSV4SERVE_RANK_TOKEN": "no"}
    )
    argv = [sys.executable, "-m", "dsv4serve", "ranks", "--model", str(tiny_model_dir), "--node-rank", "1"]
    host1 = subprocess.Popen([*argv, *flags])  # loads, then dials: after the stranger, already dialing
    try:
        assert _tokens(tiny_model_dir, 1, 2, 2, nnodes=2, master_port=port, **knobs)[0] == one
        assert stranger.wait(timeout=60) == 0  # refused: closed on
        assert host1.wait(timeout=60) == 0  # its core drained once the front closed
    finally:
        for proc in (stranger, host1):
            if proc.poll() is None:
                proc.kill()


def test_serve_http_with_two_fronts_and_a_core_on_another_host(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve --http --api-server-count 2` with DP=2 + EP=2 over two hosts: host 1's core dials both
    fronts (front f on master_port + 1 + f), every answer is one process's, and both hosts exit 0 after
    SIGTERM."""
    import httpx

    from tests.test_http_cli import free_port

    prompts = _prompts(1)[1:5]
    with Engine(tiny_model_dir, max_total_tokens=4096) as engine:
        want = [c.text for c in engine.generate(prompts, GREEDY)]
    port, master = free_port(), free_port()
    while master + 2 >= 65535:
        master = free_port()
    monkeypatch.setenv("DSV4SERVE_RANK_TOKEN", "s3cret")
    flags = ["--data-parallel-size", "2", "--expert-parallel-size", "2", "--nnodes", "2"]
    flags += ["--master-port", str(master), "--max-total-tokens", "4096", "--api-server-count", "2"]
    run = [sys.executable, "-m", "dsv4serve"]
    host1 = subprocess.Popen([*run, "ranks", "--model", str(tiny_model_dir), "--node-rank", "1", *flags])
    serve = [*run, "serve", "--http", "--model", str(tiny_model_dir), "--port", str(port), *flags]
    server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = _healthy(port, 180)
        for prompt, text in zip(prompts, want, strict=True):
            body = {"model": tiny_model_dir.name, "prompt": prompt, "max_tokens": 40, "temperature": 0}
            got = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            assert got["choices"][0]["text"] == text
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        assert host1.wait(timeout=60) == 0
    finally:
        for proc in (server, host1):
            if proc.poll() is None:
                proc.kill()


# dials host 0's front as core 1 with this environment's token; exits 0 once refused (closed)
_STRANGER_CORE = """
import os, sys
from dsv4serve.actors.core_process import hello_frame
from dsv4serve.executor.ranks import dial
sock = dial("127.0.0.1", int(sys.argv[1]))
sock.sendall(hello_frame(1, 1, "0" * 16))
sys.exit(0 if sock.recv(1) == b"" else 1)
"""


# connects to host 0's rank port as rank 1 with this environment's token; exits 0 once refused (closed)
_STRANGER = """
import json, os, socket, sys, time
from multiprocessing.connection import Connection
for _ in range(600):
    try:
        sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
        break
    except OSError:
        time.sleep(0.2)
sock.settimeout(None)
conn = Connection(sock.detach())
conn.send_bytes(json.dumps({"rank": 1, "token": os.environ["DSV4SERVE_RANK_TOKEN"]}).encode())
try:
    conn.recv_bytes()
except EOFError:
    sys.exit(0)
sys.exit(1)
"""


def test_several_hosts_are_checked() -> None:
    with pytest.raises(ConfigError, match="nnodes"):
        EngineConfig(tensor_parallel_size=3, nnodes=2, master_port=5000)
    with pytest.raises(ConfigError, match="nnodes"):
        EngineConfig(tensor_parallel_size=2, data_parallel_size=3, nnodes=2, master_port=5000)
    with pytest.raises(ConfigError, match="nnodes"):
        EngineConfig(data_parallel_size=2, nnodes=4, master_port=5000)
    four = EngineConfig(tensor_parallel_size=2, data_parallel_size=4, nnodes=2, master_port=5000, node_rank=1)
    assert (four.host_cores, four.ranks_per_node, four.tp_spans_hosts) == (range(2, 4), 4, False)
    with pytest.raises(ConfigError, match="master_port"):
        EngineConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ConfigError, match="node_rank"):
        EngineConfig(node_rank=1)


def _pids(model: Path, marker: bytes) -> list[int]:
    """Processes serving `model` whose command line holds `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(marker in c for c in cmd) and any(str(model).encode() in c for c in cmd):
                pids.append(int(entry.name))
    return pids


# a tensor-parallel rank other than 0; the second data-parallel engine core
RANK_1 = b"dsv4serve.executor.rank_process"
CORE_1 = b'"dp_rank":1'


KILLED = [
    ({"tensor_parallel_size": 2}, RANK_1),
    ({"data_parallel_size": 2, "expert_parallel_size": 2}, CORE_1),
]


@pytest.mark.parametrize(("layout", "victim"), KILLED)
async def test_a_killed_rank_fails_the_open_requests_and_stops_the_engine(
    glm_dir: Path, layout: dict[str, int], victim: bytes
) -> None:
    await _kill_mid_stream(glm_dir, layout, victim)


async def test_a_killed_core_on_another_host_fails_the_open_requests_and_stops_the_engine(
    glm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP=2 + EP=2 over two hosts: kill -9 of host 1's core mid-stream fails every open request on both
    cores, the engine stops, and host 1's `dsv4serve ranks` exits non-zero."""
    from tests.test_http_cli import free_port

    port = free_port()
    while port + 1 >= 65535:
        port = free_port()
    monkeypatch.setenv("DSV4SERVE_RANK_TOKEN", "s3cret")
    layout = {"data_parallel_size": 2, "expert_parallel_size": 2, "nnodes": 2, "master_port": port}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in layout.items()]
    argv = [sys.executable, "-m", "dsv4serve", "ranks", "--model", str(glm_dir), "--node-rank", "1"]
    host1 = subprocess.Popen([*argv, "--max-total-tokens", "8192", *flags])
    try:
        await _kill_mid_stream(glm_dir, layout, CORE_1)
        assert host1.wait(timeout=60) != 0  # its core died of the signal
    finally:
        if host1.poll() is None:
            host1.kill()


async def _kill_mid_stream(glm_dir: Path, layout: dict[str, int], victim: bytes) -> None:
    """Three long streams; `victim` (a process whose command line holds it) killed at the first token:
    each stream ends with an error and the engine stops with EngineCoreDied."""
    logs.configure("warning", stream=sys.stderr)  # an earlier test's captured stream may be closed
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    prompts = _prompts(3)[:3]
    errors: list[RequestError] = []
    killed: list[int] = []
    with pytest.raises(EngineCoreDied):
        async with AsyncEngine(glm_dir, max_total_tokens=8192, **layout) as engine:
            (pid,) = _pids(glm_dir, victim)

            async def one(prompt: list[int]) -> None:
                try:
                    async for event in engine.stream(prompt, params):
                        if isinstance(event, TokenEvent) and not killed:
                            killed.append(pid)
                            os.kill(pid, signal.SIGKILL)
                except RequestError as err:
                    errors.append(err)

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for prompt in prompts:
                        nursery.start_soon(one, prompt)
    assert len(errors) == 3, errors


def test_parallel_knobs_are_checked() -> None:
    with pytest.raises(ConfigError, match="expert_parallel_size"):
        EngineConfig(tensor_parallel_size=2, expert_parallel_size=3)
    with pytest.raises(ConfigError, match="expert_parallel_size"):
        EngineConfig(data_parallel_size=2, expert_parallel_size=3)
    assert EngineConfig(tensor_parallel_size=4, expert_parallel_size=4).expert_parallel_size == 4


# ---------------------------------------------------------------- a rank's share of each weight


@pytest.mark.parametrize("rank", [0, 1])
def test_cuts_of_quantized_weights_are_the_cuts_of_their_values(rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    shard = Shard(rank, 2)
    dense = torch.randn(256, 512, generator=gen)
    int8 = quantize_int8(dense)
    for cut in (shard.rows, shard.cols):
        got, want = cut(int8, "w"), cut(dense, "w")
        assert got.shape == want.shape and got.qweight.dtype == torch.int8  # type: ignore[union-attr]
    q, s = quantize_fp8_block(dense)
    fp8 = Fp8BlockWeight(q, decode_e8m0(s))
    whole = fp8.dequantized(torch.float32)
    for cut in (shard.rows, shard.cols):
        part = cut(fp8, "w")
        assert isinstance(part, Fp8BlockWeight)
        assert torch.equal(part.dequantized(torch.float32), cut(whole, "w"))
    with pytest.raises(ShardError, match="blocks"):
        Shard(rank, 4).rows(fp8, "wq_b")  # 64 rows a rank: inside one 128-row block
    packed, scales = quantize_mxfp4(torch.randn(64, 128, generator=gen))  # one expert's (out, in)
    mx = Mxfp4Weight(packed, scales)
    decoded = mx.dequantized(torch.float32)
    for cut in (shard.rows, shard.cols):
        part = cut(mx, "w")
        assert isinstance(part, Mxfp4Weight)
        assert torch.equal(part.dequantized(torch.float32), cut(decoded, "w"))
    with pytest.raises(ShardError, match="scale groups"):
        Shard(rank, 8).cols(mx, "w2")  # 16 columns a rank: half a scale group


def test_routes_to_a_ranks_experts_keep_its_own_and_zero_the_rest() -> None:
    weights = torch.tensor([[0.5, 0.25], [0.75, 0.125]])
    ids = torch.tensor([[0, 5], [7, 2]])
    w, i = Shard(1, 2).local_routes(weights, ids, 8)  # rank 1 holds experts 4..7
    assert w.tolist() == [[0.0, 0.25], [0.75, 0.0]] and i.tolist() == [[0, 1], [3, 0]]
    w, i = Shard(1, 2, expert_parallel=False).local_routes(weights, ids, 8)
    assert torch.equal(w, weights) and torch.equal(i, ids)
    with pytest.raises(ShardError, match="heads"):
        Shard(0, 3).rows(torch.zeros(8, 4), "heads")


@pytest.mark.parametrize("expert_parallel", [True, False])
def test_each_rank_loads_its_share(tiny_model_dir: Path, expert_parallel: bool) -> None:
    """The ranks' shares put back together are the whole checkpoint: split tensors along their split,
    routed experts along the stack (expert parallelism) or their intermediate; the rest whole on each."""
    from dsv4serve.models.loader import load_weights, loaded_schema
    from dsv4serve.models.registry import config_from_dir, spec_for

    cfg = config_from_dir(tiny_model_dir)
    spec = spec_for(cfg.model_type)
    whole = load_weights(tiny_model_dir, spec, cfg, dtype=torch.float32)
    shares = [
        load_weights(
            tiny_model_dir, spec, cfg, dtype=torch.float32, shard=Shard(r, 2, expert_parallel=expert_parallel)
        )
        for r in range(2)
    ]
    schema = loaded_schema(spec.schema(cfg), spec.names(cfg))
    stacked = {n for n in schema if n not in spec.schema(cfg)}
    halves = 0
    for name, value in whole.items():
        parts = [s[name] for s in shares]
        assert isinstance(value, torch.Tensor)
        split = schema[name].split
        if name in stacked:
            dim = 0 if expert_parallel else (2 if name.endswith("w2") else 1)
        else:
            dim = {"rows": 0, "cols": -1, None: None}[split]
        if dim is None:
            assert all(torch.equal(p, value) for p in parts), name
        else:
            halves += 1
            assert all(p.shape[dim] * 2 == value.shape[dim] for p in parts), name  # type: ignore[union-attr]
            assert torch.equal(torch.cat(parts, dim), value), name  # type: ignore[arg-type]
    assert halves >= 4 * cfg.num_layers


def test_plan_counts_what_a_rank_loads(tiny_model_dir: Path) -> None:
    """`plan --devices 2 --layout tp` holds, per device, the parameters a rank loads."""
    from dsv4serve.models.loader import load_weights
    from dsv4serve.models.plan import device_share
    from dsv4serve.models.registry import config_from_dir, spec_for

    cfg = config_from_dir(tiny_model_dir)
    spec = spec_for(cfg.model_type)
    for layout, tp in (("tp", Shard(0, 2)), ("dp", None)):
        params, _ = device_share(spec, cfg, "bf16", layout, 2)
        if tp is not None:
            share = load_weights(tiny_model_dir, spec, cfg, dtype=torch.float32, shard=tp)
            assert params == sum(w.numel() for w in share.values())  # type: ignore[union-attr]
        whole = sum(w.numel() for w in load_weights(tiny_model_dir, spec, cfg, dtype=torch.float32).values())  # type: ignore[union-attr]
        assert params < whole


def _exchange_rank(rank: int, tp: int, dp: int, port: int, cores_tokens: tuple[int, ...]) -> None:
    """One rank of `test_the_cores_exchange_gathers_and_reduce_scatters`: its own core's tokens and
    its own experts' outputs (seeded by core and by rank) through `CoresExchange`, against the sums."""
    import torch.distributed as dist

    from dsv4serve.executor.ranks import CoresExchange

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * dp)
    core, t = divmod(rank, tp)
    cores = [dist.new_group([d * tp + i for i in range(tp)]) for d in range(dp)]
    across = [dist.new_group([d * tp + i for d in range(dp)]) for i in range(tp)]
    exchange = CoresExchange(across[t], cores[core], core, tp)
    tokens = [
        torch.randn(k, 3, generator=torch.Generator().manual_seed(d)) for d, k in enumerate(cores_tokens)
    ]
    (every,) = exchange.gather(cores_tokens, tokens[core])
    assert torch.equal(every, torch.cat(tokens))
    partials = [
        torch.randn(sum(cores_tokens), 3, generator=torch.Generator().manual_seed(100 + r))
        for r in range(tp * dp)
    ]
    start = sum(cores_tokens[:core])
    want = torch.stack(partials).sum(0)[start : start + cores_tokens[core]]
    torch.testing.assert_close(exchange.combine(partials[rank], cores_tokens), want)
    dist.destroy_process_group()


@pytest.mark.parametrize(("tp", "cores_tokens"), [(1, (5, 2)), (2, (3, 6)), (2, (1, 1))])
def test_the_cores_exchange_gathers_and_reduce_scatters(tp: int, cores_tokens: tuple[int, ...]) -> None:
    """Data-parallel cores with their experts spread over every rank: each core's tokens reach every
    rank in core order, and each rank gets back its own core's rows of every rank's experts' outputs
    summed (uneven cores, a core's rows not splitting evenly over its tensor-parallel ranks)."""
    import torch.multiprocessing as mp

    from dsv4serve.executor.ranks import free_port

    mp.spawn(_exchange_rank, args=(tp, len(cores_tokens), free_port(), cores_tokens), nprocs=tp * 2)


def _close_rank(index: int, port: int) -> None:
    import torch.distributed as dist

    from dsv4serve.executor.runner import ModelRunner

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    runner = ModelRunner.__new__(ModelRunner)  # a core of one rank: no lockstep thread, no other ranks
    runner.lockstep = runner.followers = None
    runner.close()
    assert not dist.is_initialized()


def test_a_closed_runner_leaves_its_group() -> None:
    """A data-parallel core of one rank joined the group in its own process: its runner's close
    destroys it, since an interpreter exiting with a live gloo group aborts now and then (`terminate
    called without an active exception`: 9 of 80 processes in a two-rank loop, 0 of 80 destroyed)."""
    import torch.multiprocessing as mp

    from tests.test_http_cli import free_port

    mp.spawn(_close_rank, args=(free_port(),), nprocs=1)
