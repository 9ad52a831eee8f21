"""The CUDA backend: every op family as Triton kernels (which also run, slowly, in Triton's CPU
interpreter). Imported only when chosen, so machines without triton never load it."""

from __future__ import annotations

from functools import partial

from dsv4serve import mhc_triton, quant_triton
from dsv4serve.attention import compressor_triton, indexer_triton, mla_triton, norm_rope_triton, sparse_triton
from dsv4serve.attention.hadamard import hadamard_transform
from dsv4serve.attention.step_triton import prepare_step_fused
from dsv4serve.backend import Backend
from dsv4serve.moe import experts_triton, routing_triton


def triton_backend() -> Backend:
    return Backend(
        name="cuda",
        prepare=prepare_step_fused,
        linear=quant_triton.linear,
        rms_norm=norm_rope_triton.rms_norm,
        rope=norm_rope_triton.rope,
        q_norm_rope=norm_rope_triton.q_norm_rope,
        kv_norm_rope_store=norm_rope_triton.kv_norm_rope_store,
        compressor=partial(compressor_triton.compressor, linear=quant_triton.linear),
        indexer_topk=indexer_triton.indexer_topk,
        sparse_attention=sparse_triton.sparse_attention,
        hc_pre=mhc_triton.hc_pre,
        hc_post=mhc_triton.hc_post,
        hc_head=mhc_triton.hc_head,
        gating_top_k=routing_triton.gating_top_k,
        routed_experts=experts_triton.routed_experts,
        qkv_split_norm=mla_triton.qkv_split_norm,  # MLA's attention and store: reference
        hadamard=hadamard_transform,
    )
