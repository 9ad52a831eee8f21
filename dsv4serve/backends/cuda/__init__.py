"""The CUDA backend: every op family as Triton kernels (which also run, slowly, in Triton's CPU
interpreter), decode steps as CUDA graphs, transfers through pinned staging. Imported only when
chosen, so machines without triton never load it."""

from __future__ import annotations

from functools import partial

from dsv4serve.attention import mla as mla_reference
from dsv4serve.backends import Backend, Dsv4Ops, MlaOps
from dsv4serve.backends.cuda import (
    compressor,
    experts,
    indexer,
    linear,
    mhc,
    mla,
    norm_rope,
    routing,
    sparse,
    triton_utils,
)
from dsv4serve.backends.cuda.graphs import CudaGraphs
from dsv4serve.backends.cuda.step import prepare_step_fused
from dsv4serve.backends.cuda.transfers import CudaTransfers
from dsv4serve.backends.cuda.transfers import check_device as check_device


def backend() -> Backend:
    return Backend(
        name="cuda",
        linear=linear.linear,
        grouped_linear=linear.grouped_linear,
        rms_norm=norm_rope.rms_norm,
        add_rms_norm=norm_rope.add_rms_norm,
        gating_top_k=routing.gating_top_k,
        routed_experts=experts.routed_experts,
        dsv4=Dsv4Ops(
            prepare=prepare_step_fused,
            rope=norm_rope.rope,
            q_norm_rope=norm_rope.q_norm_rope,
            kv_norm_rope_store=norm_rope.kv_norm_rope_store,
            compressor=partial(compressor.compressor, linear=linear.linear),
            indexer_topk=indexer.indexer_topk,
            sparse_attention=sparse.sparse_attention,
            hc_pre=mhc.hc_pre,
            hc_post=mhc.hc_post,
            hc_head=mhc.hc_head,
        ),
        mla=MlaOps(  # MLA's prepare: the reference's (torch ops, in the graph)
            prepare=mla_reference.mla_meta,
            qkv_split_norm=mla.qkv_split_norm,
            rope_store=mla.rope_store,
            attention=mla.mla_attention,
        ),
        transfers=CudaTransfers(),
        graphs=CudaGraphs(),
        collectives="nccl",
        workspace=experts.prefill_workspace,
        beside=triton_utils.beside_in_decode,
    )
