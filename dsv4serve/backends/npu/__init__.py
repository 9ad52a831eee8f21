"""The npu backend: torch_npu ops where a documented op has the contract (the W8A8 linear, the router,
the routed experts, RMSNorm, rope, mHC, DeepSeek-V4's compressor, sparse attention and indexer, GLM's
MLA rope and attention), the reference elsewhere (each step's index metadata); plain transfers; decode
steps captured as NPU graphs (`graphs.py`) where torch_npu has them. Written against the documented
torch_npu API and tested through a fake `torch_npu`: **never run on an Ascend NPU**.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from dataclasses import replace
from functools import partial
from importlib import import_module
from types import ModuleType
from typing import Any

import structlog
import torch

from dsv4serve.attention.int8_index import quantize_rows
from dsv4serve.backends import Backend
from dsv4serve.backends import reference as ref
from dsv4serve.backends.npu.attention import PerStep, npu_indexer_topk, npu_sparse_attention
from dsv4serve.backends.npu.compressor import npu_compressor
from dsv4serve.backends.npu.experts import npu_routed_experts
from dsv4serve.backends.npu.graphs import NpuGraphs
from dsv4serve.backends.npu.linear import npu_linear
from dsv4serve.backends.npu.mhc import npu_hc_head, npu_hc_post, npu_hc_pre
from dsv4serve.backends.npu.mla import Buffers, GraphOps, npu_mla_attention
from dsv4serve.backends.npu.norm import npu_add_rms_norm, npu_rms_norm
from dsv4serve.backends.npu.rope import npu_kv_norm_rope_store, npu_mla_rope_store, npu_q_norm_rope, npu_rope
from dsv4serve.backends.npu.routing import npu_gating_top_k
from dsv4serve.config import ConfigError
from dsv4serve.layers.linear import grouped_linear

# Each op family the npu backend maps, with the Ascend ops it needs (feature-checked at start-up:
# builds differ by CANN version; `npu_find_op` says where each is looked for); a family whose ops are
# missing runs the reference, one warning naming them. GLM's qkv_split_norm is Triton source, compiled by
# triton-ascend where it is installed (`triton_ascend`). The steps' metadata (DeepSeek-V4's and GLM's
# `prepare`: index arithmetic, no op) is the reference's. The families with an op in NEWER
# come in two generations (`generation`): the custom libraries' ops named here, else CANN's newer ones
# in their place. The engine's int8 indexer (`indexer_quant="int8"`) takes INT8_INDEXER where found, else
# the reference (one warning, on its first call).
FAMILY_OPS: dict[str, tuple[str, ...]] = {
    "linear": ("npu_dynamic_quant", "npu_quant_matmul"),
    "routed_experts": (
        "npu_dynamic_quant",
        "npu_moe_init_routing_v2",
        "npu_grouped_matmul",
        "npu_moe_token_unpermute",
    ),
    "gating_top_k": ("npu_moe_gating_top_k",),
    "rms_norm": ("npu_rms_norm",),
    "add_rms_norm": ("npu_add_rms_norm",),
    "dsv4.rope": ("npu_rotary_mul",),
    "dsv4.q_norm_rope": ("npu_rotary_mul",),
    "dsv4.kv_norm_rope_store": ("npu_rms_norm", "npu_rotary_mul"),
    "dsv4.hc_pre": ("npu_hc_pre_v2", "npu_rms_norm"),
    "dsv4.hc_post": ("npu_hc_post",),
    "dsv4.hc_head": ("npu_hc_pre_v2", "npu_rms_norm"),
    "dsv4.compressor": ("compressor",),
    "dsv4.sparse_attention": ("npu_sparse_attn_sharedkv", "npu_sparse_attn_sharedkv_metadata"),
    "dsv4.indexer_topk": ("npu_lightning_indexer",),
    "mla.rope_store": ("npu_interleave_rope",),
    "mla.attention": ("npu_fused_infer_attention_score",),
}
# Custom-op libraries (not stock torch_npu) an op may come from, as torch.ops namespaces: vllm-ascend's
# `_C_ascend` (its csrc build) and SGLang's Ascend kernels' `custom`; each needs that package installed
# and imported before the engine starts.
CUSTOM_LIBRARIES = ("_C_ascend", "custom")
INT8_INDEXER = "npu_quant_lightning_indexer"
# CANN's newer generation of DeepSeek-V4's ops (`torch.ops.cann_ops_transformer`, hicann ops-transformer's
# `torchapi_*.md`), by the op each replaces: a family runs on them where this build lacks its older ops.
# The compressor's drops the fused norm + rope; mHC's pre takes BSND streams, its order of the two eps
# swapped; the attention's renames `seqused_kv` to `seqused_ori_kv`, pages as PA_BBND and needs the
# compressed side's length and residual.
NEWER = {
    "compressor": "compressor",
    "npu_hc_pre_v2": "mhc_pre_sinkhorn",
    "npu_hc_post": "mhc_post",
    "npu_sparse_attn_sharedkv": "sparse_flash_mla",
    "npu_sparse_attn_sharedkv_metadata": "sparse_flash_mla_metadata",
}
NPU_OPS = tuple(dict.fromkeys(op for ops in FAMILY_OPS.values() for op in ops))
GENERATIONAL = tuple(family for family, ops in FAMILY_OPS.items() if any(op in NEWER for op in ops))


def check_device(device: str) -> None:
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        raise ConfigError(f"device: {device!r} needs torch_npu (pip install 'dsv4serve[npu]')")


def load_torch_npu() -> ModuleType:
    """Import torch_npu (only here, when the npu backend is chosen)."""
    try:
        return import_module("torch_npu")
    except ImportError as exc:
        raise RuntimeError(
            "the npu backend needs torch_npu, from the `npu` extra: pip install 'dsv4serve[npu]'"
        ) from exc


def npu_find_op(npu: ModuleType, name: str) -> Any:
    """The Ascend op `name`: torch_npu's, else a custom-op library's (CUSTOM_LIBRARIES); None if none."""
    if hasattr(npu, name):
        return getattr(npu, name)
    for library in CUSTOM_LIBRARIES:
        namespace = getattr(torch.ops, library)
        if hasattr(namespace, name):
            return getattr(namespace, name)
    return None


def newer_op(name: str) -> Any:
    """CANN's newer-generation op `name` (torch.ops.cann_ops_transformer); None if this build lacks it."""
    namespace = torch.ops.cann_ops_transformer
    return getattr(namespace, name) if hasattr(namespace, name) else None


