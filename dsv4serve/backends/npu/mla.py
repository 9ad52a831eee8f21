"""GLM-4.7-Flash's MLA attention (the contract of `attention/mla.mla_attention`) on Ascend: torch_npu's
`npu_fused_infer_attention_score` (FIA) in its MLA form, as vllm-ascend's and SGLang's Ascend MLA paths
call it.

Absorbed, as the reference: the query is q_nope W_uk (H, 512) with its rotated rope part (H, 64) as
`query_rope`; key = value = the latent c (512) with k_pe (64) as `key_rope`, one KV head; the op's
latent output (T, H, 512) then goes through kv_b's value half. FIA's documented MLA limits (op-plugin
doc `torch_npu-npu_fused_infer_attention_score.md`, its MLA, PageAttention and TND sections; the
`../reference` notes 5.1) on Atlas A2 / A3: fp16 / bf16; query D 512 with rope 64, one KV head; query
heads 1, 2, 4, ..., 128; sparse_mode 0, 3 or 4; paged K / V with a block size a multiple of 16 up to
1,024; no softmax_lse; TND with at most 4,096 batch entries; KV_S at most 262,144 for Q_S = 1.

- Heads: GLM-4.7-Flash's 20 (10 or 5 a rank under TP 2 or 4) are not a count FIA takes. The query is
  padded with zero heads to the next count it takes and their outputs dropped (heads are independent
  over one KV head), as vllm-ascend's `pad_fia_mla_query_heads` does; at least 8 (SGLang's Ascend
  backend takes FIA's MLA decode only from 8 query heads a KV head, fewer "in a later CANN"). More
  than 128 heads: the reference.
- Pages: the engine's pool keeps a token's [c | k_pe] in one row, and MlaMeta carries slots, not pages;
  FIA takes c and k_pe as two contiguous paged tensors (no strided views). So each call gathers its
  requests' context rows (the reference's gather: linear in context) into pages of BLOCK = 128 (a size
  every paged FIA form takes), each request's pages in a run, and passes their block table. A call
  gathers at most GATHER_PAGES pages (302 MB of bf16 latents) into the backend's one buffer (`Buffers`:
  whole rows from the pool, then c and k_pe apart; 604 MB a device, made on first use, never inside a
  capture): a step, or a captured bucket, whose requests need more is several calls over runs of
  requests, each overwriting the buffer in stream order; no layer or graph keeps a copy. A pool
  kept as c and k_pe apart (vllm-ascend, SGLang), with the page size in the metadata, would let the op
  read the pool in place.
- Layouts: a step of decodes only takes BSND (B, 1, H, 512), sparse_mode 0 and no mask (SGLang's
  decode call); any other step TND, `actual_seq_lengths` the requests' cumulative query ends,
  `actual_seq_lengths_kv` their context lengths (per request under PageAttention), sparse_mode 3
  (right-down causal: query i of a request's S1 sees keys j <= S2 - S1 + i, the engine's "position p
  sees 0..p") with its 2048 x 2048 mask, True above the diagonal.
- Lengths are host lists (the op's SymInt[]) from the step's spans. A captured decode step has no
  spans, and FIA's host lengths would freeze at capture: it gathers every request's pages up to the
  context bucket (static shapes), calls the op's `.out` form (a workspace from
  `_npu_fused_infer_attention_score_get_max_workspace`) inside a task group, and before each replay
  re-issues it with the step's lengths inside `graph_task_update_begin` / `_end` (`NpuGraph.updates`,
  as vllm-ascend's full graphs do). Without those APIs, and for any call outside the limits above
  (fp32, the tiny test shapes): the reference. `scale` is passed explicitly (the op's default is 1.0).
**Never run on an Ascend NPU.**
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F

from dsv4serve.attention.mla import MlaDims, MlaMeta, absorbed
from dsv4serve.backends.npu.attention import PerStep
from dsv4serve.backends.npu.graphs import NpuGraph, capturing

LATENT, ROPE, BLOCK, MASK = 512, 64, 128, 2048
HEADS = (8, 16, 32, 64, 128)  # the query heads FIA is given (1, 2 and 4 padded to 8)
MAX_BATCH, MAX_DECODE_KV = 4096, 262144
# The pages one FIA call gathers at most (the longest context FIA decodes: 302 MB of bf16 latents), so a
# step's copy of its context stays within a fixed size whatever its batch and contexts: a step, or a
# captured (batch, context) bucket, whose requests need more runs as several calls.
GATHER_PAGES = MAX_DECODE_KV // BLOCK


def fia_heads(heads: int) -> int | None:
    """The query heads FIA is given for `heads`: the least count it takes, None past 128."""
    return next((n for n in HEADS if n >= heads), None)


def fits(q: torch.Tensor, cache: torch.Tensor, dims: MlaDims) -> bool:
    """Within FIA's MLA limits: dtype, latent + rope widths, heads."""
    return (
        q.shape[0] > 0
        and q.dtype in (torch.float16, torch.bfloat16)
        and cache.dtype == q.dtype
        and dims.kv_lora_rank == LATENT
        and dims.qk_rope_head_dim == ROPE
        and fia_heads(dims.num_heads) is not None
    )


