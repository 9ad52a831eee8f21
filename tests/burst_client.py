"""`python tests/burst_client.py URL N`: N streaming completions opened at once against URL, each on its
own connection; prints a JSON object counting how each ended ("done", an HTTP status, or the transport
error's name). Run as a process of its own: the resets issue 29 reports came from separate clients."""

from __future__ import annotations

import collections
import json
import sys

import httpx
import trio


async def burst(url: str, num: int) -> dict[str, int]:
    ends = ["none"] * num

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "tiny", "prompt": f"burst {i}", "max_tokens": 2, "stream": True}
        try:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    ends[i] = str(r.status_code)
                    return
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        ends[i] = "done"
        except httpx.TransportError as exc:
            ends[i] = type(exc).__name__

    limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for i in range(num):
                    nursery.start_soon(one, http, i)
    return dict(collections.Counter(ends))


if __name__ == "__main__":
    print(json.dumps(trio.run(burst, sys.argv[1], int(sys.argv[2]))))
