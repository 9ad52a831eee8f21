"""`serve --http` under N concurrent streaming clients against `Engine.generate` on the same prompts,
in the same run (issue 29): per decode step, TTFT and inter-token latency percentiles, output tokens/s.

A checkpoint of DeepSeek-V4 dimensions (`--layers`, `--experts`; random bf16 weights, written once to
`--cache`) is served three ways: `Engine.generate` in this process, `serve --http` (the engine core in
its own process, the default) and `serve --http --single-process`. For each concurrency N, N random
prompts of `--prompt-len` token ids run with 1 and with 1 + `--steps` new tokens (greedy, `ignore_eos`;
after a warm-up; the second twice): per decode step = (T(1 + steps) - T(1)) / steps, and again from the
repeat (`step_ms_again`: a first-time cost such as a graph capture shows as a gap). HTTP clients are
`--client-procs` processes of raw-socket streaming clients (one Python client would be the bottleneck at
256 streams).

    python benchmarks/bench_serving.py [--concurrency 64 256] [--out FILE]      # the H200 run
    python benchmarks/bench_serving.py --dry-run                               # the tiny model, CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

REPORT: dict[str, Any] = {"bench": "serving"}


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def checkpoint(args: argparse.Namespace) -> Path:
    from dsv4serve.models.deepseek_v4.tiny import make_tiny
    from dsv4serve.models.registry import config_file

    if args.dry_run:
        return make_tiny(Path(args.cache) / "serving-dry", seed=0)
    out = Path(args.cache) / f"serving-dsv4-l{args.layers}-e{args.experts}"
    if (out / "config.json").is_file():
        return out
    raw = json.loads(config_file("deepseek-v4-flash").read_text())
    keep = (
        "hidden_size",
        "num_attention_heads",
        "head_dim",
        "qk_rope_head_dim",
        "q_lora_rank",
        "o_lora_rank",
    )
    keep += ("o_groups", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts", "index_n_heads")
    keep += ("index_head_dim", "index_topk", "sliding_window", "hc_mult", "vocab_size", "num_hash_layers")
    overrides = {k: raw[k] for k in keep if k in raw}
    overrides |= {"num_hidden_layers": args.layers, "n_routed_experts": args.experts}
    overrides["compress_ratios"] = raw["compress_ratios"][: args.layers]
    begin = time.perf_counter()
    make_tiny(out, seed=0, dtype="bfloat16", **overrides)
    log("checkpoint written", round(time.perf_counter() - begin, 1), "s")
    return out


def prompts(vocab: int, n: int, length: int, tag: int) -> list[list[int]]:
    rng = random.Random(tag)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def knobs(args: argparse.Namespace, n_max: int) -> dict[str, Any]:
    return {
        "device": "cpu" if args.dry_run else "cuda",
        "max_num_seqs": n_max,
        "max_num_batched_tokens": 8192,
        "max_total_tokens": n_max * (args.prompt_len + args.steps + 8) + 8192,
    }


# ---------------------------------------------------------------- Engine.generate


def embedded(model: Path, args: argparse.Namespace, vocab: int, core_process: bool = False) -> dict[str, Any]:
    """`AsyncEngine.stream` per prompt, all at once (what `Engine.generate` submits), timed per token;
    `core_process`: the engine core in a process of its own, as behind `serve --http`."""
    from dsv4serve import AsyncEngine, SamplingParams
    from dsv4serve.protocol import TokenEvent

    async def run(engine: AsyncEngine, batch: list[list[int]], new: int) -> list[tuple[float, list[float]]]:
        out: list[tuple[float, list[float]]] = [(0.0, []) for _ in batch]
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

        async def one(i: int) -> None:
            start, times = time.perf_counter(), []
            async for event in engine.stream(batch[i], params):
                if isinstance(event, TokenEvent):
                    times.append(time.perf_counter())
            out[i] = (start, times)

        async with trio.open_nursery() as nursery:
            for i in range(len(batch)):
                nursery.start_soon(one, i)
        return out

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with AsyncEngine(
            model, core_process=core_process, **knobs(args, max(args.concurrency))
        ) as engine:
            for n in args.concurrency:
                batch = prompts(vocab, n, args.prompt_len, n)
                runs = []
                for new in run_tokens(args):  # the first: warm-up (graphs, compiles)
                    log(f"run: embedded{' core' if core_process else ''} {n} streams, {new} tokens")
                    begin = time.perf_counter()
                    streams = await run(engine, batch, new)
                    runs.append((time.perf_counter() - begin, streams))
                out[f"n{n}"] = figures(n, args, runs)
                log("embedded" + (" core process" if core_process else ""), n, out[f"n{n}"])
        return out

    return trio.run(main)


Run = tuple[float, list[tuple[float, list[float]]]]  # (wall, each stream's (start, token times))


def run_tokens(args: argparse.Namespace) -> tuple[int, ...]:
    """New tokens of each run: a warm-up, one token, then the measured run twice (`step_ms_again`: a
    first-time cost in the first, such as a graph capture, shows as a gap between the two)."""
    return (1 + args.steps, 1, 1 + args.steps, 1 + args.steps)


def figures(n: int, args: argparse.Namespace, runs: list[Run]) -> dict[str, Any]:
    """From (wall, streams) of the runs of `run_tokens` (warm-up first)."""
    (one_wall, _), (wall, streams) = runs[1], runs[2]
    again = runs[3][0]
    failed = sum(1 for _, run in runs for _, t in run if not t)  # reset or refused (HTTP): none expected
    streams = [(s, t) for s, t in streams if t]
    counts = [len(t) for _, t in streams]  # HTTP: each chunk's usage counts its tokens
    assert all(c >= 1 + args.steps for c in counts), f"streams ended early: {sorted(counts)[:5]}"
    streams = [(s, t[: 1 + args.steps]) for s, t in streams]
    ttft = [t[0] - s for s, t in streams]
    itl = [b - a for _, t in streams for a, b in itertools.pairwise(t)]
    return {
        "step_ms": round((wall - one_wall) / args.steps * 1e3, 3),
        "step_ms_again": round((again - one_wall) / args.steps * 1e3, 3),
        "ttft_all_s": round(one_wall, 3),
        "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 1),
        "ttft_p99_ms": round(_pct(ttft, 99) * 1e3, 1),
        "itl_p50_ms": round(statistics.median(itl) * 1e3, 3),
        "itl_p99_ms": round(_pct(itl, 99) * 1e3, 3),
        "itl_max_ms": round(max(itl) * 1e3, 3),  # a stall of a few streams hides from p99
        "last_token_s": round(max(t[-1] for _, t in streams) - min(s for s, _ in streams), 3),
        "output_tokens_per_s": round(n * (1 + args.steps) / wall, 1),
        "streams_done": len(streams),
        "streams_failed": failed,
    }


# ---------------------------------------------------------------- serve --http and its clients


def request_bytes(prompt: list[int], max_tokens: int) -> bytes:
    """One streaming completion's HTTP/1.1 request (greedy, `ignore_eos`)."""
    body = json.dumps(
        {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        | {"ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


async def _stream(port: int, request: bytes, times: list[float]) -> None:
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    async with sock:
        await sock.send_all(request)
        tail = b""
        while data := await sock.receive_some(1 << 16):
            if not tail and not times and not data.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the server answered {data[:300]!r}")
            now = time.perf_counter()
            chunk = tail + data
            counts = _COMPLETION_TOKENS.findall(chunk)  # a chunk may carry several tokens' text
            if counts:
                times.extend([now] * (int(counts[-1]) - len(times)))
            if b"[DONE]" in chunk:
                return
            tail = chunk[-64:]


def client_proc(job: tuple[int, list[list[int]], int]) -> list[tuple[float, list[float]]]:
    """A client process's streams, all at once: (start, token times) each."""
    port, batch, max_tokens = job

    async def main() -> list[tuple[float, list[float]]]:
        out: list[tuple[float, list[float]]] = [(0.0, []) for _ in batch]

        async def one(i: int) -> None:
            request = request_bytes(batch[i], max_tokens)
            times: list[float] = []
            start = time.perf_counter()
            try:
                await _stream(port, request, times)
            except (OSError, RuntimeError) as exc:  # a reset or a refusal: counted, not fatal
                log("stream failed:", type(exc).__name__, str(exc)[:200])
                times = []
            out[i] = (start, times)

        async with trio.open_nursery() as nursery:
            for i in range(len(batch)):
                nursery.start_soon(one, i)
        return out

    return trio.run(main)


def over_http(
    model: Path, args: argparse.Namespace, vocab: int, single: bool, fronts: int = 1
) -> dict[str, Any]:
    port = _free_port()
    argv = [sys.executable, "-m", "dsv4serve", "serve", "--http", "--model", str(model), "--port", str(port)]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in knobs(args, max(args.concurrency)).items()]
    argv += ["--log-level", args.server_log_level, "--served-model-name", "m"]
    argv += ["--single-process"] if single else ["--api-server-count", str(fronts)]
    proc = subprocess.Popen(argv)
    out: dict[str, Any] = {}
    try:
        _wait_ready(port, proc)
        with multiprocessing.get_context("spawn").Pool(args.client_procs) as pool:
            for n in args.concurrency:
                batch = prompts(vocab, n, args.prompt_len, n)
                jobs = [(port, batch[i :: args.client_procs], 0) for i in range(args.client_procs)]
                runs = []
                for new in run_tokens(args):
                    log(
                        f"run: http {fronts} fronts {n} streams, {new} tokens"
                    )  # marks the server's log lines
                    begin = time.perf_counter()
                    got = pool.map(client_proc, [(p, b, new) for p, b, _ in jobs if b])
                    runs.append((time.perf_counter() - begin, [s for part in got for s in part]))
                out[f"n{n}"] = figures(n, args, runs)
                log("http" + (" single-process" if single else ""), n, out[f"n{n}"])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if re.match(rb"HTTP/1.1 200", s.recv(64)):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=8)
    parser.add_argument("--cache", default=os.environ.get("DSV4SERVE_CACHE", "/tmp/dsv4serve-bench"))
    parser.add_argument("--skip-single", action="store_true", help="no `--single-process` server")
    parser.add_argument(
        "--embedded-core",
        action="store_true",
        help="also `AsyncEngine(core_process=True)`: the boundary alone",
    )
    parser.add_argument(
        "--api-server-count",
        type=int,
        nargs="+",
        default=[1],
        help="`serve --http` with each number of front processes (`http`, `http_4_fronts`, ...)",
    )
    parser.add_argument(
        "--server-log-level", default="warning", help="info: the server's graph captures among the runs"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU: checks the flow")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU at the sizes given")
    args = parser.parse_args()
    if args.tiny:
        args.dry_run = True
    elif args.dry_run:
        args.concurrency, args.prompt_len, args.steps, args.client_procs = [4], 16, 4, 2
    from dsv4serve import logs
    from dsv4serve.models.registry import config_from_dir

    logs.configure(args.server_log_level)  # info: the embedded engine's steps too
    model = checkpoint(args)
    vocab = config_from_dir(model).vocab_size
    REPORT.update(layers=args.layers, experts=args.experts, prompt_len=args.prompt_len, steps=args.steps)

    def save() -> None:  # after each door: a run cut short keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps(REPORT, indent=1))

    REPORT["embedded"] = embedded(model, args, vocab)
    save()
    if args.embedded_core:
        REPORT["embedded_core_process"] = embedded(model, args, vocab, core_process=True)
        save()
    for fronts in args.api_server_count:
        door = "http" if fronts == 1 else f"http_{fronts}_fronts"
        REPORT[door] = over_http(model, args, vocab, False, fronts)
        save()
    if not args.skip_single:
        REPORT["http_single_process"] = over_http(model, args, vocab, single=True)
    doors = [d for d in REPORT if d.startswith(("embedded_", "http"))]
    for n in args.concurrency:
        key, base = f"n{n}", REPORT["embedded"][f"n{n}"]
        ratios = {}
        for door in doors:
            for figure in ("step_ms", "ttft_p50_ms"):
                ratios[f"{door}_over_embedded_{figure}"] = round(REPORT[door][key][figure] / base[figure], 3)
        REPORT.setdefault("ratios", {})[key] = ratios
    save()
    print(json.dumps(REPORT, indent=1))


if __name__ == "__main__":
    main()
