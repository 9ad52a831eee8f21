"""Host -> device copies that never wait for the device, and pinned host buffers for the way back.

A plain `.to("cuda")` of a pageable tensor waits for the work already queued on the stream; a step
planned while the previous one runs must not. Small copies are staged in a ring of persistent pinned
buffers and copied asynchronously, in stream order: a buffer is written again only once the copy
queued from it has run (one event per buffer, nearly always complete by then; if not, that copy takes a
fresh pinned buffer: the caller never waits for the device). Allocating pinned
memory per copy cost ~0.06 ms each on the H200 (`aten::empty` in a host profile of batch-1 decode steps,
four per step); larger copies (prefill metadata) still take a fresh pinned buffer. A decode graph's
inputs have pinned buffers of their own (`PinnedStages`), which the host fills in place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from dsv4serve.backends.reference import OnHost
from dsv4serve.config import ConfigError

T = TypeVar("T")
STAGES = 3  # pinned upload buffers of a graph's inputs (the engine runs at most a step or two ahead)

RING_SLOTS = 16  # a step's table writes and metadata stage a few copies; the host runs a step ahead
RING_BYTES = 64 << 10  # a decode step's table writes and sampling rows at 256 requests stay well below


def pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def copy_into(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """dst.copy_(src) inside inference mode: a reused buffer may have been made inside a step's
    inference mode (an inference tensor, which torch lets only inference mode update in place; on the
    H200's torch 2.11 even one made under `inference_mode(False)` was) and be written outside it (the
    slot tables' copies), or the other way round."""
    if torch.is_inference_mode_enabled():  # a step's launch: already inside (no second context per copy)
        dst.copy_(src, non_blocking=non_blocking)
        return
    with torch.inference_mode():
        dst.copy_(src, non_blocking=non_blocking)


class _PinnedRing:
    """Persistent pinned staging buffers of one device, used round robin (thread-safe: the trio
    thread writes slot tables while a worker thread launches a step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lock = threading.Lock()
        self.slots = [pinned((RING_BYTES,), torch.uint8) for _ in range(RING_SLOTS)]
        self.events = [torch.cuda.Event() for _ in range(RING_SLOTS)]
        self.used = [False] * RING_SLOTS
        self.next = 0

    def send(self, src: torch.Tensor) -> torch.Tensor:
        """src (host) copied into a new device tensor, queued on the current stream."""
        nbytes = src.numel() * src.element_size()
        with self.lock:
            i, self.next = self.next, (self.next + 1) % RING_SLOTS
            # a larger copy, or a buffer whose copy (RING_SLOTS copies ago) is still queued, takes a
            # fresh pinned buffer: the caller never waits for the device
            fresh = nbytes > RING_BYTES or (self.used[i] and not self.events[i].query())
            host = pinned(tuple(src.shape), src.dtype) if fresh else self.slots[i][:nbytes].view(src.dtype)
            host = host.view(src.shape)
            copy_into(host, src)
            out = host.to(self.device, non_blocking=True)
            if not fresh:
                self.events[i].record(torch.cuda.current_stream(self.device))  # the stream the copy went to
                self.used[i] = True
        return out


class PinnedStages:
    """Persistent pinned buffers of one device tensor's uploads (a decode graph's inputs), filled in
    place by the host and used in turn: a buffer is filled again only once the copy queued from it has
    run (its event), else a fresh one is (the host never waits for the device). One thread at a time
    (`stage`, fill, `send`). On the CPU: one plain buffer, copied at once."""

    def __init__(self, dst: torch.Tensor, count: int = 3) -> None:
        self.dst = dst
        cuda = dst.device.type == "cuda"
        self.slots: list[tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None]] = []
        for _ in range(count if cuda else 1):
            host = pinned(tuple(dst.shape), dst.dtype) if cuda else torch.empty_like(dst)
            self.slots.append((host, host.numpy(), torch.cuda.Event() if cuda else None))
        self.turn = 0
        self.staged: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def stage(self) -> np.ndarray:
        """The next buffer to fill (a numpy view of it); `send()` then queues its copy."""
        host, words, done = self.slots[self.turn]
        self.turn = (self.turn + 1) % len(self.slots)
        if done is not None and not done.query():  # its copy still queued (the host ran far ahead)
            host, done = pinned(tuple(host.shape), host.dtype), None
            words = host.numpy()
        self.staged = (host, done)
        return words

    def send(self) -> None:
        """Queue the copy of the staged buffer into the device tensor, without waiting."""
        assert self.staged is not None, "stage() first"
        (host, done), self.staged = self.staged, None
        copy_into(self.dst, host, non_blocking=True)
        if done is not None:
            done.record(torch.cuda.current_stream(self.dst.device))  # the stream the copy went to


_RINGS: dict[torch.device, _PinnedRing] = {}
_RINGS_LOCK = threading.Lock()


def _ring(device: torch.device) -> _PinnedRing:
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    with _RINGS_LOCK:
        if device not in _RINGS:
            _RINGS[device] = _PinnedRing(device)
        return _RINGS[device]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of host tensor t on `device`, queued without waiting for the device."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return _ring(device).send(t.contiguous())


class HostBuffers:
    """Pinned host buffers for device -> host results, each with the event its copy records, reused:
    `take` a pair, copy into the buffer and record the event, `give` both back once read (a decode
    step allocates neither). A pair never given back (an abandoned step) is simply collected."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event]:
        with self.lock:
            free = self.free.get((shape, dtype))
            if free:
                return free.pop()
        return pinned(shape, dtype), torch.cuda.Event()

    def give(self, host: torch.Tensor, done: torch.cuda.Event) -> None:
        with self.lock:
            free = self.free.setdefault((tuple(host.shape), host.dtype), [])
            if all(b is not host for b, _ in free) and len(free) < RING_SLOTS:
                free.append((host, done))


