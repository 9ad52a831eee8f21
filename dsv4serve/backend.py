"""The backend seam: the op families the model math calls, and their reference implementations.

The seam sits at the height of the fused kernels: the attention ops read and write the pools through
the slot tables themselves, from metadata `prepare` builds once per step in fixed shapes. The model
says what (attend over this layer's pools for these tokens), the backend says how. `REFERENCE` is
the pure-PyTorch executable spec (the CPU backend); `executor/backends.py` assembles the CUDA (Triton)
and npu (torch_npu) backends with the same signatures, chosen once at start-up. The signatures
follow the Ascend ops' contracts (shared/reference/torch_npu_ops.md section 5) so that the npu backend
maps onto them one to one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from dsv4serve import mhc
from dsv4serve.attention import core, mla, reference
from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.attention.hadamard import hadamard_transform
from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables
from dsv4serve.attention.step import StepMeta, prepare_step
from dsv4serve.moe.experts import routed_experts_reference
from dsv4serve.moe.routing import gating_top_k
from dsv4serve.quant import Weight, linear

if TYPE_CHECKING:
    from dsv4serve.memory.tables import SlotTables

Tensor = torch.Tensor
Prepare = Callable[[ForwardBatch, "SlotTables", RopeTables, int, dict[int, int]], StepMeta]
HcPre = Callable[[Tensor, mhc.HyperConnection, Tensor, mhc.HcParams], tuple[Tensor, Tensor, Tensor]]
Compressor = Callable[[Tensor, CompressorWeights, Tensor, Tensor, StepMeta, int, float], None]
SparseAttention = Callable[
    [Tensor, Tensor, Tensor | None, Tensor | None, StepMeta, Tensor, float, int], Tensor
]


@dataclass(frozen=True)
class Backend:
    """One implementation of every op family. Shapes and contracts: the reference functions named
    in `REFERENCE` (attention/reference.py, mhc.py, attention/core.py, moe/, quant.py)."""

    name: str
    prepare: Prepare  # (batch, tables, rope, sliding_window, state sentinels) -> StepMeta
    linear: Callable[[Tensor, Weight], Tensor]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    rope: Callable[[Tensor, StepMeta, bool, bool], Tensor]  # (x, meta, compress, inverse)
    q_norm_rope: Callable[[Tensor, StepMeta, bool, float], Tensor]
    kv_norm_rope_store: Callable[[Tensor, Tensor, Tensor, StepMeta, bool, float], None]
    compressor: Compressor
    indexer_topk: Callable[[Tensor, Tensor, Tensor, StepMeta, int, float], Tensor]
    sparse_attention: SparseAttention
    hc_pre: HcPre
    hc_post: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    hc_head: Callable[[Tensor, mhc.HyperConnection, Tensor, mhc.HcParams], Tensor]  # collapse + last norm
    gating_top_k: Callable[..., tuple[Tensor, Tensor]]  # moe/routing.py: npu_moe_gating_top_k's contract
    routed_experts: Callable[..., Tensor]
    hadamard: Callable[[Tensor], Tensor]
    # MLA (attention/mla.py): GLM-4.7-Flash's families
    qkv_split_norm: Callable[..., mla.QkvLatents] = mla.qkv_split_norm
    mla_store: Callable[[Tensor, mla.MlaMeta, Tensor, Tensor], None] = mla.store_latents
    mla_attention: Callable[[Tensor, Tensor, Tensor, Tensor, mla.MlaMeta, mla.MlaDims], Tensor] = (
        mla.mla_attention
    )


REFERENCE = Backend(
    name="reference",
    prepare=partial(prepare_step, with_geometry=True),
    linear=linear,
    rms_norm=core.rms_norm,
    rope=reference.rope,
    q_norm_rope=reference.q_norm_rope,
    kv_norm_rope_store=reference.kv_norm_rope_store,
    compressor=reference.compressor,
    indexer_topk=reference.indexer_topk,
    sparse_attention=reference.sparse_attention,
    hc_pre=mhc.hc_pre,
    hc_post=mhc.hc_post,
    hc_head=mhc.hc_head_norm,
    gating_top_k=gating_top_k,
    routed_experts=routed_experts_reference,
    hadamard=hadamard_transform,
)
