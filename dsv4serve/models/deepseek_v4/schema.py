"""DeepSeek-V4's checkpoint tensors, declared once: official names, shapes and storage.

Names are the official ones (`embed.weight`, `layers.L.attn.wq_a.weight`, ...) without a `model.`
prefix, routed experts one by one as on disk (`layers.L.ffn.experts.E.w1.weight`); the loader stacks
them per layer into `layers.L.ffn.experts.{w1,w2,w3}`. Official storage: the attention and shared-expert
projections and the indexer's query projection FP8, routed experts MXFP4 (FP8 where `expert_dtype` says
so), mHC, sinks, ape and the router bias fp32, tid2eid int64, everything else bf16. In memory the
norms are kept in fp32 too, as the reference model keeps them. The projections a W8A8 checkpoint may
store as int8 are the query, K=V, output-b and indexer-query projections and every expert's.
"""

from __future__ import annotations

from dsv4serve.memory.paged import coff
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.spec import DiskFormat, Schema, Shape, Split, TensorSpec

# msModelSlim's DeepSeek-V4 W8A8 recipe keeps wo_a / wo_b (and compressors, indexer scoring, router) in
# floating point; of the projections the model takes as int8 only wo_b is excluded.
MSMODELSLIM_FLOAT = ("attn.wo_b.weight",)


def _fp32(shape: Shape, group: str) -> TensorSpec:
    return TensorSpec(shape, "fp32", fp32=True, group=group)


def _norm(width: int, group: str = "norms") -> TensorSpec:
    return TensorSpec((width,), "bf16", fp32=True, group=group)


def _linear(
    shape: Shape,
    group: str,
    disk: DiskFormat = "bf16",
    int8: bool = False,
    split: Split | None = None,
    unit: int = 1,
) -> TensorSpec:
    return TensorSpec(shape, disk, int8=int8, linear=True, group=group, split=split, split_unit=unit)


def tensors(cfg: DeepseekV4Config) -> Schema:
    """Every tensor of an official checkpoint (MTP excluded)."""
    h, hc = cfg.hidden_size, cfg.hc_mult
    out: Schema = {
        "embed.weight": TensorSpec((cfg.vocab_size, h), group="embed_head"),
        "head.weight": _linear((cfg.vocab_size, h), "embed_head"),
        "norm.weight": _norm(h),
        "hc_head_fn": _fp32((hc, hc * h), "mhc"),
        "hc_head_base": _fp32((hc,), "mhc"),
        "hc_head_scale": _fp32((1,), "mhc"),
    }
    mix = (2 + hc) * hc
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        out |= {p + "attn_norm.weight": _norm(h), p + "ffn_norm.weight": _norm(h)}
        for site in ("attn", "ffn"):
            out |= {
                p + f"hc_{site}_fn": _fp32((mix, hc * h), "mhc"),
                p + f"hc_{site}_base": _fp32((mix,), "mhc"),
                p + f"hc_{site}_scale": _fp32((3,), "mhc"),
            }
        out |= _attention(cfg, layer, p + "attn.")
        out |= _ffn(cfg, layer, p + "ffn.")
    return out


def _attention(cfg: DeepseekV4Config, layer: int, p: str) -> Schema:
    """Tensor parallelism splits the query heads, their sinks and output groups (wq_b, wo_a rows,
    wo_b columns); the one K=V head, the compressors and the indexer are whole on every rank."""
    h, d, heads, q = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.q_lora_rank
    groups, rank = cfg.o_groups, cfg.o_lora_rank
    out = {
        p + "wq_a.weight": _linear((q, h), "attention", "fp8", int8=True),
        p + "q_norm.weight": _norm(q),
        p + "wq_b.weight": _linear((heads * d, q), "attention", "fp8", True, "rows", d),
        p + "wkv.weight": _linear((d, h), "attention", "fp8", int8=True),
        p + "kv_norm.weight": _norm(d),
        p + "wo_a.weight": _linear(
            (groups * rank, heads * d // groups), "attention", "fp8", False, "rows", rank
        ),
        p + "wo_b.weight": _linear((h, groups * rank), "attention", "fp8", True, "cols", rank),
        p + "attn_sink": TensorSpec((heads,), "fp32", fp32=True, group="attention", split="rows"),
    }
    ratio = cfg.compress_ratios[layer]
    if ratio:
        out |= _compressor(p + "compressor.", ratio, d, h, "compressor")
    if ratio == 4:
        n, di = cfg.index_n_heads, cfg.index_head_dim
        out |= {
            p + "indexer.wq_b.weight": _linear((n * di, q), "indexer", "fp8", int8=True),
            p + "indexer.weights_proj.weight": _linear((n, h), "indexer"),
        }
        out |= _compressor(p + "indexer.compressor.", ratio, di, h, "indexer")
    return out


def _compressor(p: str, ratio: int, head_dim: int, hidden: int, group: str) -> Schema:
    width = coff(ratio) * head_dim  # ratio 4 carries two overlapping halves per token
    return {
        p + "wkv.weight": _linear((width, hidden), group),
        p + "wgate.weight": _linear((width, hidden), group),
        p + "ape": _fp32((ratio, width), group),
        p + "norm.weight": _norm(head_dim, group),
    }


def _ffn(cfg: DeepseekV4Config, layer: int, p: str) -> Schema:
    h, inter, experts = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    out: Schema = {p + "gate.weight": TensorSpec((experts, h), group="router")}
    if layer < cfg.num_hash_layers:
        out[p + "gate.tid2eid"] = TensorSpec(
            (cfg.vocab_size, cfg.num_experts_per_tok), "int64", group="router"
        )
    else:
        out[p + "gate.bias"] = _fp32((experts,), "router")
    disk: DiskFormat = "mxfp4" if cfg.expert_dtype in (None, "fp4") else "fp8"
    for e in range(experts):
        q = f"{p}experts.{e}."
        for part, shape, split in _swiglu_parts(inter, h):
            out[q + part + ".weight"] = _linear(shape, "routed_experts", disk, True, split)
    shared = cfg.n_shared_experts * inter
    if shared:
        q = p + "shared_experts."
        for part, shape, split in _swiglu_parts(shared, h):
            out[q + part + ".weight"] = _linear(shape, "shared_experts", "fp8", True, split)
    return out


def _swiglu_parts(inner: int, h: int) -> tuple[tuple[str, Shape, Split], ...]:
    """An expert's three projections; tensor parallelism splits the intermediate."""
    return (("w1", (inner, h), "rows"), ("w2", (h, inner), "cols"), ("w3", (inner, h), "rows"))
