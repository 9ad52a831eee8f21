"""Progress of slow start-up work (loading weights): a tqdm bar when stderr is a terminal, otherwise
a few log lines (structlog, on stderr); never stdout, which may carry protocol lines."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import structlog
from tqdm import tqdm

T = TypeVar("T")
Progress = Callable[[Sequence[T], str], Iterator[T]]
NUM_LOG_LINES = 10  # without a terminal: one line per tenth of the work, and one at the end


def shown(items: Sequence[T], what: str) -> Iterator[T]:
    """Iterate `items`, showing how far along it is: `what` names the work ("weights")."""
    if sys.stderr.isatty():
        yield from tqdm(items, desc=f"loading {what}", unit="tensor", file=sys.stderr, leave=False)
        return
    log = structlog.get_logger().bind(actor="loader")
    total, start = len(items), time.perf_counter()
    every = max(1, total // NUM_LOG_LINES)
    for i, item in enumerate(items, 1):
        yield item
        if i % every == 0 or i == total:
            log.info("loading", what=what, done=i, total=total, seconds=round(time.perf_counter() - start, 2))


def silent(items: Sequence[T], what: str) -> Iterator[T]:
    return iter(items)