def supported(q: torch.Tensor, cache: torch.Tensor, meta: MlaMeta, dims: MlaDims) -> bool:
    """An eager step FIA takes (its spans host-known)."""
    spans = meta.spans
    return (
        spans is not None
        and 0 < len(spans) <= MAX_BATCH
        and fits(q, cache, dims)
        and max(n for _, _, n in spans) <= MAX_DECODE_KV
    )


@dataclass(frozen=True)
class PagedContext:
    """A group of a step's requests as one FIA call sees them, built once a step (every layer shares it)."""

    slots: torch.Tensor  # (pages, BLOCK) each request's context slots, its pages in a run
    table: torch.Tensor  # (B, max pages) int32: request b's pages among `slots`' rows
    kv_lengths: list[int]  # (B,) context lengths: actual_seq_lengths_kv
    q_ends: list[int]  # (B,) cumulative query ends: TND's actual_seq_lengths
    decodes_only: bool  # one token a request: BSND
    tokens: slice  # the group's query tokens among the step's
    requests: slice  # its requests among the step's

    @classmethod
    def of(cls, meta: MlaMeta, spans: tuple[tuple[int, int, int], ...]) -> list[PagedContext]:
        """The step's requests in runs whose pages stay within GATHER_PAGES, one call each."""
        counts = [-(-n // BLOCK) for _, _, n in spans]  # pages a request
        groups, start, pages = [], 0, 0
        for b, count in enumerate(counts):
            if pages + count > GATHER_PAGES and b > start:
                groups.append((start, b))
                start, pages = b, 0
            pages += count
        groups.append((start, len(spans)))
        return [cls._group(meta, spans, counts, b0, b1) for b0, b1 in groups]

    @classmethod
    def _group(
        cls, meta: MlaMeta, spans: tuple[tuple[int, int, int], ...], counts: list[int], b0: int, b1: int
    ) -> PagedContext:
        kv_lengths, counts = [n for _, _, n in spans[b0:b1]], counts[b0:b1]
        N, widest = meta.key_slots.shape[1], max(counts)
        # (B * widest, BLOCK): every row's slots in pages; past N slot 0 (a page tail, never read)
        pages = F.pad(meta.key_slots[b0:b1], (0, widest * BLOCK - N)).view((b1 - b0) * widest, BLOCK)
        picks = [b * widest + j for b, count in enumerate(counts) for j in range(count)]
        firsts = list(accumulate(counts, initial=0))[:-1]  # each request's first page among `slots`
        table = [[s + j for j in range(c)] + [0] * (widest - c) for s, c in zip(firsts, counts, strict=True)]
        device, t0 = meta.key_slots.device, spans[b0][0]
        return cls(
            slots=pages[torch.tensor(picks, device=device)],
            table=torch.tensor(table, dtype=torch.int32, device=device),
            kv_lengths=kv_lengths,
            q_ends=[first + count - t0 for first, count, _ in spans[b0:b1]],
            decodes_only=all(count == 1 for _, count, _ in spans[b0:b1]),
            tokens=slice(t0, spans[b1 - 1][0] + spans[b1 - 1][1]),
            requests=slice(b0, b1),
        )

    @classmethod
    def whole(cls, meta: MlaMeta) -> list[PagedContext]:
        """A captured decode step (shapes fixed by its batch and context buckets): every request's pages
        up to the bucket, in runs of requests within GATHER_PAGES; the lengths come before each replay
        (`kv_lengths` placeholders)."""
        B, N = meta.key_slots.shape
        widest = -(-N // BLOCK)
        run = max(1, GATHER_PAGES // widest)
        out = []
        for b0 in range(0, B, run):
            b1 = min(B, b0 + run)
            n = b1 - b0
            table = torch.arange(n * widest, dtype=torch.int32, device=meta.key_slots.device).view(n, widest)
            pages = F.pad(meta.key_slots[b0:b1], (0, widest * BLOCK - N)).view(n * widest, BLOCK)
            ends, rows = list(range(1, n + 1)), slice(b0, b1)
            out.append(cls(pages, table, [1] * n, ends, decodes_only=True, tokens=rows, requests=rows))
        return out


class Buffers:
    """What every FIA call of a backend reuses, made on first use (an eager step, or the warm-up step
    before a capture: never inside one), so that no layer and no captured graph holds its own: the causal
    mask of each device; the gathered context of each (device, dtype), GATHER_PAGES pages of whole rows
    and of c and k_pe apart (`gather`), which every run of every layer overwrites in stream order; FIA's
    workspaces and the unused lse output, by call shape."""

    def __init__(self) -> None:
        self.masks: dict[torch.device, torch.Tensor] = {}
        self.context: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self.workspaces: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        """sparse_mode 3's mask: (2048, 2048) bool, True (masked) above the diagonal."""
        if device not in self.masks:
            self.masks[device] = torch.ones(MASK, MASK, dtype=torch.bool, device=device).triu(1)
        return self.masks[device]

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `slots` (pages, BLOCK) as FIA's key (pages, BLOCK, 512) and key_rope (pages, BLOCK,
        64), contiguous: whole rows gathered from the pool (a contiguous source), then split."""
        pages = slots.shape[0]
        assert pages <= GATHER_PAGES, (pages, GATHER_PAGES)
        where = (cache.device, cache.dtype)
        if where not in self.context:
            empty = partial(torch.empty, dtype=cache.dtype, device=cache.device)
            rows = GATHER_PAGES * BLOCK
            self.context[where] = (empty(rows, LATENT + ROPE), empty(rows, LATENT), empty(rows, ROPE))
        whole, c, pe = (t[: pages * BLOCK] for t in self.context[where])
        torch.index_select(cache, 0, slots.reshape(-1), out=whole)
        c.copy_(whole[:, :LATENT])
        pe.copy_(whole[:, LATENT:])
        return c.view(pages, BLOCK, LATENT), pe.view(pages, BLOCK, ROPE)

    def workspace(
        self, graphs: GraphOps, args: tuple[torch.Tensor, ...], call: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FIA's workspace for a call of these shapes at its longest lengths, and the lse output."""
        key = (
            *(tuple(a.shape) for a in args),
            args[0].dtype,
            args[0].device,
            tuple(call["actual_seq_lengths_kv"]),
        )
        if key not in self.workspaces:
            lse = torch.empty(1, dtype=args[0].dtype, device=args[0].device)  # (no softmax_lse at D 512)
            self.workspaces[key] = (graphs.workspace(*args, **call), lse)
        return self.workspaces[key]


def npu_mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_b: torch.Tensor,
    meta: MlaMeta,
    dims: MlaDims,
    *,
    op: Callable[..., Any],
    graphs: GraphOps | None,
    fallback: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, MlaMeta, MlaDims], torch.Tensor],
    shared: PerStep,
    buffers: Buffers,
) -> torch.Tensor:
    """Attention over the cached latents in the absorbed form, on FIA: (T, H, v)."""
    graph = capturing()
    if graph is not None and meta.spans is None:  # a decode step being captured
        widest = -(-meta.key_slots.shape[1] // BLOCK)  # a request's pages at the context bucket
        if (
            graphs is None
            or not fits(q, cache, dims)
            or not 0 < q.shape[0] <= MAX_BATCH
            or widest > GATHER_PAGES
        ):
            return fallback(q, cache, kv_b, meta, dims)
        return _captured(
            q, cache, kv_b, meta, dims, graphs=graphs, graph=graph, shared=shared, buffers=buffers
        )
    if not supported(q, cache, meta, dims):
        return fallback(q, cache, kv_b, meta, dims)
    spans = meta.spans
    assert spans is not None
    H = dims.num_heads
    groups: list[PagedContext] = shared.get(meta, "mla", lambda: PagedContext.of(meta, spans))
    query, query_rope, w_uv, heads = _queries(q, kv_b, dims)
    outs = []
    for step in groups:  # one call a run of requests: the gathered context stays within GATHER_PAGES
        t = step.tokens
        if t.stop == t.start:  # a run of requests with no token this step (empty chunks): no call
            continue
        common = _common(cache, step, dims, heads, buffers)
        n, key, value = t.stop - t.start, common.pop("key"), common.pop("value")
        if step.decodes_only:
            rope = query_rope[t].view(n, 1, heads, ROPE)
            out, _ = op(
                query[t].view(n, 1, heads, LATENT), key, value, query_rope=rope, input_layout="BSND",
                sparse_mode=0, **common,
            )  # fmt: skip
        else:
            out, _ = op(
                query[t], key, value, query_rope=query_rope[t], input_layout="TND",
                actual_seq_lengths=step.q_ends, sparse_mode=3, atten_mask=buffers.causal_mask(query.device),
                **common,
            )  # fmt: skip
        outs.append(out.view(n, heads, LATENT))
    o_lat = (outs[0] if len(outs) == 1 else torch.cat(outs))[:, :H]  # (T, H, 512): the padded heads dropped
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)


