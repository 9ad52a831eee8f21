"""Small shared pieces of the Triton kernels.

Programmatic dependent launch (PDL, Hopper and later): every kernel of the CUDA backend begins with
`enter(PDL)`, which waits until the kernel before it on the stream has finished and its writes are
visible (`griddepcontrol.wait`) and then lets the next kernel be launched (`launch_dependents`).
Launched with `launch_pdl`, a kernel's programs are placed on the SMs while the kernel before it still
runs and start the moment it ends, instead of after a launch round trip; nothing in a kernel touches
memory before that wait, so every kernel still sees its predecessors' writes complete and in order.
Kernels that are not Triton's (cuBLAS, torch) launch as before and wait as before.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

T = TypeVar("T")
U = TypeVar("U")

COUNTER_SLOTS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_AUX: dict[torch.device, torch.cuda.Stream] = {}


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least) (a tl.arange length)."""
    return max(triton.next_power_of_2(max(n, 1)), least)


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's arrival counters (int32, zero between kernels): a kernel whose programs split one
    output's work counts arrivals per output and lets the last program finish it, then puts the
    counter back to zero. Allocated once per device on the current stream (the first use is an eager
    warm-up, never inside a graph capture; `beside` makes them before its second stream starts);
    kernels on one stream never use them at the same time, and those on the aux stream (`beside`) have
    a set of their own."""
    assert needed <= COUNTER_SLOTS, needed
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(2, COUNTER_SLOTS, dtype=torch.int32, device=device)
    aux = _AUX.get(device)
    return _COUNTERS[device][int(aux is not None and torch.cuda.current_stream(device) == aux)]


# Steps of at most this many rows run `Backend.beside`'s two pieces on two streams (DeepSeek-V4's
# queries and keys chains): run 88 on an H100, 4 layers at 1k, decode replay official b1 1.333 ->
# 1.306 ms, b8 2.81 -> 2.78, b64 6.49 -> 6.42; W8A8 1.356 -> 1.303, 2.803 -> 2.748, 6.862 -> 6.717.
DECODE_BESIDE = True
DECODE_BESIDE_ROWS = 64  # the largest step timed


def beside_in_decode(like: torch.Tensor, main: Callable[[], T], aux: Callable[[], U]) -> tuple[T, U]:
    """`Backend.beside` on CUDA: with DECODE_BESIDE, steps of up to DECODE_BESIDE_ROWS rows run their
    pieces on two streams (`beside`), others one after the other."""
    if DECODE_BESIDE and like.is_cuda and like.shape[0] <= DECODE_BESIDE_ROWS:
        return beside(like.device, main, aux)
    return main(), aux()


def beside(device: torch.device, main: Callable[[], T], aux: Callable[[], U]) -> tuple[T, U]:
    """(main(), aux()), aux's kernels on a second stream of the device so that the two run at once
    where neither fills the GPU (in a CUDA graph: two branches); aux's host code runs first. aux
    starts after everything the current stream has queued, and the current stream waits for all of
    it before going on (also when a piece raises), so every tensor aux reads stays alive and unwritten
    while it runs and its outputs are whole when used."""
    with torch.cuda.device(device):  # main's launches go to `here`, the device's current stream
        if device not in _AUX:
            _AUX[device] = torch.cuda.Stream(device=device)
        arrival_counters(device, 0)  # zeroed on `here`, before the second stream starts
        side, here = _AUX[device], torch.cuda.current_stream(device)
        side.wait_stream(here)
        try:
            with torch.cuda.stream(side):
                b = aux()
            a = main()
        finally:
            here.wait_stream(side)
    return a, b


@triton.jit
def enter(PDL: tl.constexpr):
    """A kernel's first statement: under PDL, wait for the kernel before it (its writes visible), then
    let the next one launch. A no-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def arrive_last(counter_ptr, tile, live, SPLITS: tl.constexpr):
    """Whether this program is the last of the SPLITS programs of `tile` to store its partial (every
    program's stores made visible first); the last one puts the counter back to zero. Tiles of no
    pairs (`live` false in all their programs) neither count nor finish."""
    tl.debug_barrier()  # every warp's partial stored before the (one-thread) release below
    arrived = tl.atomic_add(counter_ptr + tile, 1, mask=live, sem="acq_rel", scope="gpu")
    last = live & (arrived == SPLITS - 1)
    tl.atomic_xchg(counter_ptr + tile, 0, mask=last)  # ready for the next call (and graph replay)
    return last


@triton.jit
def sum_partials(part_ptrs, mask, stride, like, SPLITS: tl.constexpr):
    """The SPLITS partials at part_ptrs + j * stride summed in slice order (the result never depends
    on which program finished last); zeros where not `mask`."""
    total = tl.zeros(like.shape, like.dtype)
    for j in tl.static_range(SPLITS):
        total += tl.load(part_ptrs + j * stride, mask=mask, other=0, cache_modifier=".cg")
    return total


def launch_options(t: torch.Tensor) -> dict[str, bool]:
    """The launch arguments of a kernel over `t`'s device: {"PDL": ..., "launch_pdl": ...} (both set
    on a CUDA device of compute capability 9 or more, unless DSV4SERVE_PDL=0; {"PDL": False} on the
    CPU and under Triton's interpreter)."""
    return _PDL_ON if pdl_enabled(t.device) else _PDL_OFF


_PDL_ON, _PDL_OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}  # read-only: callers unpack them


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (decided once per device)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if os.environ.get("DSV4SERVE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def ptx_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` may use inline PTX (an NVIDIA GPU of compute capability 8 or more,
    not Triton's interpreter, which runs a kernel's plain-Triton twin of each PTX block instead, nor
    under DSV4SERVE_PTX=0)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.version.hip:
        return False
    if os.environ.get("DSV4SERVE_PTX", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


@triton.jit
def softmax_update(acc, m, s_sum, logits, values, FP32: tl.constexpr):
    """One tile of keys into an online softmax state (acc (rows, D) unnormalised output, m the
    running max, s_sum the running sum): logits (rows, N), scaled, -inf where a row does not see a
    key; values (N, D). fp32 products in full precision (`ieee`), else the values' dtype."""
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(logits - m_new[:, None])
    s_sum = s_sum * alpha + tl.sum(p, axis=1)
    if FP32:
        acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
    return acc, m_new, s_sum
