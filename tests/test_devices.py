"""Pinned staging of host -> device copies (CUDA only): a ring buffer is written again only after the
copy queued from it has run, so copies queued behind slow device work keep their values."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.backends.cuda import transfers as devices

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_ring_copies_behind_slow_work_keep_their_values() -> None:
    g = torch.Generator().manual_seed(0)
    expected = torch.randint(0, 1 << 40, (3 * devices.RING_SLOTS, 100), generator=g)
    torch.cuda._sleep(200_000_000)  # the stream is busy for ~0.1 s: every copy below queues behind it
    outs = []
    for i in range(expected.shape[0]):  # three laps of the ring: buffers are reused while copies still wait
        outs.append((i, devices.to_device(expected[i], "cuda")))
    torch.cuda.synchronize()
    for i, out in outs:
        assert torch.equal(out.cpu(), expected[i])


def test_pinned_stages_keep_the_values_of_copies_queued_behind_slow_work() -> None:
    """More uploads than staging buffers while every copy still waits: none refills a buffer whose copy
    has not run (the fourth and later take fresh ones)."""
    dst = torch.zeros(100, dtype=torch.int64, device="cuda")
    stages = devices.PinnedStages(dst, count=3)
    torch.cuda._sleep(200_000_000)  # the stream is busy for ~0.1 s
    snapshots = []
    for i in range(8):
        stages.stage()[:] = i
        stages.send()
        snapshots.append(dst.clone())
    torch.cuda.synchronize()
    assert [s.tolist() for s in snapshots] == [[i] * 100 for i in range(8)]


def test_large_copies_and_empty_tensors() -> None:
    big = torch.arange(devices.RING_BYTES, dtype=torch.int32)  # 4x the ring's buffer: a fresh one
    assert torch.equal(devices.to_device(big, "cuda").cpu(), big)
    empty = torch.zeros(2, 0, dtype=torch.float32)
    assert devices.to_device(empty, "cuda").shape == (2, 0)


def test_host_buffers_are_reused_once_given_back() -> None:
    pool = devices.HostBuffers()
    a, event = pool.take((2, 3), torch.float64)
    assert a.is_pinned()
    pool.give(a, event)
    pool.give(a, event)  # giving twice must not hand the same buffer to two steps
    again, again_event = pool.take((2, 3), torch.float64)
    assert again is a and again_event is event
    assert pool.take((2, 3), torch.float64)[0] is not a


def test_pending_step_waits_once_and_returns_its_result_again() -> None:
    from dsv4serve.executor.runner import PendingStep

    out = torch.tensor([[5.0], [-0.25]], dtype=torch.float64, device="cuda")  # (2 + 2k, S) with k = 0
    pending = PendingStep.of((), out[:, :0], None, devices.CudaTransfers())
    assert pending.wait() is pending.wait()  # the second call does not read the (given back) buffer again


def test_buffers_made_inside_inference_mode_serve_copies_outside_it() -> None:
    """A step (inference mode) may make the first pinned buffers that copies outside it reuse later
    (the slot tables' staging, a result read outside a step): torch refuses in-place updates of
    inference tensors outside inference mode, so every copy into a reused buffer runs inside it."""
    from dsv4serve.executor.runner import PendingStep

    pool = devices.HOST_BUFFERS
    with torch.inference_mode():
        made_inside, event = pool.take((2, 1), torch.float64)
        ring = devices._PinnedRing(torch.device("cuda", torch.cuda.current_device()))
    pool.give(made_inside, event)
    out = torch.tensor([[5.0], [-0.25]], dtype=torch.float64, device="cuda")
    pending = PendingStep.of((), out, None, devices.CudaTransfers())  # outside inference mode, into it
    assert isinstance(pending.copy, devices._PinnedCopy) and pending.copy.host is made_inside
    first = ring.send(torch.arange(4))  # outside inference mode, into slots made inside it
    with torch.inference_mode():
        second = ring.send(torch.arange(4) * 2)
    torch.cuda.synchronize()
    assert torch.equal(first.cpu(), torch.arange(4)) and torch.equal(second.cpu(), torch.arange(4) * 2)
    assert torch.equal(pending.copy.host, out.cpu())