HOST_BUFFERS = HostBuffers()


@dataclass(frozen=True)
class _PinnedCopy:
    """A device tensor copied into a reused pinned buffer, with the event recorded after the copy."""

    host: torch.Tensor
    done: torch.cuda.Event

    def ready(self) -> bool:
        return self.done.query()

    def read(self, convert: Callable[[torch.Tensor], T]) -> T:
        self.done.synchronize()
        try:
            return convert(self.host)
        finally:
            HOST_BUFFERS.give(self.host, self.done)


class CudaTransfers:
    """The CUDA backend's `Transfers`: pinned staging and asynchronous copies (above); plain copies for
    CPU tensors (the Triton kernels in Triton's interpreter)."""

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return to_device(host, device)

    def download(self, out: torch.Tensor) -> _PinnedCopy | OnHost:
        if out.device.type != "cuda":
            return OnHost(out.cpu())
        host, done = HOST_BUFFERS.take(tuple(out.shape), out.dtype)
        copy_into(host, out, non_blocking=True)
        done.record(torch.cuda.current_stream(out.device))
        return _PinnedCopy(host, done)

    def stager(self, dst: torch.Tensor) -> PinnedStages:
        return PinnedStages(dst, STAGES)

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def memory(self, device: torch.device) -> tuple[int, int] | None:
        if device.type != "cuda":
            return None
        torch.cuda.empty_cache()  # weights replaced at load (quantized, stacked) leave cached blocks
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)


def check_device(device: str) -> None:
    """Raise ConfigError naming `device` unless this machine has it (before any weight is loaded). The
    count comes from NVML where it answers: a front that checks never starts CUDA in its process (a fork
    of it could not use CUDA then)."""
    _, _, index = device.partition(":")
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(f"device: {device!r}, but torch sees no CUDA device on this machine")
    if index and not (index.isdigit() and int(index) < count):
        raise ConfigError(f"device: {device!r}, but this machine has CUDA devices 0..{count - 1}")
