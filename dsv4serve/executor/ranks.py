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
import hmac
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from dsv4serve import logs
from dsv4serve.backends import rank_device, share_host
from dsv4serve.config import EngineConfig
from dsv4serve.layers.parallel import Experts, Route, Shard
from dsv4serve.protocol import RankMsg, RankStop, SamplingParams, StepItem, StepPlan

# A collective waiting longer fails (every group's; the first one after loading waits for the slowest
# rank's weights). A rank whose process dies fails its peers' collectives at once on gloo.
RANK_TIMEOUT_S = 600
READY_TIMEOUT_S = 900  # for the other ranks to load their weights


class RanksBroken(RuntimeError):
    """The ranks are out of step (a rank died, a collective failed): the engine must stop."""


@dataclass(frozen=True)
class Place:
    """A rank of the engine: its data-parallel rank (which engine core), its rank in that core's
    tensor-parallel group, and the port every rank of the engine rendezvouses on. Global rank = dp_rank x
    tensor_parallel_size + tp_rank; its device is the engine's device index + the global rank (with
    several hosts, + its rank on its host: global rank modulo ranks_per_node)."""

    dp_rank: int
    tp_rank: int
    port: int

    def global_rank(self, engine: EngineConfig) -> int:
        return self.dp_rank * engine.tensor_parallel_size + self.tp_rank

    def device(self, engine: EngineConfig) -> str:
        rank = self.global_rank(engine)
        return rank_device(engine.device, rank % engine.ranks_per_node if engine.nnodes > 1 else rank)

    @classmethod
    def first(cls, engine: EngineConfig) -> Place:
        """The engine's first rank (the only core's leader): its rendezvous on a free port of this host,
        or on master_port with several hosts."""
        return cls(0, 0, engine.master_port if engine.nnodes > 1 else free_port())


@dataclass(frozen=True)
class Joined:
    """This rank's share (`Shard`) and, when the expert group spans the data-parallel ranks, the CPU
    group of the cores' leaders (tp_rank 0) that keeps their steps in lockstep."""

    shard: Shard
    leaders: Any = None


def join_group(engine: EngineConfig, collectives: str, place: Place) -> Joined:
    """Join every rank of the engine (tensor_parallel_size x data_parallel_size). Groups, created by
    every rank in the same order: each core's tensor-parallel ranks; with the expert group spanning
    the cores (expert_parallel_size = every rank, more than one core), the ranks of equal tp_rank across
    the cores (whose tokens each MoE layer gathers) and the cores' leaders (a gloo group)."""
    tp, dp = engine.tensor_parallel_size, engine.data_parallel_size
    world, me = tp * dp, place.global_rank(engine)
    share_host(engine.device, engine.ranks_per_node)
    device = torch.device(place.device(engine))
    if device.index is not None:  # the rank's accelerator, for the collectives' own buffers
        torch.accelerator.set_device_index(device.index)
    dist.init_process_group(
        collectives,
        init_method=f"tcp://{engine.master_addr}:{place.port}",
        rank=me,
        world_size=world,
        timeout=timedelta(seconds=RANK_TIMEOUT_S),
    )
    limit = timedelta(seconds=RANK_TIMEOUT_S)
    cores = (
        [dist.new_group([d * tp + t for t in range(tp)], timeout=limit) for d in range(dp)]
        if dp > 1
        else [None]
    )
    tp_group = cores[place.dp_rank]
    ep = engine.expert_parallel_size > 1
    if not (ep and dp > 1):
        return Joined(Shard(place.tp_rank, tp, _all_reduce(tp_group), expert_parallel=ep))
    across = [dist.new_group([d * tp + t for d in range(dp)], timeout=limit) for t in range(tp)]
    leaders = dist.new_group([d * tp for d in range(dp)], backend="gloo", timeout=limit)
    exchange: Any = CoresExchange(across[place.tp_rank], tp_group, place.dp_rank, tp)
    if engine.expert_dispatch == "all_to_all":
        exchange = AllToAllExchange()
    shard = Shard(
        place.tp_rank, tp, _all_reduce(tp_group), expert_parallel=True, expert_rank=me, expert_size=world,
        exchange=exchange,
    )  # fmt: skip
    return Joined(shard, leaders)


