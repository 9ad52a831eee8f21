"""The reference backend: every op family's pure-PyTorch executable spec, on the CPU (the `cpu`
device) or on any device torch runs on. Its transfers are plain copies and it captures no graphs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from dsv4serve.attention import core, dsv4, mla
from dsv4serve.attention.step import prepare_step
from dsv4serve.backends import Backend, Dsv4Ops, MlaOps
from dsv4serve.layers import mhc
from dsv4serve.layers.linear import grouped_linear, linear
from dsv4serve.moe.experts import routed_experts_reference
from dsv4serve.moe.routing import gating_top_k

T = TypeVar("T")

DSV4 = Dsv4Ops(
    prepare=partial(prepare_step, with_geometry=True),
    rope=dsv4.rope,
    q_norm_rope=dsv4.q_norm_rope,
    kv_norm_rope_store=dsv4.kv_norm_rope_store,
    compressor=dsv4.compressor,
    indexer_topk=dsv4.indexer_topk,
    sparse_attention=dsv4.sparse_attention,
    hc_pre=mhc.hc_pre,
    hc_post=mhc.hc_post,
    hc_head=mhc.hc_head_norm,
)
MLA = MlaOps(
    prepare=mla.mla_meta,
    qkv_split_norm=mla.qkv_split_norm,
    rope_store=mla.rope_store,
    attention=mla.mla_attention,
)


@dataclass(frozen=True)
class OnHost:
    host: torch.Tensor

    def ready(self) -> bool:
        return True

    def read(self, convert: Callable[[torch.Tensor], T]) -> T:
        return convert(self.host)


class _PlainStager:
    def __init__(self, dst: torch.Tensor) -> None:
        self.dst, self.host = dst, torch.empty(dst.shape, dtype=dst.dtype)

    def stage(self) -> np.ndarray:
        return self.host.numpy()

    def send(self) -> None:
        self.dst.copy_(self.host)


class PlainTransfers:
    """Copies that wait where torch waits (the host is the device, or no faster path is written)."""

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device)

    def download(self, out: torch.Tensor) -> OnHost:
        return OnHost(out.cpu())

    def stager(self, dst: torch.Tensor) -> _PlainStager:
        return _PlainStager(dst)

    def synchronize(self, device: torch.device) -> None:
        pass

    def memory(self, device: torch.device) -> tuple[int, int] | None:
        return None


def check_device(device: str) -> None:
    """The CPU is always there."""


def backend() -> Backend:
    return Backend(
        name="reference",
        linear=linear,
        grouped_linear=grouped_linear,
        rms_norm=core.rms_norm,
        add_rms_norm=core.add_rms_norm,
        gating_top_k=gating_top_k,
        routed_experts=routed_experts_reference,
        dsv4=DSV4,
        mla=MLA,
        transfers=PlainTransfers(),
    )
