"""The engine's steps in each run of `bench_serving.py --server-log-level info` (its stderr, e.g.
`$OUT/serving.err` of `gpu_session.sh front`): per `run:` marker, the steps that followed it by kind (pure
prefill, prefill carrying decodes, decodes only) with their median durations, and the spacing between
steps. Splits where a door's time goes: the core's steps themselves, or the gaps between them.

    python benchmarks/serving_timeline.py serving.err [--detail]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from datetime import datetime
from pathlib import Path

Step = tuple[float, int, int, float]  # (time s, prefill tokens, decodes, duration ms)


def sections(lines: list[str]) -> dict[str, list[Step]]:
    out: dict[str, list[Step]] = {}
    current: str | None = None
    for line in lines:
        if line.startswith("run:"):
            current = f"{len(out)}: {line.strip()}"
            out[current] = []
            continue
        if current is None or '"event": "step"' not in line:
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        at = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        out[current].append((at, e["num_prefill_tokens"], e["num_decode"], e["duration_ms"]))
    return out


def summary(steps: list[Step]) -> dict[str, object]:
    def kind(chosen: list[Step]) -> dict[str, float]:
        if not chosen:
            return {"n": 0}
        return {"n": len(chosen), "duration_ms_p50": round(statistics.median(s[3] for s in chosen), 2)}

    gaps = [(b[0] - a[0]) * 1e3 for a, b in itertools.pairwise(steps)]
    return {
        "steps": len(steps),
        "span_s": round(steps[-1][0] - steps[0][0], 3) if steps else 0.0,
        "prefill": kind([s for s in steps if s[1] and not s[2]]),
        "mixed": kind([s for s in steps if s[1] and s[2]]),
        "decode": kind([s for s in steps if not s[1]]),
        "gap_ms_p50": round(statistics.median(gaps), 2) if gaps else 0.0,
        "gap_ms_max": round(max(gaps), 2) if gaps else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log", type=Path)
    parser.add_argument("--detail", action="store_true", help="each run's first 40 steps too")
    args = parser.parse_args()
    for name, steps in sections(args.log.read_text(errors="replace").splitlines()).items():
        print(name, json.dumps(summary(steps)))
        if args.detail and steps:
            for at, prefill, decodes, ms in steps[:40]:
                since = (at - steps[0][0]) * 1e3
                print(f"    +{since:9.1f} ms  prefill {prefill:5d}  decodes {decodes:3d}  {ms:.1f} ms")


if __name__ == "__main__":
    main()
