"""The jit helpers of the sparse attention kernels (`sparse.py`): one tile of keys into the online
softmax state, the walks over a token's window and compressed entries (the slots of a block of tiles
gathered before any key loads), the count of a token's entries, and the epilogue that stores the
output with its rope slice rotated back."""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4serve.backends.cuda.triton_utils import softmax_update


@triton.jit
def _attend(q, acc, m, s_sum, pool_ptr, slot, valid, d, dmask, D, scale, FP32: tl.constexpr):
    """One tile of keys (BLOCK_N rows, gathered by slot) into the online softmax state."""
    k = tl.load(
        pool_ptr + slot.to(tl.int64)[:, None] * D + d[None, :],
        mask=valid[:, None] & dmask[None, :],
        other=0.0,
    )
    k = k.to(q.dtype)
    if FP32:
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        logits = tl.dot(q, tl.trans(k)) * scale
    logits = tl.where(valid[None, :], logits, float("-inf"))  # (BLOCK_H, BLOCK_N)
    return softmax_update(acc, m, s_sum, logits, k, FP32)


@triton.jit
def num_entries(pos, RATIO, NUM_IDX, HAS_CMP: tl.constexpr, HAS_IDX: tl.constexpr):
    """How many compressed entries a token at `pos` attends to: its indexer's picks or every visible
    one; 0 on a window-only layer. A token's picks are distinct visible entries, (pos + 1) // RATIO at
    most, packed before the padding (-1): nothing past that many is a pick, so it is never walked."""
    n = pos * 0
    if HAS_CMP:
        n = (pos + 1) // RATIO
        if HAS_IDX:
            n = tl.minimum(n, NUM_IDX)
    return n


@triton.jit
def _slot_tile(slots, i, NT: tl.constexpr):
    """Row i of a (NT, BLOCK_N) block of slots (-1: no key), as a vector: the tile's keys."""
    return tl.sum(tl.where(tl.arange(0, NT)[:, None] == i, slots, 0), axis=0)


@triton.jit
def _attend_tiles(
    q, acc, m, s_sum, pool_ptr, slots, n, d, dmask, D, scale, FP32: tl.constexpr, BLOCK_N: tl.constexpr,
    NT: tl.constexpr,
):  # fmt: skip
    """The first n (<= NT * BLOCK_N) keys of a block of slots gathered up front into the softmax
    state: no key's address waits on a load inside the loop, so the pipeliner fetches the next tile
    while this one computes."""
    for i in range(0, tl.cdiv(n, BLOCK_N)):
        slot = _slot_tile(slots, i, NT)
        acc, m, s_sum = _attend(q, acc, m, s_sum, pool_ptr, tl.maximum(slot, 0), slot >= 0, d, dmask, D,
                                scale, FP32)  # fmt: skip
    return acc, m, s_sum


@triton.jit
def _tile_offsets(lo, NT: tl.constexpr, BLOCK_N: tl.constexpr):
    """lo + 0 .. NT * BLOCK_N - 1 as NT rows of BLOCK_N."""
    return lo + tl.arange(0, NT)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def attend_window(
    q, acc, m, s_sum, swa_ptr, swa_table, row, swa_tstride, start, lo, hi, d, dmask, D, scale,
    FP32: tl.constexpr, BLOCK_N: tl.constexpr, NT: tl.constexpr,
):  # fmt: skip
    """Window keys lo .. hi (hi - lo <= NT * BLOCK_N; raw positions from `start`) into the softmax
    state."""
    j = _tile_offsets(lo, NT, BLOCK_N)
    slots = tl.load(swa_table + row * swa_tstride + start + j, mask=j < hi, other=0)
    slots = tl.where(j < hi, slots, -1)
    return _attend_tiles(q, acc, m, s_sum, swa_ptr, slots, hi - lo, d, dmask, D, scale, FP32, BLOCK_N, NT)


@triton.jit
def attend_entries(
    q, acc, m, s_sum, cmp_ptr, cmp_table, row, cmp_tstride, idx_row_ptr, lo, hi, d, dmask, D, scale,
    FP32: tl.constexpr, HAS_IDX: tl.constexpr, BLOCK_N: tl.constexpr, NT: tl.constexpr,
):  # fmt: skip
    """Compressed entries lo .. hi (the token's picks from `idx_row_ptr`, -1 = none, or the entries
    lo .. hi - 1 themselves) into the softmax state, NT tiles' slots gathered at a time."""
    for c0 in range(lo, hi, NT * BLOCK_N):
        c = _tile_offsets(c0, NT, BLOCK_N)
        if HAS_IDX:
            entry = tl.load(idx_row_ptr + c, mask=c < hi, other=-1)
        else:
            entry = tl.where(c < hi, c, -1)
        slots = tl.load(cmp_table + row * cmp_tstride + entry, mask=entry >= 0, other=0)
        slots = tl.where(entry >= 0, slots, -1)
        n = tl.minimum(hi - c0, NT * BLOCK_N)
        acc, m, s_sum = _attend_tiles(q, acc, m, s_sum, cmp_ptr, slots, n, d, dmask, D, scale, FP32, BLOCK_N,
                                      NT)  # fmt: skip
    return acc, m, s_sum


@triton.jit
def store_rotated_back(
    dst, out, hmask, d, dmask, cos_ptr, sin_ptr, t, stride_cos, D, HALF, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Store a (heads, D) output tile with its rope slice (the last HALF (even, odd) pairs) rotated
    back by -pos from the rounded output, as the reference does. The pairs are split in registers:
    storing the tile and reloading the slice cost ~0.4 ms per 8 x 1024 prefill layer on the H200."""
    o = out.to(dst.dtype.element_ty).to(tl.float32)
    xe, xo = tl.split(tl.reshape(o, (BLOCK_H, BLOCK_D // 2, 2)))
    i = tl.arange(0, BLOCK_D // 2) - (D // 2 - HALF)  # the pair's index in the rope slice
    rope = (i >= 0) & (i < HALF)
    c = tl.load(cos_ptr + t * stride_cos + i, mask=rope, other=1.0)[None, :]
    s = -tl.load(sin_ptr + t * stride_cos + i, mask=rope, other=0.0)[None, :]
    ye = tl.where(rope[None, :], xe * c - xo * s, xe)
    yo = tl.where(rope[None, :], xo * c + xe * s, xo)
    o = tl.reshape(tl.join(ye, yo), (BLOCK_H, BLOCK_D))
    tl.store(dst + d[None, :], o.to(dst.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
