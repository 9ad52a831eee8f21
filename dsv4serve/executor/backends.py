"""The backend of a device kind, chosen once at start-up.

'cpu' gets the reference (the executable spec); 'cuda' the Triton kernels; 'npu' the torch_npu ops
where a documented op has the contract, the reference elsewhere. Call sites never branch on the device.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from importlib import import_module
from types import ModuleType

from dsv4serve.backend import REFERENCE, Backend
from dsv4serve.moe.npu import npu_routed_experts
from dsv4serve.moe.npu_routing import npu_gating_top_k
from dsv4serve.quant_npu import npu_linear


def select_backend(device: str) -> Backend:
    """'npu' imports torch_npu (RuntimeError without it); 'cuda' imports triton (likewise)."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return replace(REFERENCE, name="cpu")
    if kind == "cuda":
        from dsv4serve.executor.triton_backend import triton_backend

        return triton_backend()
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
    """torch_npu ops for the W8A8 linear and the routed experts; the reference for the rest. Never run
    on an Ascend NPU."""
    return replace(
        REFERENCE,
        name="npu",
        linear=partial(npu_linear, npu=npu),
        routed_experts=partial(npu_routed_experts, npu=npu, fallback=REFERENCE.routed_experts),
        gating_top_k=partial(npu_gating_top_k, npu=npu, fallback=REFERENCE.gating_top_k),
    )