def _queries(
    q: torch.Tensor, kv_b: torch.Tensor, dims: MlaDims
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """FIA's query (T, heads, 512) and query_rope (T, heads, 64), zero heads past H; W_uv; heads."""
    H = dims.num_heads
    heads = fia_heads(H)
    assert heads is not None
    q_lat, q_pe, w_uv = absorbed(q, kv_b, dims)  # (T, H, 512), (T, H, 64), (H, v, 512)
    query = F.pad(q_lat, (0, 0, 0, heads - H)).contiguous()
    query_rope = F.pad(q_pe, (0, 0, 0, heads - H)).contiguous()
    return query, query_rope, w_uv, heads


def _common(
    cache: torch.Tensor, step: PagedContext, dims: MlaDims, heads: int, buffers: Buffers
) -> dict[str, Any]:
    """The paged keys (key = value = the latent c, key_rope = k_pe: the run's context gathered into the
    shared buffers) and the arguments every call shares."""
    assert cache.shape[1] == LATENT + ROPE
    key, key_rope = buffers.gather(cache, step.slots)  # one KV head; value = key
    return {
        "key": key, "value": key, "key_rope": key_rope, "num_heads": heads,
        "num_key_value_heads": 1, "scale": dims.softmax_scale, "block_table": step.table,
        "block_size": BLOCK, "actual_seq_lengths_kv": step.kv_lengths,
    }  # fmt: skip


@dataclass(frozen=True)
class GraphOps:
    """What FIA in an NPU graph needs of torch_npu: the op's `.out` form, its workspace query and the
    runtime's task groups (`torch.npu.graph_task_group_begin` / `_end`, `graph_task_update_begin` /
    `_end`)."""

    out: Callable[..., Any]
    workspace: Callable[..., torch.Tensor]
    runtime: Any

    @classmethod
    def of(cls, npu: Any, op: Any) -> GraphOps | None:
        rt = getattr(npu, "npu", None)
        names = ("group_begin", "group_end", "update_begin", "update_end")
        workspace = getattr(npu, "_npu_fused_infer_attention_score_get_max_workspace", None)
        tasks = all(hasattr(rt, f"graph_task_{n}") for n in names)
        if op is None or not hasattr(op, "out") or workspace is None or not tasks:
            return None
        return cls(op.out, workspace, rt)


def _captured(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_b: torch.Tensor,
    meta: MlaMeta,
    dims: MlaDims,
    graphs: GraphOps,
    graph: NpuGraph,
    shared: PerStep,
    buffers: Buffers,
) -> torch.Tensor:
    """A decode step being captured: FIA (BSND, one query a request) over every request's pages up to
    the context bucket, its call recorded as a task group; before each replay the graph re-issues it
    with the step's lengths (`NpuGraph.replay`), padding rows reading one key."""
    B, H = q.shape[0], dims.num_heads
    groups: list[PagedContext] = shared.get(meta, "mla graph", lambda: PagedContext.whole(meta))
    query, query_rope, w_uv, heads = _queries(q, kv_b, dims)
    out = torch.empty(B, 1, heads, LATENT, dtype=q.dtype, device=q.device)
    for step in groups:  # one FIA task group a run of requests, its lengths re-issued before each replay
        _capture_group(query, query_rope, cache, step, dims, heads, graphs, graph, buffers, out[step.tokens])
    o_lat = out.view(B, heads, LATENT)[:, :H]
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)


