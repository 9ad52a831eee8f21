"""This rank's share of a tensor- (and expert-) parallel group, as the model math sees it.

A `Shard` cuts a weight into the rank's block (`rows`: output rows, a column-parallel projection;
`cols`: input columns, a row-parallel one whose partial products `reduce` sums over the group), as the
loader reads it (`TensorSpec.split`). Routed experts are whole with expert parallelism, a contiguous
block of them per rank (`span`; `local_routes` maps the router's global choices onto them), else each
expert's intermediate is cut as a dense MLP's. One rank (`Shard()`) cuts nothing and reduces nothing,
so the single-device math is the same code. Quantized weights are cut with their scales: int8 by output
channel, FP8 on its 128-blocks, MXFP4 on its 32-column scale groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsv4serve.layers.formats import FP8_BLOCK, MXFP4_BLOCK
from dsv4serve.layers.linear import Fp8BlockWeight, Int8Weight, Mxfp4Weight, Weight


class ShardError(ValueError):
    """A dimension does not split over the group; the message names it and the group's size."""


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


Route = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Exchange(Protocol):
    """A MoE layer whose expert group spans the data-parallel cores (each with tokens of its own):
    `moe` runs the router (`route`: tokens and their ids -> weights and global expert ids, (N, k)) and
    this rank's experts (`experts`: rows, weights, ids local to the rank -> the weighted sum per row)
    over tokens of every core, and gives back this core's rows of the whole MoE's output. How the
    tokens travel is the implementation's (`executor/ranks.py`); `cores_tokens` is every core's tokens
    this step (`ForwardBatch.cores_tokens`, host-known)."""

    def moe(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor | None,
        cores_tokens: tuple[int, ...],
        route: Route,
        experts: Experts,
        num_experts: int,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shard:
    """`rank` of a tensor-parallel group of `size` (heads and MLP intermediates split, `reduce` its
    all-reduce); the routed experts: whole, block `expert_rank` of `expert_size` (expert parallelism),
    else each one's intermediate by the tensor-parallel split. When the expert group spans the
    data-parallel cores (each with tokens of its own), `exchange` brings every core's tokens to the
    experts and their outputs back (`Exchange`)."""

    rank: int = 0
    size: int = 1
    reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=_unchanged, compare=False)
    expert_parallel: bool = True  # routed experts: whole ones per rank, else each one's intermediate
    expert_rank: int | None = None  # None: `rank` (the expert group is the tensor-parallel group)
    expert_size: int | None = None
    exchange: Exchange | None = field(default=None, compare=False)

    def expert_span(self, n: int, what: str) -> tuple[int, int]:
        """This rank's block [start, stop) of n routed experts (expert parallelism)."""
        rank = self.rank if self.expert_rank is None else self.expert_rank
        size = self.size if self.expert_size is None else self.expert_size
        return Shard(rank, size).span(n, what)

    def span(self, n: int, what: str, unit: int = 1) -> tuple[int, int]:
        """The rank's [start, stop) of n items split evenly in blocks of `unit` (ShardError if not)."""
        if n % (self.size * unit):
            raise ShardError(f"{what}: {n} does not split over {self.size} ranks in blocks of {unit}")
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def count(self, n: int, what: str) -> int:
        start, stop = self.span(n, what)
        return stop - start

    def rows(self, w: Weight, what: str, unit: int = 1) -> Weight:
        """Output rows (dim 0) of the rank, `unit` rows kept together (a head's)."""
        if self.size == 1:
            return w
        a, b = self.span(w.shape[0], what, unit)
        if isinstance(w, torch.Tensor):
            return w[a:b].clone()
        if isinstance(w, Int8Weight):
            return Int8Weight(w.qweight[a:b].clone(), w.scale[a:b].clone())
        if isinstance(w, Fp8BlockWeight):
            return _fp8(w, (a, b), None, what)
        return Mxfp4Weight(w.packed[a:b].clone(), w.scale[a:b].clone())

    def cols(self, w: Weight, what: str, unit: int = 1) -> Weight:
        """Input columns (dim -1) of the rank: a row-parallel projection (its products `reduce`d)."""
        if self.size == 1:
            return w
        a, b = self.span(w.shape[-1], what, unit)
        if isinstance(w, torch.Tensor):
            return w[..., a:b].clone()
        if isinstance(w, Int8Weight):  # per-output-channel scales stay whole
            return Int8Weight(w.qweight[..., a:b].clone(), w.scale.clone())
        if isinstance(w, Fp8BlockWeight):
            return _fp8(w, None, (a, b), what)
        if a % MXFP4_BLOCK or b % MXFP4_BLOCK:
            raise ShardError(f"{what}: columns {a}..{b} cut MXFP4's {MXFP4_BLOCK}-column scale groups")
        block = MXFP4_BLOCK
        return Mxfp4Weight(
            w.packed[..., a // 2 : b // 2].clone(), w.scale[..., a // block : b // block].clone()
        )

    def local_routes(
        self, weights: torch.Tensor, ids: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's (T, k) choices over all experts as choices over this rank's: other ranks'
        experts get weight 0 (on local expert 0), so the group's reduced sum is the whole MoE."""
        if not self.expert_parallel or (self.expert_size or self.size) == 1:
            return weights, ids
        start, stop = self.expert_span(num_experts, "experts")
        mine = (ids >= start) & (ids < stop)
        return torch.where(mine, weights, torch.zeros_like(weights)), torch.where(mine, ids - start, 0)


def _fp8(
    w: Fp8BlockWeight, rows: tuple[int, int] | None, cols: tuple[int, int] | None, what: str
) -> Fp8BlockWeight:
    """Rows or columns of FP8 blocks: the cut must fall on the 128-blocks the scales cover."""
    (ra, rb), (ca, cb) = rows or (0, w.shape[0]), cols or (0, w.shape[1])
    (br, bc), (n, k) = FP8_BLOCK, w.shape
    if ra % br or (rb % br and rb != n) or ca % bc or (cb % bc and cb != k):
        raise ShardError(f"{what}: rows {ra}..{rb}, columns {ca}..{cb} cut FP8's {br}x{bc} blocks")
    scale = w.scale[ra // br : -(-rb // br), ca // bc : -(-cb // bc)]
    return Fp8BlockWeight(w.qweight[ra:rb, ca:cb].clone(), scale.clone())