def _all_reduce(group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    if group is not None and dist.get_world_size(group) == 1:
        return _unchanged

    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return reduce


class CoresExchange:
    """`Exchange` over the cores (`layers/parallel.py`): all-gather then reduce-scatter, each core's
    rows padded to the most any core has this step (host-known `cores_tokens`: no count exchange, no
    host sync). Global rank d * tp + t (core d, tensor rank t) gets the t-th of tp equal parts of core
    d's padded rows from the reduce-scatter over every rank (each holds other experts, and every rank
    holds the same gathered tokens), then the core's tensor-parallel ranks all-gather their parts."""

    def __init__(self, across: Any, tp_group: Any, core: int, tp: int) -> None:
        self.across, self.tp_group, self.core, self.tp = across, tp_group, core, tp
        self.experts = Shard(dist.get_rank(), dist.get_world_size())  # the expert group: every rank

    def moe(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor | None,
        cores_tokens: tuple[int, ...],
        route: Route,
        experts: Experts,
        num_experts: int,
    ) -> torch.Tensor:
        """Every core's tokens routed here; this rank's experts over all of them (other ranks' choices
        weighted 0 on local expert 0); the sums reduce-scattered back to their cores."""
        if input_ids is None:
            (xs,), ids_in = self.gather(cores_tokens, x), None
        else:
            xs, ids_in = self.gather(cores_tokens, x, input_ids)
        weights, ids = route(xs, ids_in)
        weights, ids = self.experts.local_routes(weights, ids, num_experts)
        return self.combine(experts(xs, weights, ids), cores_tokens)

    def gather(self, cores_tokens: tuple[int, ...], *tensors: torch.Tensor) -> list[torch.Tensor]:
        n, most = cores_tokens[self.core], max(cores_tokens)
        out = []
        for t in tensors:
            padded = t.new_zeros((most, *t.shape[1:]))
            padded[:n] = t
            every = t.new_empty((len(cores_tokens) * most, *t.shape[1:]))
            dist.all_gather_into_tensor(every, padded, group=self.across)
            out.append(torch.cat([every[d * most : d * most + k] for d, k in enumerate(cores_tokens)]))
        return out

    def combine(self, routed: torch.Tensor, cores_tokens: tuple[int, ...]) -> torch.Tensor:
        part = -(-max(cores_tokens) // self.tp)  # each rank's rows of its core's padded rows
        most, start, rest = part * self.tp, 0, routed.shape[1:]
        padded = routed.new_zeros((len(cores_tokens) * most, *rest))
        for d, k in enumerate(cores_tokens):
            padded[d * most : d * most + k] = routed[start : start + k]
            start += k
        mine = routed.new_empty((part, *rest))
        dist.reduce_scatter_tensor(mine, padded)  # over every rank: the sum of every rank's experts
        if self.tp > 1:
            core = routed.new_empty((most, *rest))
            dist.all_gather_into_tensor(core, mine, group=self.tp_group)
            mine = core
        return mine[: cores_tokens[self.core]]


class AllToAllExchange:
    """`Exchange` by all-to-all (one rank per core, `expert_dispatch="all_to_all"`): each core routes its
    own tokens, sends each (token, choice) pair's row only to the rank holding that expert (pairs
    sorted by rank; the counts exchanged first, a host sync per layer), the ranks run their experts
    over what they received, and the weighted rows go back the same way and are summed per token."""

    def __init__(self) -> None:
        self.size = dist.get_world_size()

    def moe(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor | None,
        cores_tokens: tuple[int, ...],
        route: Route,
        experts: Experts,
        num_experts: int,
    ) -> torch.Tensor:
        weights, ids = route(x, input_ids)  # (T, k): this core's tokens only
        per_rank = num_experts // self.size
        k = ids.shape[1]
        dest = (ids // per_rank).flatten()
        order = torch.sort(dest, stable=True).indices  # pairs t * k + j, by destination rank
        token = order // k
        sends = torch.bincount(dest, minlength=self.size)
        receives = torch.empty_like(sends)
        dist.all_to_all_single(receives, sends)
        out_split, in_split = sends.tolist(), receives.tolist()  # host-known split sizes
        rows = self._swap(x[token], in_split, out_split)
        local = self._swap((ids.flatten()[order] % per_rank)[:, None], in_split, out_split)
        got_w = self._swap(weights.flatten()[order][:, None].contiguous(), in_split, out_split)
        done = experts(rows, got_w, local)  # (received pairs, H): weighted
        back = self._swap(done, out_split, in_split)
        return torch.zeros_like(x).index_add_(0, token, back.to(x.dtype))

    @staticmethod
    def _swap(t: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv, send)
        return out


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


class Remote:
    """A rank on another host, as its leader holds it: no process here (its host's `dsv4serve ranks`
    owns it); it ends when the leader's connection closes."""

    def poll(self) -> int | None:
        return None

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return 0


class Followers:
    """Ranks 1 .. N-1 as rank 0 drives them: their processes (`Remote` for another host's) and the
    connections that feed them, in rank order."""

    def __init__(
        self,
        procs: Sequence[subprocess.Popen[bytes] | Remote],
        conns: Sequence[Connection],
        listener: socket.socket | None = None,
    ) -> None:
        """`conns`: this host's ranks'; the other hosts' (`Remote` in `procs`) join them in
        `wait_ready`, taken from `listener`."""
        self.procs, self.conns, self.listener = list(procs), list(conns), listener
        self.encoder = msgspec.msgpack.Encoder()
        self.lock = threading.Lock()  # table writes (trio thread) and launches (a worker thread)
        self.broken: str | None = None

    @classmethod
    def start(cls, model_dir: str, engine: EngineConfig, leader: Place) -> Followers:
        """Start the leader's core's ranks on this host, 1 .. (its ranks here) - 1 (`rank_process.py`);
        they load their shares while the leader loads its own. Each runs in a session of its own: a
        terminal's Ctrl-C reaches the leader only, which stops them. With several hosts, the others'
        ranks connect to master_port + 1 once loaded (`wait_ready` takes them)."""
        procs: list[subprocess.Popen[bytes] | Remote] = []
        conns: list[Connection] = []
        here = engine.ranks_per_node if engine.tp_spans_hosts else engine.tensor_parallel_size
        for rank in range(1, here):
            ours, theirs = socket.socketpair()
            with theirs:
                procs.append(spawn_rank(model_dir, engine, dataclasses.replace(leader, tp_rank=rank), theirs))
            conns.append(Connection(ours.detach()))
        listener = None
        if engine.tp_spans_hosts:
            listener = socket.create_server(("", engine.master_port + 1), reuse_port=False)
            listener.settimeout(READY_TIMEOUT_S)
            remote = engine.tensor_parallel_size - here
            procs += [Remote() for _ in range(remote)]
        return cls(procs, conns, listener)

    def _accept_remote(self) -> None:
        """Take the other hosts' ranks as they connect (rank id and token first); once all are there,
        their connections follow this host's, in rank order."""
        if self.listener is None:
            return
        token = os.environ.get(RANK_TOKEN_ENV, "").encode()
        if not token:
            raise RanksBroken(f"tensor parallelism over hosts needs ${RANK_TOKEN_ENV}, alike on every host")
        expected = range(len(self.conns) + 1, len(self.procs) + 1)
        got: dict[int, Connection] = {}
        with self.listener:
            while len(got) < len(expected):
                try:
                    sock, _ = self.listener.accept()
                except TimeoutError:
                    missing = [r for r in expected if r not in got]
                    raise RanksBroken(f"ranks {missing} of the other hosts never connected") from None
                sock.settimeout(None)
                conn = Connection(sock.detach())
                try:  # a peer that says nothing, or not this, in HELLO_WAIT_S is not one of ours
                    hello = msgspec.json.decode(conn.recv_bytes(1024)) if conn.poll(HELLO_WAIT_S) else None
                except (OSError, EOFError, msgspec.DecodeError):
                    hello = None
                if not isinstance(hello, dict) or not hmac.compare_digest(
                    str(hello.get("token")).encode(), token
                ):
                    conn.close()
                    continue
                rank = hello["rank"] if isinstance(hello.get("rank"), int) else 0
                if rank not in expected or rank in got:
                    conn.close()
                    raise RanksBroken(f"a host connected as rank {rank}, which is not one it may be")
                got[rank] = conn
        self.conns += [got[r] for r in expected]
        self.listener = None

    def wait_ready(self) -> None:
        self._accept_remote()
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

    def kill(self) -> None:
        """The leader failed to start: end the other ranks at once (another host's, by closing its
        connection)."""
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
        self._close_all()

    def _close_all(self) -> None:
        for conn in self.conns:
            conn.close()
        if self.listener is not None:
            self.listener.close()

    def close(self) -> None:
        with self.lock:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(self.encoder.encode(RankStop()))
            self._close_all()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def leave_group() -> None:
    """This process's part in the engine's collectives ended (its lockstep thread and ranks are done):
    its process group is destroyed before the interpreter exits, whose teardown of a live group's
    threads can abort the process (`terminate called without an active exception`, exit -6)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn_rank(
    model_dir: str, engine: EngineConfig, place: Place, sock: socket.socket | None
) -> subprocess.Popen[bytes]:
    """A rank's process (`rank_process.py`): fed over `sock` (one end of a socket pair), or, with none,
    connecting to its leader's host once loaded (another host's rank)."""
    args = {"model_dir": model_dir, "engine": dataclasses.asdict(engine), "place": dataclasses.asdict(place)}
    args["log_level"] = logs.current_level()
    fds: tuple[int, ...] = () if sock is None else (sock.fileno(),)
    feed = "connect" if sock is None else str(sock.fileno())
    argv = [sys.executable, "-m", "dsv4serve.executor.rank_process", feed]
    return subprocess.Popen(
        [*argv, json.dumps(args)],
        pass_fds=fds,
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr.fileno(),  # stdout may be the stdio front door's protocol stream
        start_new_session=sock is not None,  # another host's: its `dsv4serve ranks` forwards signals
    )


HELLO_WAIT_S = 30  # for a peer that connected to say which rank it is
RANK_TOKEN_ENV = "DSV4SERVE_RANK_TOKEN"  # the same on every host: a rank that does not send it is refused


def dial(host: str, port: int) -> socket.socket:
    """A connection to host 0 (a port it may not listen on yet: tried again for READY_TIMEOUT_S)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    sock.settimeout(None)
    return sock


def connect_to_leader(engine: EngineConfig, place: Place) -> Connection:
    """Another host's rank, loaded: its connection to the leader (rank id and token first)."""
    conn = Connection(dial(engine.master_addr, engine.master_port + 1).detach())
    conn.send_bytes(msgspec.json.encode({"rank": place.tp_rank, "token": os.environ.get(RANK_TOKEN_ENV, "")}))
    return conn


def run_host(model_dir: str, engine: EngineConfig) -> int:
    """`dsv4serve ranks` with tensor parallelism over hosts: this host's ranks of the core whose leader
    runs on host 0 (node_rank 1 ..); returns once they all ended (0 if each did cleanly)."""
    first = engine.node_rank * engine.ranks_per_node
    return wait_all(
        [
            spawn_rank(model_dir, engine, Place(0, rank, engine.master_port), None)
            for rank in range(first, first + engine.ranks_per_node)
        ]
    )


def wait_all(procs: list[subprocess.Popen[bytes]]) -> int:
    """A host's processes of the engine, once they all ended: 0 if each did cleanly, else the largest
    exit code (a signal's number). Interrupted (Ctrl-C, or SIGTERM from a service manager: the cores
    ignore it, their fronts drain them), any left running are killed: none outlives this process."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        codes = [proc.wait() for proc in procs]
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return max((abs(c) for c in codes), default=0)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


IDLE_POLL_S = 0.002  # how often idle cores check whether another core has a step


def idle_plan(pad_row: int) -> StepPlan:
    """A core's step when it has none but another core has: one padding token on the tables' pad row
    (every slot it touches a sentinel), sampling nothing."""
    item = StepItem(
        rid="", prefix_len=0, token_ids=(0,), sample=False, sampling=SamplingParams(), row=pad_row
    )
    return StepPlan(step=-1, items=(item,))


Job = tuple[StepPlan, bool, bool, "Future[Any]"]


class Lockstep:
    """A data-parallel core's launches in step with the other cores': with the experts spread over
    every rank, each MoE layer gathers every core's tokens, so every core runs every step. A thread
    owns the core's launches: each round the cores' leaders say (an all-gather over their gloo group)
    whether one has a step, whether one goes on, whether one is aborting, and each one's tokens (which
    the step's plan carries: `StepPlan.cores_tokens`); then every core launches its step, or the idle
    step (`idle_plan`) when it has none. Idle rounds are IDLE_POLL_S apart; after
    a busy one the next starts at once.

    A core closing gracefully keeps stepping until every core is closing (another core's last steps
    still need its experts). A failed launch (any exception: the others may be inside a gather that
    this core will never join) ends this core's thread: its queued and later launches fail with
    RanksBroken, its engine stops, and its process's exit fails the other cores' collectives.
    `close(abort=True)` (the core stopping on an error) makes every core's thread end at the next
    round, each failing its launches with RanksBroken.
    """

    def __init__(self, group: Any, launch: Callable[[StepPlan, bool, bool], Any], idle: StepPlan) -> None:
        self.group, self._launch, self.idle = group, launch, idle
        self.plans: queue.Queue[Job] = queue.Queue()
        self.lock = threading.Lock()  # queueing a job against the thread's end
        self.closing, self.aborting = threading.Event(), threading.Event()
        self.failure: str | None = None  # set once the thread has ended on a failure or an abort
        self.thread = threading.Thread(target=self._rounds, name="dsv4serve-lockstep", daemon=True)
        self.thread.start()

    def launch(self, plan: StepPlan, all_logits: bool, keep_logits: bool) -> Any:
        """Queue the step for the next round; returns its pending step once launched."""
        done: Future[Any] = Future()
        with self.lock:
            if self.failure is not None:
                raise RanksBroken(self.failure)
            self.plans.put((plan, all_logits, keep_logits, done))
        return done.result()

    def close(self, abort: bool = False) -> None:
        """Leave: gracefully, once every core is idle and closing; with `abort`, at the next round."""
        if abort:
            self.aborting.set()
        self.closing.set()
        self.thread.join()

    def _rounds(self) -> None:
        cores = dist.get_world_size(self.group)
        flags, busy = torch.zeros(4, dtype=torch.int64), True
        every = torch.zeros(cores * 4, dtype=torch.int64)  # each core's flags, one after another
        while True:
            try:
                job = self.plans.get(timeout=0 if busy else IDLE_POLL_S)
            except queue.Empty:
                job = None
            flags[0] = job is not None  # some core has a step
            flags[1] = job is not None or not self.closing.is_set()  # some core goes on
            flags[2] = self.aborting.is_set()  # some core stops on an error
            flags[3] = (job[0] if job is not None else self.idle).num_tokens  # this core's tokens
            try:
                dist.all_gather_into_tensor(every, flags, group=self.group)
            except Exception as exc:  # a core is gone: nothing can step any more
                self._end(f"the cores fell out of step: {type(exc).__name__}: {exc}", job)
                return
            some = every.view(cores, 4).amax(0)
            if some[2]:
                self._end("another data-parallel core stopped on an error", job)
                return
            if not some[1]:
                self._end("the cores have stopped", job)
                return
            busy = bool(some[0])
            if busy and not self._run(job, tuple(every[3::4].tolist())):
                return

    def _run(self, job: Job | None, cores_tokens: tuple[int, ...]) -> bool:
        """Launch the round's step; False (the thread ends, every core aborting next round) if it fails."""
        plan, all_logits, keep_logits, done = job or (self.idle, False, False, None)
        plan = msgspec.structs.replace(plan, cores_tokens=cores_tokens)
        try:
            pending = self._launch(plan, all_logits, keep_logits)
            if done is None:
                pending.wait()
        except Exception as exc:
            message = f"step {plan.step} failed on this core: {type(exc).__name__}: {exc}"
            if done is not None:
                done.set_exception(RanksBroken(message))
            self._end(message, None)  # this core's engine stops; its exit fails the others' collectives
            return False
        if done is not None:
            done.set_result(pending)
        return True

    def _end(self, message: str, job: Job | None) -> None:
        with self.lock:
            self.failure = message
            pending = [job] if job is not None else []
            while not self.plans.empty():
                pending.append(self.plans.get_nowait())
        for *_, done in pending:
            done.set_exception(RanksBroken(message))


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x
