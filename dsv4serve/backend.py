"""One dispatch of the heavy ops, chosen once at start-up.

Each op family has the pure-PyTorch reference (the executable spec, used on the CPU); faster
implementations for `cuda` (Triton) and `npu` (torch_npu) plug in with the same signatures.
Call sites never branch on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from importlib import import_module
from types import ModuleType

import torch

from dsv4serve.attention import core
from dsv4serve.attention.hadamard import hadamard_transform
from dsv4serve.moe.experts import routed_experts_dense, routed_experts_reference
from dsv4serve.moe.npu import npu_routed_experts
from dsv4serve.quant import Weight, linear
from dsv4serve.quant_npu import npu_linear


@dataclass(frozen=True)
class Backend:
    name: str
    linear: Callable[[torch.Tensor, Weight], torch.Tensor]
    sink_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    pool_windows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    indexer_scores: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    routed_experts: Callable[..., torch.Tensor]
    hadamard: Callable[[torch.Tensor], torch.Tensor]


REFERENCE = Backend(
    name="reference",
    linear=linear,
    sink_attention=core.sink_attention,
    pool_windows=core.pool_windows,
    indexer_scores=core.indexer_scores,
    routed_experts=routed_experts_reference,
    hadamard=hadamard_transform,
)


DENSE_EXPERTS_MAX_TOKENS = 64


def _experts_for_graphs(x: torch.Tensor, *args: object) -> torch.Tensor:
    """Decode-sized batches take the fixed-shape form (capturable in a graph); prefills gather."""
    if x.shape[0] <= DENSE_EXPERTS_MAX_TOKENS:
        return routed_experts_dense(x, *args)  # type: ignore[arg-type]
    return routed_experts_reference(x, *args)  # type: ignore[arg-type]


def select_backend(device: str) -> Backend:
    """The backend for a device kind: 'cpu' -> reference; 'cuda' / 'npu' -> their kernels where
    they exist, the reference elsewhere. 'npu' imports torch_npu (RuntimeError without it)."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return replace(REFERENCE, name="cpu")
    if kind == "cuda":
        return replace(REFERENCE, name="cuda", routed_experts=_experts_for_graphs)
    if kind == "npu":
        return npu_backend(load_torch_npu())
    raise ValueError(f"unknown device {device!r}")


# The documented torch_npu ops the npu backend calls (feature-checked: older builds lack some).
NPU_OPS = (
    "npu_dynamic_quant",
    "npu_quant_matmul",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul",
    "npu_moe_token_unpermute",
)


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


def npu_backend(npu: ModuleType) -> Backend:
    """torch_npu ops for the W8A8 linear and the routed experts; the reference for the rest (no
    documented torch_npu op has the contract of sink_attention, pool_windows, indexer_scores or
    hadamard). Never run on an Ascend NPU."""
    return replace(
        REFERENCE,
        name="npu",
        linear=partial(npu_linear, npu=npu),
        routed_experts=partial(npu_routed_experts, npu=npu, fallback=_experts_for_graphs),
    )
