"""Per-step cost of the allocator's slot messages (DSV4's six pools): build the `CacheLocs`, msgpack-encode,
decode.

Two steps, each timed as the median over repetitions:
  decode_256       256 requests, each at a random length in [1024, 8192), one new token each
  prefill_16x2048  16 requests prefilling 2048 tokens each from an empty cache
Slots are paged (P = 128) with random physical pages, as the allocator would hand them out. The
allocator's page tables are set up once, outside the timing; `build` is the slot arithmetic plus the
`CacheLocs` structs. Prints one JSON object.

    python benchmarks/bench_cache_locs.py [--reps 50] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from dsv4serve.protocol import SLOT_DTYPE, CacheLocs

PAGE = 128
HCA_RATIO = 128
POOLS = ("full", "swa", "c4", "c128", "c4_state", "c128_state")  # DSV4's layout, in its order
NUM_PAGES = 1 << 14  # physical pages per pool (2M slots: 256 requests x 8k tokens)


@dataclass(frozen=True)
class ReqState:
    """What the allocator knows about one request: lengths and a page table per pool."""

    rid: str
    row: int
    prefix_len: int
    seq_len: int
    pages: dict[str, list[int]]  # pool -> physical page of each logical page


def paged_slots(first: int, last: int, pages: list[int], ids: memoryview) -> bytes:
    """Packed slots of logical indices [first, last) in a paged pool: one memcpy per page touched.

    `ids` views the pool's identity array (`ids[s] == s`), so a run of slots is a slice of it.
    """
    if last <= first:
        return b""
    if first // PAGE == (last - 1) // PAGE:  # one page: the common case of a decode step
        shift = (pages[first // PAGE] - first // PAGE) * PAGE
        return ids[first + shift : last + shift].tobytes()
    runs = []
    for lp in range(first // PAGE, -(-last // PAGE)):
        shift = (pages[lp] - lp) * PAGE  # logical index -> physical slot
        runs.append(ids[max(first, lp * PAGE) + shift : min(last, lp * PAGE + PAGE) + shift])
    return b"".join(runs)


def build_one(step: int, req: ReqState, ids: memoryview) -> CacheLocs:
    pre, seq, pages = req.prefix_len, req.seq_len, req.pages
    # new state rows only: positions [max(prefix, keep_start), seq); keep_start = the last closed
    # ratio-4 window plus the open one / the open ratio-128 window
    c4_keep = max(pre, (seq // 4 - 1) * 4)
    c128_keep = max(pre, (seq // HCA_RATIO) * HCA_RATIO)
    return CacheLocs(
        step=step,
        rid=req.rid,
        row=req.row,
        prefix_len=pre,
        seq_len=seq,
        pools=POOLS,
        packed=(
            paged_slots(pre, seq, pages["full"], ids),
            paged_slots(pre, seq, pages["swa"], ids),
            paged_slots(pre // 4, seq // 4, pages["c4"], ids),
            paged_slots(pre // HCA_RATIO, seq // HCA_RATIO, pages["c128"], ids),
            paged_slots(c4_keep, seq, pages["c4_state"], ids),
            paged_slots(c128_keep, seq, pages["c128_state"], ids),
        ),
    )


def build_step(step: int, reqs: list[ReqState], ids: memoryview) -> tuple[CacheLocs, ...]:
    return tuple(build_one(step, req, ids) for req in reqs)


def make_requests(rng: random.Random, lengths: list[tuple[int, int]]) -> list[ReqState]:
    reqs = []
    for row, (pre, seq) in enumerate(lengths):
        num_pages = -(-seq // PAGE)
        pages = {pool: [rng.randrange(1, NUM_PAGES) for _ in range(num_pages)] for pool in POOLS}
        reqs.append(ReqState(rid=f"req-{row}", row=row, prefix_len=pre, seq_len=seq, pages=pages))
    return reqs


def check_slots(reqs: list[ReqState], locs: tuple[CacheLocs, ...]) -> None:
    """The fast path agrees with per-token arithmetic (full and c4 of every request)."""
    for req, loc in zip(reqs, locs, strict=True):
        full = [req.pages["full"][t // PAGE] * PAGE + t % PAGE for t in range(req.prefix_len, req.seq_len)]
        c4 = [
            req.pages["c4"][i // PAGE] * PAGE + i % PAGE for i in range(req.prefix_len // 4, req.seq_len // 4)
        ]
        assert loc.slots("full").tolist() == full
        assert loc.slots("c4").tolist() == c4


def median_us(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def measure(reqs: list[ReqState], reps: int) -> dict[str, float | int]:
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(tuple[CacheLocs, ...])
    ids = memoryview(array(SLOT_DTYPE, range(NUM_PAGES * PAGE)))  # built once per pool, at start-up
    locs = build_step(1, reqs, ids)
    check_slots(reqs, locs)
    data = encoder.encode(locs)
    assert decoder.decode(data) == locs
    build = median_us(lambda: build_step(1, reqs, ids), reps)
    encode = median_us(lambda: encoder.encode(locs), reps)
    decode = median_us(lambda: decoder.decode(data), reps)
    return {
        "requests": len(reqs),
        "slots": sum(loc.count(pool) for loc in locs for pool in POOLS),
        "build_us": round(build, 1),
        "encode_us": round(encode, 1),
        "decode_us": round(decode, 1),
        "total_us": round(build + encode + decode, 1),
        "bytes": len(data),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    decode_lengths = [(n, n + 1) for n in (rng.randrange(1024, 8192) for _ in range(256))]
    prefill_lengths = [(0, 2048)] * 16
    result = {
        "page_size": PAGE,
        "reps": args.reps,
        "decode_256": measure(make_requests(rng, decode_lengths), args.reps),
        "prefill_16x2048": measure(make_requests(rng, prefill_lengths), args.reps),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
