"""Tensor-parallel ranks on torch.distributed (gloo on the CPU, NCCL on CUDA, HCCL on Ascend).

Rank 0 is the engine's own runner (in the engine-core process, or the engine's one process); ranks 1 ..
N-1 are worker processes it spawns, one per device (`device` N + rank), each a `ModelRunner` over its
share of the weights (`layers/parallel.py`). Rank 0 sends every table write and step launch to every
other rank, in the order it makes them (`RankWriteLocs`, `RankLaunch`: msgspec frames over a pipe;
tensors never travel), then makes it itself: each rank runs the same step on its share, the layers'
partial products summed by all-reduce. Sampling is replicated (the logits, and so the tokens, are the
same on every rank: a lookahead's input is taken on each rank's device); rank 0's tokens are the
step's.

Faults: a rank whose process dies, or a collective that fails or waits past RANK_TIMEOUT_S, leaves the
ranks out of step: `RanksBroken` (naming the rank and the step where known) then stops the engine —
every live request gets an error (the actors' crash path) and the other ranks exit when rank 0's pipe
closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection

import msgspec
import torch
import torch.distributed as dist

from dsv4serve import logs
from dsv4serve.backends import rank_device
from dsv4serve.config import EngineConfig
from dsv4serve.layers.parallel import Shard
from dsv4serve.protocol import RankMsg, RankStop

RANK_TIMEOUT_S = 120  # a collective waiting longer fails (its rank then exits; rank 0 raises RanksBroken)
READY_TIMEOUT_S = 900  # for the other ranks to load their weights


class RanksBroken(RuntimeError):
    """The ranks are out of step (a rank died, a collective failed): the engine must stop."""


def join_group(engine: EngineConfig, collectives: str, rank: int, port: int) -> Shard:
    """Join the group of `engine.tensor_parallel_size` ranks rendezvousing on 127.0.0.1:`port`."""
    size = engine.tensor_parallel_size
    device = torch.device(rank_device(engine.device, rank))
    if device.index is not None:  # the rank's accelerator, for the collectives' own buffers
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(
        collectives,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=RANK_TIMEOUT_S),
    )

    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    return Shard(rank, size, reduce, expert_parallel=engine.expert_parallel_size > 1)


def agree_min(value: int, device: torch.device) -> int:
    """The least of every rank's `value` (the KV capacity every rank can hold)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Followers:
    """Ranks 1 .. N-1 as rank 0 drives them: their processes and the sockets that feed them."""

    def __init__(self, procs: Sequence[subprocess.Popen[bytes]], conns: Sequence[Connection]) -> None:
        self.procs, self.conns = procs, conns
        self.encoder = msgspec.msgpack.Encoder()
        self.lock = threading.Lock()  # table writes (trio thread) and launches (a worker thread)
        self.broken: str | None = None

    @classmethod
    def start(cls, model_dir: str, engine: EngineConfig, port: int) -> Followers:
        """Start ranks 1 .. N-1 (`rank_process.py`); they load their shares while rank 0 loads its own.
        Each runs in a session of its own: a terminal's Ctrl-C reaches rank 0 only, which stops them."""
        procs, conns = [], []
        for rank in range(1, engine.tensor_parallel_size):
            ours, theirs = socket.socketpair()
            args = {"model_dir": model_dir, "engine": dataclasses.asdict(engine), "rank": rank, "port": port}
            args["log_level"] = logs.current_level()
            with theirs:
                argv = [sys.executable, "-m", "dsv4serve.executor.rank_process", str(theirs.fileno())]
                procs.append(
                    subprocess.Popen(
                        [*argv, json.dumps(args)],
                        pass_fds=(theirs.fileno(),),
                        stdin=subprocess.DEVNULL,
                        stdout=sys.stderr.fileno(),  # stdout may be the stdio front door's protocol stream
                        start_new_session=True,
                    )
                )
            conns.append(Connection(ours.detach()))
        return cls(procs, conns)

    def wait_ready(self) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                ready = conn.poll(READY_TIMEOUT_S) and conn.recv_bytes() == b"ready"
            except (EOFError, OSError):
                ready = False
            if not ready:
                code = self.procs[rank - 1].poll()
                raise RanksBroken(f"rank {rank} did not load its share (exit code {code})")

    def send(self, msg: RankMsg, step: int | None = None) -> None:
        """To every other rank, in call order; RanksBroken if one is gone."""
        data = self.encoder.encode(msg)
        with self.lock:
            if self.broken is not None:
                raise RanksBroken(self.broken)
            for rank, conn in enumerate(self.conns, start=1):
                try:
                    conn.send_bytes(data)
                except OSError:
                    code = self.procs[rank - 1].poll()
                    self.broken = f"rank {rank} is gone (exit code {code}) before step {step}"
                    raise RanksBroken(self.broken) from None

    def failed(self, step: int, exc: BaseException) -> RanksBroken:
        """A step failed on rank 0 once the others had it: the ranks are out of step from now on."""
        dead = [
            f"rank {r} (exit code {p.poll()})" for r, p in enumerate(self.procs, 1) if p.poll() is not None
        ]
        gone = f"; {', '.join(dead)} gone" if dead else ""
        self.broken = f"step {step} failed on rank 0: {type(exc).__name__}: {exc}{gone}"
        return RanksBroken(self.broken)

    def close(self) -> None:
        with self.lock:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(self.encoder.encode(RankStop()))
                conn.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
