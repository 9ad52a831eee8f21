"""Normalized Walsh-Hadamard transform (the rotation applied before quantizing indexer q / k)."""

from __future__ import annotations

import torch


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x @ H_n / sqrt(n) over the last dim (n a power of two), H_n the Sylvester Hadamard matrix.

    Orthonormal and symmetric, so it preserves dot products and is its own inverse. Computed with
    the fast butterfly (log2 n steps) in fp32; the result has x's dtype.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_transform: last dim must be a power of two, got {n}")
    lead = x.shape[:-1]
    y = x.float().reshape(-1, n)  # (M, n)
    rows = y.shape[0]
    h = 1
    while h < n:
        y = y.reshape(rows, n // (2 * h), 2, h)  # (M, blocks, pair, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)  # (M, blocks, 2, h)
        h *= 2
    return (y.reshape(*lead, n) * n**-0.5).to(x.dtype)
