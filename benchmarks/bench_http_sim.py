"""The front door's cost with the device taken out, on any machine: `Engine.generate` and `serve --http`
(engine in the server's process) over the demo's tiny checkpoint whose device is simulated
(`bench_engine_host.SimulatedDevice`: each step takes `--device-ms` after its launch; the forward never
runs), N streams at once, per decode step = (T(1 + steps tokens) - T(1 token)) / steps each way, the
HTTP clients in `--client-procs` processes (`bench_serving.client_proc`). What the HTTP path adds per
step is then the front's and the clients' host work, not the model's: on a GPU host the same work meets
a real device step. Also the server process's CPU time per streamed token (Linux), which the machine's
other load disturbs less than the wall times.

    python benchmarks/bench_http_sim.py [--concurrency 64] [--device-ms 5.5] [--steps 64]

Prints one JSON object. Clients, server and engine share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine_host import TOKEN, SimulatedDevice
from bench_serving import _free_port, _wait_ready, client_proc


def simulated_options(device_ms: float, max_seqs: int) -> Any:
    from dsv4serve.actors.system import SystemOptions
    from dsv4serve.actors.tokenizer_core import load_tokenizer
    from dsv4serve.config import EngineConfig
    from dsv4serve.demo import default_cache_dir, tiny_checkpoint
    from dsv4serve.executor.graphs import is_decode
    from dsv4serve.executor.runner import ModelRunner

    model_dir, _ = tiny_checkpoint(default_cache_dir(), 0)
    engine = EngineConfig(device="cpu", max_num_seqs=max_seqs, max_num_batched_tokens=8192)
    runner = ModelRunner(model_dir, engine)
    runner.launch = SimulatedDevice(device_ms / 1e3, 0.0).launch  # type: ignore[method-assign]
    runner.replays = lambda plan: is_decode(plan.items)  # type: ignore[method-assign]
    return SystemOptions(model_dir, engine, prebuilt=(runner, load_tokenizer(model_dir)))


def serve(port: int, device_ms: float, max_seqs: int, interval: int) -> None:
    import trio

    from dsv4serve import logs
    from dsv4serve.http.server import HttpOptions, serve_http

    logs.configure("warning")
    http = HttpOptions(port=port, model_name="m", stream_interval=interval)
    trio.run(serve_http, simulated_options(device_ms, max_seqs), http)


def embedded_step_ms(device_ms: float, n: int, steps: int) -> float:
    from dsv4serve import Engine, SamplingParams

    prompts = [[TOKEN] * 64 for _ in range(n)]
    walls = []
    with Engine._of(simulated_options(device_ms, n)) as engine:
        for tokens in (1 + steps, 1, 1 + steps):
            begin = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
            walls.append(time.perf_counter() - begin)
    return (walls[2] - walls[1]) / steps * 1e3


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far (Linux's /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_step_ms(device_ms: float, n: int, steps: int, procs: int, interval: int) -> tuple[float, int, float]:
    port = _free_port()
    argv = [
        sys.executable,
        __file__,
        "--serve",
        str(port),
        "--device-ms",
        str(device_ms),
        "--max-seqs",
        str(n),
    ]
    server = subprocess.Popen(argv)
    try:
        _wait_ready(port, server)
        prompts = [[TOKEN] * 64 for _ in range(n)]
        walls, cpus, failed = [], [], 0
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            for tokens in (1 + steps, 1, 1 + steps):
                jobs = [(port, prompts[i::procs], tokens) for i in range(procs) if prompts[i::procs]]
                begin, cpu = time.perf_counter(), cpu_s(server.pid)
                got = pool.map(client_proc, jobs)
                walls.append(time.perf_counter() - begin)
                cpus.append(cpu_s(server.pid) - cpu)
                failed += sum(1 for part in got for _, times in part if len(times) < tokens)
    finally:
        server.terminate()
        server.wait(timeout=60)
    per_token_us = (cpus[2] - cpus[1]) / (steps * n) * 1e6  # the server's CPU per streamed token
    return (walls[2] - walls[1]) / steps * 1e3, failed, per_token_us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64])
    parser.add_argument("--device-ms", type=float, default=5.5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--stream-interval", type=int, nargs="+", default=[1], help="serve --http's")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-seqs", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.device_ms, args.max_seqs, args.stream_interval[0])
        return
    from dsv4serve import logs

    logs.configure("warning")
    report: dict[str, Any] = {"bench": "http_sim", "device_ms": args.device_ms, "steps": args.steps}
    for n in args.concurrency:
        embedded = embedded_step_ms(args.device_ms, n, args.steps)
        report[f"n{n}"] = {"embedded_step_ms": round(embedded, 3)}
        for interval in args.stream_interval:
            http, failed, cpu = http_step_ms(args.device_ms, n, args.steps, args.client_procs, interval)
            report[f"n{n}"][f"interval{interval}"] = {
                "http_step_ms": round(http, 3),
                "server_cpu_us_per_token": round(cpu, 1),
                "http_over_embedded": round(http / embedded, 3),
                "streams_short": failed,
            }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
