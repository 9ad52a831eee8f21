"""A tensor-parallel rank other than 0: `python -m dsv4serve.executor.rank_process FD ARGS`, started by
rank 0 (`ranks.Followers`) with one end of a socket pair as FD and its arguments as JSON (model
directory, engine knobs, rank, rendezvous port); or, on another host (`dsv4serve ranks`), with
`connect` for FD: it connects to host 0 once loaded. It loads its share, says `ready`, then replays
rank 0's table writes and step launches until told to stop or until rank 0's end closes. A failure
ends the process (the other ranks' collectives then fail, and rank 0 stops the engine)."""

from __future__ import annotations

import json
import socket
import sys
from multiprocessing.connection import Connection
from typing import Any, assert_never

import msgspec
import structlog

from dsv4serve import logs
from dsv4serve.config import EngineConfig
from dsv4serve.executor.ranks import Place, connect_to_leader
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.protocol import RankLaunch, RankMsg, RankStop, RankWriteLocs


def serve_rank(model_dir: str, fields: dict[str, Any], place: Place, conn: Connection | None) -> None:
    """`conn` None: another host's rank, which connects to its leader once loaded."""
    log = structlog.get_logger().bind(actor="rank", dp_rank=place.dp_rank, tp_rank=place.tp_rank)
    engine = EngineConfig(**fields)
    runner = ModelRunner(model_dir, engine, place=place)
    conn = conn or connect_to_leader(engine, place)
    conn.send_bytes(b"ready")
    decoder = msgspec.msgpack.Decoder(RankMsg)
    try:
        while True:
            try:
                msg = decoder.decode(conn.recv_bytes())
            except EOFError:  # rank 0 is gone
                return
            match msg:
                case RankWriteLocs(locs=locs):
                    runner.write_locs(locs)
                case RankLaunch(plan=plan, all_logits=all_logits):
                    runner.launch(plan, all_logits).wait()
                case RankStop():
                    return
                case _:
                    assert_never(msg)
    except Exception:
        log.exception("rank_failed")
        raise
    finally:
        runner.close()  # leaves the group (a follower has no ranks or lockstep of its own)


def main(argv: list[str]) -> int:
    raw = json.loads(argv[1])
    logs.configure(raw["log_level"])
    conn = None if argv[0] == "connect" else Connection(socket.socket(fileno=int(argv[0])).detach())
    serve_rank(raw["model_dir"], raw["engine"], Place(**raw["place"]), conn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
