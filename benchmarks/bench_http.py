"""HTTP overhead of `serve --http` against the embedded path, on the demo's tiny checkpoint (CPU).

The same greedy streaming requests run one at a time, first straight through the `EngineHandle`
(what `AsyncEngine.stream` does), then through HTTP + SSE on loopback; prints JSON with the mean time
per request and per streamed token of each, and their differences (the HTTP overhead).

    python benchmarks/bench_http.py [--requests 20] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import httpx
import trio

from dsv4serve import logs
from dsv4serve.actors.system import SystemOptions
from dsv4serve.config import EngineConfig
from dsv4serve.demo import default_cache_dir, tiny_checkpoint
from dsv4serve.http.server import HttpOptions, HttpServer, serve_http
from dsv4serve.protocol import DoneEvent, Event, SamplingParams, Submit


async def embedded(server: HttpServer, n: int, max_tokens: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        send, recv = trio.open_memory_channel[Event](math.inf)
        spec = SamplingParams(temperature=0, max_tokens=max_tokens)
        submit = Submit(rid=f"e{i}", prompt=f"request {i}", prompt_token_ids=None, params=spec, stream=True)
        server.handle.submit(submit, send)
        async for event in recv:
            if isinstance(event, DoneEvent):
                break
    return time.perf_counter() - start


async def over_http(server: HttpServer, n: int, max_tokens: int) -> float:
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.urls[0], timeout=120) as http:
        for i in range(n):
            body = {
                "model": "tiny",
                "prompt": f"request {i}",
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            }
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
    return time.perf_counter() - start


async def main(model: Path, n: int, max_tokens: int) -> dict[str, float]:
    options = SystemOptions(model, EngineConfig(max_total_tokens=4096))
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(serve_http, options, HttpOptions(port=0, model_name="tiny"))
        await embedded(server, 2, max_tokens)  # warm-up
        await over_http(server, 2, max_tokens)
        t_api = await embedded(server, n, max_tokens)
        t_http = await over_http(server, n, max_tokens)
        server.begin_drain()
    per = n * max_tokens
    return {
        "requests": n,
        "max_tokens": max_tokens,
        "embedded_ms_per_request": 1e3 * t_api / n,
        "http_ms_per_request": 1e3 * t_http / n,
        "http_overhead_ms_per_request": 1e3 * (t_http - t_api) / n,
        "http_overhead_ms_per_token": 1e3 * (t_http - t_api) / per,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    logs.configure("warning")
    model_dir, _ = tiny_checkpoint(default_cache_dir(), 0)
    print(json.dumps(trio.run(main, model_dir, args.requests, args.max_tokens), indent=2))
