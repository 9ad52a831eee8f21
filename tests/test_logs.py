"""The JSON log lines: whole lines even when several processes (fronts, engine cores, ranks) share one
stderr pipe."""

from __future__ import annotations

import json
import subprocess
import sys

WRITER = """
import sys
import structlog
from dsv4serve import logs
logs.configure("info")
log = structlog.get_logger().bind(actor="p" + sys.argv[1])
for i in range(int(sys.argv[2])):
    log.info("line", i=i, pad="x" * 200)
"""


def test_processes_sharing_a_pipe_write_whole_json_lines() -> None:
    """Four processes log 3,000 lines each into one pipe at once: every line read back is one JSON
    object, and every one of them is there."""
    procs, n = 4, 3000
    shell = " & ".join(f"{sys.executable} -c '{WRITER}' {p} {n}" for p in range(procs)) + " & wait"
    out = subprocess.run(["bash", "-c", shell], stderr=subprocess.PIPE, text=True, timeout=300).stderr
    events = [json.loads(line) for line in out.splitlines()]
    assert sorted((e["actor"], e["i"]) for e in events) == sorted(
        (f"p{p}", i) for p in range(procs) for i in range(n)
    )
