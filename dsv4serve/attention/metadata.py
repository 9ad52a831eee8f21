"""Batch metadata for one forward over a flat batch of tokens from many requests.

Packed on the host from the step plan (executor/inputs.py) and moved to the device in one copy; the
forward itself reads only these tensors, the slot tables and the host-known bounds and spans beside
them, so it has no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WindowMeta:
    """Compressor windows that close in this step for one ratio (padding entries have index -1)."""

    req: torch.Tensor  # (NW,) batch index of the window's request
    index: torch.Tensor  # (NW,) compressed index k (window covers raw [k*r, (k+1)*r)), -1 = padding


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64 absolute position of each token
    token_req: torch.Tensor  # (T,) int64 batch index of each token's request
    rows: torch.Tensor  # (B,) int64 table row of each request
    prefix_lens: torch.Tensor  # (B,) tokens cached before this step
    seq_lens: torch.Tensor  # (B,) tokens cached after this step
    cu_seqlens: torch.Tensor  # (B+1,) flat offset of each request's first token
    sample_index: torch.Tensor  # (S,) flat index of the last token of each request that samples
    max_seq_len: int  # host-known bound on seq_lens (sizes the compressed-entry gathers)
    windows: dict[int, WindowMeta]  # ratio -> closing windows
    # host-known (first token, tokens, seq_len) of each request of an eager step; None in a captured
    # step (its inputs change from replay to replay)
    spans: tuple[tuple[int, int, int], ...] | None = None
    # every data-parallel core's tokens this step (StepPlan.cores_tokens), when the MoE layers gather
    # them; empty otherwise
    cores_tokens: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
