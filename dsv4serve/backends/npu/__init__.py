"""The npu backend: torch_npu ops where a documented op has the contract (the W8A8 linear, the router,
the routed experts), the reference elsewhere; plain transfers, no graphs yet. Written against the
documented torch_npu API and tested through a fake `torch_npu`: **never run on an Ascend NPU**.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from functools import partial
from importlib import import_module
from types import ModuleType

import torch

from dsv4serve.backends import Backend
from dsv4serve.backends import reference as ref
from dsv4serve.backends.npu.experts import npu_routed_experts
from dsv4serve.backends.npu.linear import npu_linear
from dsv4serve.backends.npu.routing import npu_gating_top_k
from dsv4serve.config import ConfigError

# The documented torch_npu ops the npu backend calls (feature-checked: older builds lack some).
NPU_OPS = (
    "npu_dynamic_quant",
    "npu_quant_matmul",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul",
    "npu_moe_token_unpermute",
)


def check_device(device: str) -> None:
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        raise ConfigError(f"device: {device!r} needs torch_npu (pip install 'dsv4serve[npu]')")


def load_torch_npu() -> ModuleType:
    """Import torch_npu (only here, when the npu backend is chosen) and check it has our ops."""
    try:
        npu = import_module("torch_npu")
    except ImportError as exc:
        raise RuntimeError(
            "the npu backend needs torch_npu, from the `npu` extra: pip install 'dsv4serve[npu]'"
        ) from exc
    missing = [name for name in NPU_OPS if not hasattr(npu, name)]
    if missing:
        raise RuntimeError(f"the npu backend needs a torch_npu with {', '.join(missing)}")
    return npu


def backend(npu: ModuleType | None = None) -> Backend:
    """The npu backend over `npu` (torch_npu, imported here when None)."""
    npu = npu or load_torch_npu()
    reference = ref.backend()
    return replace(
        reference,
        name="npu",
        linear=partial(npu_linear, npu=npu),
        routed_experts=partial(npu_routed_experts, npu=npu, fallback=reference.routed_experts),
        gating_top_k=partial(npu_gating_top_k, npu=npu, fallback=reference.gating_top_k),
        transfers=NpuTransfers(npu),
        collectives="hccl",
    )


class NpuTransfers(ref.PlainTransfers):
    """Plain copies; the device's memory read through torch_npu's `npu` module (torch.cuda's twin)."""

    def __init__(self, npu: ModuleType) -> None:
        self.npu = npu

    def memory(self, device: torch.device) -> tuple[int, int] | None:
        if device.type != "npu":
            return None
        self.npu.npu.empty_cache()
        free, total = self.npu.npu.mem_get_info(device)
        return int(free), int(total)