def _capture_group(
    query: torch.Tensor,
    query_rope: torch.Tensor,
    cache: torch.Tensor,
    step: PagedContext,
    dims: MlaDims,
    heads: int,
    graphs: GraphOps,
    graph: NpuGraph,
    buffers: Buffers,
    out: torch.Tensor,
) -> None:
    """FIA's `.out` form over one run of requests' pages, in a task group; its update re-issues it with
    those requests' lengths (rows past the step's live ones read one key). The graph keeps no buffer of
    its own but `out`: the context, workspace and lse are the backend's `buffers`."""
    t, n = step.requests, step.requests.stop - step.requests.start
    common = _common(cache, step, dims, heads, buffers)
    args = (query[t].reshape(n, 1, heads, LATENT), common.pop("key"), common.pop("value"))
    common |= {"query_rope": query_rope[t].reshape(n, 1, heads, ROPE), "input_layout": "BSND"}
    common["sparse_mode"] = 0
    longest = common | {"actual_seq_lengths_kv": [step.slots.shape[0] // n * BLOCK] * n}  # the bucket's
    workspace, lse = buffers.workspace(graphs, args, longest)
    rt = graphs.runtime
    rt.graph_task_group_begin(rt.current_stream())
    graphs.out(*args, **common, workspace=workspace, out=[out, lse])
    handle = rt.graph_task_group_end(rt.current_stream())

    def update(seq_lens: Sequence[int]) -> None:
        mine = list(seq_lens[t])
        lengths = [*mine, *[1] * (n - len(mine))]
        stream = rt.current_stream()
        rt.graph_task_update_begin(stream, handle)
        now = common | {"actual_seq_lengths_kv": lengths}
        graphs.out(*args, **now, workspace=workspace, out=[out, lse])
        rt.graph_task_update_end(stream)

    graph.updates.append(update)
