"""Interleaved partial RoPE on the last `rope_head_dim` channels (DeepSeek-V4).

Sliding-only layers use the "main" rope (theta 10000, no scaling). Layers with a compressor use the
"compress" rope for their own q/k, their compressor and their indexer: theta 160000 with YaRN
frequencies, but *no* mscale on cos/sin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


class RopeConfig(Protocol):
    """The rope fields of a DeepSeek-V4 config."""

    @property
    def rope_head_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def compress_rope_theta(self) -> float: ...
    @property
    def rope_factor(self) -> float: ...
    @property
    def original_max_position_embeddings(self) -> int: ...
    @property
    def beta_fast(self) -> float: ...
    @property
    def beta_slow(self) -> float: ...


def default_inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def yarn_inv_freq(
    rope_dim: int, theta: float, factor: float, original_max: int, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """YaRN-blended inverse frequencies (correction range truncated to whole dims)."""

    def correction_dim(num_rotations: float) -> float:
        return (rope_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = float(max(math.floor(correction_dim(beta_fast)), 0))
    high = float(min(math.ceil(correction_dim(beta_slow)), rope_dim - 1))
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = extrapolate (high-frequency dims keep their original frequency)
    return interpolation * (1 - keep) + extrapolation * keep


@dataclass(frozen=True)
class RopeTables:
    """cos/sin per absolute position, (max_len, rope_dim // 2) each, for the main and compress ropes."""

    main_cos: torch.Tensor
    main_sin: torch.Tensor
    comp_cos: torch.Tensor
    comp_sin: torch.Tensor

    @classmethod
    def build(cls, cfg: RopeConfig, max_len: int, device: torch.device | str) -> RopeTables:
        main = default_inv_freq(cfg.rope_head_dim, cfg.rope_theta)
        if cfg.rope_factor != 1.0:
            comp = yarn_inv_freq(
                cfg.rope_head_dim,
                cfg.compress_rope_theta,
                cfg.rope_factor,
                cfg.original_max_position_embeddings,
                cfg.beta_fast,
                cfg.beta_slow,
            )
        else:
            comp = default_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta)
        pos = torch.arange(max_len, dtype=torch.float32)
        main_f = pos[:, None] * main[None, :]  # (L, rd/2)
        comp_f = pos[:, None] * comp[None, :]
        return cls(*(t.to(device) for t in (main_f.cos(), main_f.sin(), comp_f.cos(), comp_f.sin())))

    def lookup(self, positions: torch.Tensor, compress: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if compress:
            return self.comp_cos[positions], self.comp_sin[positions]
        return self.main_cos[positions], self.main_sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the trailing 2*cos.shape[-1] channels of x, in fp32.

    x: (T, ..., D); cos/sin: (T, rd/2), broadcast over the middle dims.
    """
    half = cos.shape[-1]
    rd = 2 * half
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    pairs = rope.unflatten(-1, (half, 2))  # (T, ..., rd/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rot_even = even * cos - odd * sin
    rot_odd = odd * cos + even * sin
    rotated = torch.stack((rot_even, rot_odd), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