def generation(found: dict[str, Any], ops: tuple[str, ...]) -> tuple[str | None, dict[str, Any]]:
    """A family's generation and its ops by their FAMILY_OPS names: "custom" where every op is found
    (torch_npu's, a custom library's), else "cann" where CANN's newer ops stand in for the missing ones
    (NEWER; a family takes one generation whole, never a mix); else (None, {})."""
    if all(found[op] for op in ops):
        return "custom", {op: found[op] for op in ops}
    newer = {op: newer_op(NEWER[op]) if op in NEWER else found[op] for op in ops}
    if any(op in NEWER for op in ops) and all(newer.values()):
        return "cann", newer
    return None, {}


def _lacks(family: str, ops: tuple[str, ...], found: dict[str, Any]) -> str:
    """The warning of a family on the reference: the ops missing, of either generation."""
    missing = [op for op in ops if found[op] is None]
    newer = [f"cann_ops_transformer.{NEWER[op]}" for op in ops if op in NEWER and newer_op(NEWER[op]) is None]
    alternative = f" (nor CANN's {', '.join(newer)})" if newer and any(op in NEWER for op in missing) else ""
    return f"npu backend: this torch_npu lacks {', '.join(missing)}{alternative}: {family} runs the reference"


def backend(npu: ModuleType | None = None) -> Backend:
    """The npu backend over `npu` (torch_npu, imported here when None): each family on its Ascend ops
    where this build has them, else on the reference (one warning naming the missing ops)."""
    npu = npu or load_torch_npu()
    reference = ref.backend()
    found = {op: npu_find_op(npu, op) for op in NPU_OPS}
    chosen = {family: generation(found, ops) for family, ops in FAMILY_OPS.items()}
    gen = {family: g for family, (g, _) in chosen.items()}
    log = structlog.get_logger().bind(actor="npu")
    log.info("npu_generation", **{family.removeprefix("dsv4."): gen[family] for family in GENERATIONAL})
    fused = gen["dsv4.compressor"] == "custom"
    if gen["dsv4.compressor"] is not None:
        log.info("npu_compressor", fused_norm_rope=fused)
    # each family's ops by their FAMILY_OPS names, in its generation (the older names where it has none)
    use = {family: found | ops for family, (_, ops) in chosen.items()}
    per_step = PerStep()  # the compressors', attention's and indexer's per-step tables, built once a step
    quant = found["npu_dynamic_quant"] or quantize_rows  # (the int8 indexer's rows; linear needs the op)
    linear = partial(npu_linear, npu=npu) if gen["linear"] else reference.linear
    ascend = {
        "linear": linear,
        # the shared expert goes through the linear family's choice
        "routed_experts": partial(
            npu_routed_experts, npu=npu, fallback=reference.routed_experts, linear=linear
        ),
        "gating_top_k": partial(npu_gating_top_k, npu=npu, fallback=reference.gating_top_k),
        "rms_norm": partial(npu_rms_norm, npu=npu),
        "add_rms_norm": partial(npu_add_rms_norm, npu=npu),
        "dsv4.rope": partial(npu_rope, npu=npu),
        "dsv4.q_norm_rope": partial(npu_q_norm_rope, npu=npu),
        "dsv4.kv_norm_rope_store": partial(npu_kv_norm_rope_store, npu=npu),
        "dsv4.hc_pre": partial(
            npu_hc_pre,
            pre=use["dsv4.hc_pre"]["npu_hc_pre_v2"],
            rms_norm=found["npu_rms_norm"],
            newer=gen["dsv4.hc_pre"] == "cann",
        ),
        "dsv4.hc_head": partial(
            npu_hc_head,
            pre=use["dsv4.hc_head"]["npu_hc_pre_v2"],
            rms_norm=found["npu_rms_norm"],
            padded={},  # the head's parameters padded to hc_pre's shapes, once
            newer=gen["dsv4.hc_head"] == "cann",
        ),
        "dsv4.hc_post": partial(
            npu_hc_post, op=use["dsv4.hc_post"]["npu_hc_post"], newer=gen["dsv4.hc_post"] == "cann"
        ),
        "dsv4.compressor": partial(
            npu_compressor,
            op=use["dsv4.compressor"]["compressor"],
            fused=fused,
            shared=per_step,
            quant=quant,
        ),
        "dsv4.sparse_attention": partial(
            npu_sparse_attention,
            op=use["dsv4.sparse_attention"]["npu_sparse_attn_sharedkv"],
            metadata_op=use["dsv4.sparse_attention"]["npu_sparse_attn_sharedkv_metadata"],
            newer=gen["dsv4.sparse_attention"] == "cann",
            shared=per_step,
        ),
        "dsv4.indexer_topk": partial(
            npu_indexer_topk,
            op=found["npu_lightning_indexer"],
            quant_op=npu_find_op(npu, INT8_INDEXER) if found["npu_dynamic_quant"] else None,
            quant=quant,
            shared=per_step,
        ),
        "mla.rope_store": partial(npu_mla_rope_store, op=found["npu_interleave_rope"], shared=PerStep()),
        "mla.attention": partial(
            npu_mla_attention,
            op=found["npu_fused_infer_attention_score"],
            graphs=GraphOps.of(npu, found["npu_fused_infer_attention_score"]),
            fallback=reference.mla.attention,
            shared=PerStep(),  # the step's paged context, built by its first layer
            buffers=Buffers(),  # FIA's mask, gathered context and workspaces, made once
        ),
    }
    families: dict[str, Any] = {}
    tritons = triton_ascend()
    log.info("npu_triton", triton_ascend=tritons)  # GLM's fused split + norm compiles with it
    if tritons:  # (imported here: the npu backend needs no triton otherwise)
        from dsv4serve.backends.npu.split_norm import qkv_split_norm

        families["mla.qkv_split_norm"] = partial(qkv_split_norm, fallback=reference.mla.qkv_split_norm)
    for family, ops in FAMILY_OPS.items():
        if gen[family] is None:
            warnings.warn(_lacks(family, ops, found), RuntimeWarning, stacklevel=2)
            continue
        families[family] = ascend[family]
    grouped = {group: _group(families, group) for group in ("dsv4", "mla")}
    top = {name: op for name, op in families.items() if "." not in name}
    return replace(
        reference,
        name="npu",
        grouped_linear=partial(grouped_linear, matmul=linear),  # the linear family's choice, per group
        dsv4=replace(reference.dsv4, **grouped["dsv4"]),
        mla=replace(reference.mla, **grouped["mla"]),
        transfers=NpuTransfers(npu),
        graphs=NpuGraphs(npu) if hasattr(getattr(npu, "npu", None), "NPUGraph") else None,
        collectives="hccl",
        **top,
    )


def triton_ascend() -> bool:
    """Whether triton-ascend is installed (its CANN extension, as engines detect it): the Triton source
    of `backends/split_norm.py` then compiles for the NPU."""
    try:
        return importlib.util.find_spec("triton.language.extra.cann") is not None
    except ModuleNotFoundError:  # no triton at all
        return False


def _group(families: dict[str, Any], group: str) -> dict[str, Any]:
    """One model's families, by their names in its ops group (`dsv4.rope` -> `rope`)."""
    prefix = f"{group}."
    return {name.removeprefix(prefix): op for name, op in families.items() if name.startswith(prefix)}


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
