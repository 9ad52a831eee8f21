"""GLM-4.7-Flash's MLA attention on the npu backend (`backends/npu/mla.py`: torch_npu's
`npu_fused_infer_attention_score` in its MLA form) through the fake `torch_npu`, whose op implements
the documented semantics in plain PyTorch: against the reference on ragged steps (cached prefixes and
chunks, decodes, contexts crossing pages, an empty chunk, poisoned slots), its fallbacks, the warning
when the op is missing, and a tiny GLM's greedy run. None of this has run on an Ascend NPU."""

from __future__ import annotations

import dataclasses
import random
import warnings
from pathlib import Path
from typing import Any

import fake_torch_npu
import pytest
import torch
from fake_torch_npu import install
from golden_harness import compare, engine_traces, random_chunker
from kernel_cases import step_item

from dsv4serve.attention import mla
from dsv4serve.backends import reference, select
from dsv4serve.config import EngineConfig
from dsv4serve.executor.inputs import forward_batch
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm

REFERENCE = reference.backend()
OP = "npu_fused_infer_attention_score"
GLM_SHAPES = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}  # the latent FIA's MLA form takes
MIXED = [(0, 1), (40, 1), (300, 1), (127, 1), (128, 1), (70, 9), (0, 21), (120, 20), (30, 0), (250, 7)]
DECODES = [(0, 1), (5, 1), (127, 1), (128, 1), (260, 1)]


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The fake installed; returns how often each op was called."""
    return install(monkeypatch)


@pytest.fixture
def layouts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fake installed; returns the `input_layout` of each call of the op."""
    seen: list[str] = []
    op = fake_torch_npu.FAKES[OP]

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["input_layout"])
        return op(*args, **kwargs)

    monkeypatch.setitem(fake_torch_npu.FAKES, OP, spy)
    install(monkeypatch)
    return seen


def mla_case(
    shares: list[tuple[int, int]], dims: mla.MlaDims, gen: torch.Generator, poison: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, mla.MlaMeta]:
    """q, the latent pool (bf16), kv_b and the meta of one step, each request (cached prefix, new
    tokens) on scattered slots; with `poison`, every slot no request owns holds NaN."""
    width = dims.latent_width
    lengths = [prefix + new for prefix, new in shares]
    table = torch.zeros(len(shares) + 1, max(lengths) + 16, dtype=torch.int32)
    cache = torch.full((sum(lengths) + 40, width), float("nan") if poison else 0.0)
    order = torch.randperm(cache.shape[0] - 1, generator=gen) + 1  # slot 0: the padding sentinel
    used = 0
    for b, n in enumerate(lengths):
        table[b + 1, :n] = order[used : used + n].to(torch.int32)
        cache[order[used : used + n]] = torch.randn(n, width, generator=gen)
        used += n
    batch = forward_batch([step_item(b + 1, p, [7] * n) for b, (p, n) in enumerate(shares)], (), "cpu")
    meta = mla.mla_meta(batch, table, torch.ones(dims.qk_rope_head_dim // 2))
    heads, nope, v = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim
    q = torch.randn(batch.num_tokens, heads, nope + dims.qk_rope_head_dim, generator=gen)
    kv_b = torch.randn(heads * (nope + v), dims.kv_lora_rank, generator=gen) / 8
    return q.bfloat16(), cache.bfloat16(), kv_b.bfloat16(), meta


def glm_dims(heads: int, nope: int = 192, v: int = 256) -> mla.MlaDims:
    """GLM-4.7-Flash's attention (20 heads, q_nope 192, rope 64, v 256, latent 512), `heads` heads."""
    return mla.MlaDims(heads, 768, 512, nope, 64, v, 1e-5, (nope + 64) ** -0.5)


@pytest.mark.parametrize("heads", [20, 10, 5, 64], ids=lambda h: f"heads={h}")
@pytest.mark.parametrize(("shares", "layout"), [(MIXED, "TND"), (DECODES, "BSND")], ids=["mixed", "decodes"])
@pytest.mark.parametrize("poison", [False, True], ids=["", "poison"])
def test_mla_attention_on_fia_is_the_reference(
    layouts: list[str], heads: int, shares: list[tuple[int, int]], layout: str, poison: bool
) -> None:
    """GLM's heads (20, and 10 / 5 a rank under TP 2 / 4: padded to 32, 16, 8) and 64 over the latent
    pool: the npu backend's call gives the reference's output (computed in fp32 from the same bf16
    inputs), within bf16's rounding of the latent query, the op's output and the value projection."""
    dims = glm_dims(heads)
    q, cache, kv_b, meta = mla_case(shares, dims, torch.Generator().manual_seed(heads), poison)
    got = select("npu").mla.attention(q, cache, kv_b, meta, dims)
    assert layouts == [layout]
    want = REFERENCE.mla.attention(q.float(), cache.float(), kv_b.float(), meta, dims)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and not want.isnan().any()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
    assert (got.float() - want).abs().mean() < 5e-3 * want.abs().mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_store_on_npu_interleave_rope_is_the_reference(
    fake_npu: dict[str, int], dtype: torch.dtype
) -> None:
    """GLM's rope and latent write on npu_interleave_rope (q_pe, a strided view of q, and k_pe, a view of
    the split's output, as one call's heads; cos / sin in the half layout, once a step): q_pe rotated in
    place and every token's row stored as the reference does, the rest of q and of the pool (NaN-poisoned)
    untouched. The op's de-interleaved output is the reference's layout. fp32: the reference itself."""
    gen = torch.Generator().manual_seed(3)
    dims = glm_dims(20)
    q, cache, _, meta = mla_case(MIXED, dims, gen, poison=True)
    angles = meta.positions[:, None].float() * mla.rope_inv_freq(64, 10000.0, "cpu")[None]
    meta = dataclasses.replace(meta, cos=angles.cos(), sin=angles.sin())
    T = q.shape[0]
    y = torch.randn(T, 512 + 64 + 8, generator=gen).to(dtype)
    latents = mla.QkvLatents(q=None, kv=y[:, :512], k_pe=y[:, 512:576])
    q, cache = q.to(dtype), cache.to(dtype)
    want_q, want_cache = q.clone(), cache.clone()
    REFERENCE.mla.rope_store(want_q[..., 192:], latents, want_cache, meta)
    rope_store = select("npu").mla.rope_store
    for _ in range(2):  # a second layer of the step reuses its cos / sin
        got_q, got_cache = q.clone(), cache.clone()
        rope_store(got_q[..., 192:], latents, got_cache, meta)
        torch.testing.assert_close(got_q, want_q)
        torch.testing.assert_close(got_cache, want_cache, equal_nan=True)
    assert fake_npu["npu_interleave_rope"] == (0 if dtype == torch.float32 else 2)
    assert not torch.equal(want_q, q), "the rope moved q_pe"


def test_the_layers_of_a_step_share_its_paged_context(layouts: list[str]) -> None:
    """Built by a step's first layer (one gather index, one block table), then shared."""
    dims = glm_dims(20)
    q, cache, kv_b, meta = mla_case(MIXED, dims, torch.Generator().manual_seed(2), False)
    attention = select("npu").mla.attention
    shared = attention.keywords["shared"]  # type: ignore[attr-defined]
    first = attention(q, cache, kv_b, meta, dims)
    context = shared.items["mla"]
    second = attention(q, cache, kv_b, meta, dims)
    assert shared.items["mla"] is context and torch.equal(first, second) and layouts == ["TND", "TND"]
    assert len(context) == 1, "one call: the step's pages within GATHER_PAGES"
    assert context[0].kv_lengths == [p + n for p, n in MIXED] and context[0].q_ends[-1] == q.shape[0]


EMPTY_RUN = [(40, 1), (300, 0), (290, 0), (7, 3)]  # with 3 pages a call, the middle run has no token


@pytest.mark.parametrize(
    ("shares", "layout"),
    [(MIXED, "TND"), (DECODES, "BSND"), (EMPTY_RUN, "TND")],
    ids=["mixed", "decodes", "empty"],
)
def test_a_step_whose_context_passes_the_gather_bound_is_several_calls(
    monkeypatch: pytest.MonkeyPatch, layouts: list[str], shares: list[tuple[int, int]], layout: str
) -> None:
    """With room for 3 pages a call (GATHER_PAGES), the step's requests go in runs whose pages fit (a
    request of more pages alone): several FIA calls, each gathering only its run's pages, together the
    reference's output (a run of decodes only as BSND)."""
    from dsv4serve.backends.npu import mla as npu_mla

    monkeypatch.setattr(npu_mla, "GATHER_PAGES", 3)
    gathered: list[int] = []
    common = npu_mla._common
    monkeypatch.setattr(npu_mla, "_common", lambda *a: gathered.append(a[1].slots.shape[0]) or common(*a))
    dims = glm_dims(20)
    q, cache, kv_b, meta = mla_case(shares, dims, torch.Generator().manual_seed(5), True)
    got = select("npu").mla.attention(q, cache, kv_b, meta, dims)
    want = REFERENCE.mla.attention(q.float(), cache.float(), kv_b.float(), meta, dims)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
    pages = [-(-(p + n) // npu_mla.BLOCK) for p, n in shares]
    called = [-(-(p + n) // npu_mla.BLOCK) for p, n in shares if not (shares is EMPTY_RUN and n == 0)]
    assert sum(gathered) == sum(called) and len(layouts) == len(gathered) > 1
    assert all(n <= 3 or n in pages for n in gathered)  # a run within the bound, or one request
    assert layout in layouts and set(layouts) <= {"TND", "BSND"}  # a run of decodes alone: BSND


def test_calls_outside_the_ops_limits_take_the_reference(fake_npu: dict[str, int]) -> None:
    """fp32, a captured step (no host-known spans), a latent other than 512 + 64, over 128 heads: the
    reference's own result, the op never called."""
    gen = torch.Generator().manual_seed(4)
    attention = select("npu").mla.attention
    q, cache, kv_b, meta = mla_case(MIXED, glm_dims(20), gen, True)
    small = mla.MlaDims(4, None, 32, 16, 8, 16, 1e-5, 24**-0.5)
    cases = [
        (q.float(), cache.float(), kv_b.float(), meta, glm_dims(20)),
        (q, cache, kv_b, dataclasses.replace(meta, spans=None), glm_dims(20)),
        (*mla_case(MIXED, small, gen, True), small),
        (*mla_case(DECODES, glm_dims(256, 8, 8), gen, True), glm_dims(256, 8, 8)),
    ]
    for args in cases:
        assert torch.equal(attention(*args), REFERENCE.mla.attention(*args))
    assert fake_npu[OP] == 0


def test_a_torch_npu_without_fia_runs_the_reference_mla_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch, missing=(OP,))
    with pytest.warns(RuntimeWarning, match=OP) as caught:
        ops = select("npu")
    assert len(caught) == 1 and "mla.attention runs the reference" in str(caught[0].message)
    assert ops.mla.attention is REFERENCE.mla.attention
    assert ops.mla.rope_store is not REFERENCE.mla.rope_store  # its own op, still there


# A random tiny model in bf16 often has greedy near-ties (top two logits one bf16 step apart, 0.06 at
# these logits), which another summation order inside the attention (up to ~0.2 on the logits here)
# may flip; seed 15's picks lead by 0.3 or more. Its layers are dense: a MoE layer's expert choice can
# flip on a near-tie too, moving one token's logits by several units (the MoE ops are the DeepSeek-V4
# golden runs' subject).
SEED = 15


def _margins(traces: list[Any]) -> list[float]:
    """Each greedy pick's lead over the runner-up logit."""
    tops = [logits.float().topk(2).values for t in traces for logits in t.logits[-len(t.tokens) :]]
    return [float(top[0] - top[1]) for top in tops]


GLM_OPS = (OP, "npu_interleave_rope", "npu_add_rms_norm")  # the Ascend ops a GLM step calls


@pytest.mark.parametrize(
    ("graphs", "tritons", "missing", "gather_pages"),
    [
        (False, False, "", 0), (True, False, "", 0), (False, True, "", 0), (True, False, "", 2),
        *((True, False, op, 0) for op in GLM_OPS),
    ],
    ids=["eager", "graphs", "triton", "graphs-2-pages-a-call", *(f"graphs-without-{op}" for op in GLM_OPS)],
)  # fmt: skip
def test_greedy_glm_through_the_npu_backend_is_the_references(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    graphs: bool,
    tritons: bool,
    missing: str,
    gather_pages: int,
) -> None:
    """A tiny GLM (dense layers) at FIA's latent (512 + 64; 20 heads, padded to 32) in bf16 through the
    executor on the npu backend (chunked prefills mixed with decodes, pages of 16): the reference
    backend's greedy tokens, its logits within bf16's rounding. With graphs, decode steps are captured
    over the fake's NPUGraph and replayed, FIA in each layer recorded as a task group that every replay
    first re-issues with the step's lengths (no host sync inside the capture). With triton-ascend
    (here: Triton's interpreter on the fake's CPU tensors), the fused split + norm is the Triton source's.
    Without one of GLM's Ascend ops: one warning naming it, its family on the reference, the same tokens.
    With 2 pages a call (`gather_pages`), eager steps and captured buckets are several FIA calls."""
    from dsv4serve.backends import npu, split_norm
    from dsv4serve.backends.npu import mla as npu_mla
    from dsv4serve.backends.npu.graphs import NpuGraphs

    keys: set[int] = set()  # the storage of every FIA call's key, eager, captured or re-issued
    fia = fake_torch_npu.fake_fused_infer_attention_score

    def spy(*args: Any, **kwargs: Any) -> Any:
        keys.add(args[1].untyped_storage().data_ptr())
        return fia(*args, **kwargs)

    monkeypatch.setattr(fake_torch_npu, "fake_fused_infer_attention_score", spy)  # (the .out form's too)
    monkeypatch.setitem(fake_torch_npu.FAKES, OP, spy)
    calls = install(monkeypatch, missing=(missing,) if missing else ())
    if gather_pages:
        monkeypatch.setattr(npu_mla, "GATHER_PAGES", gather_pages)
    launches = []
    if tritons:
        monkeypatch.setattr(npu, "triton_ascend", lambda: True)
        kernel = split_norm.qkv_split_norm
        spy = lambda *a, **k: launches.append(1) or kernel(*a, **k)  # noqa: E731
        monkeypatch.setattr(split_norm, "qkv_split_norm", spy)
    if graphs:
        monkeypatch.setattr(NpuGraphs, "device_type", "cpu")  # the fake's tensors live on the CPU
    model_dir = make_tiny_glm(
        tmp_path, SEED, dtype="bfloat16", vocab_size=512, num_attention_heads=20, num_key_value_heads=20,
        first_k_dense_replace=3, **GLM_SHAPES,
    )  # fmt: skip
    rng = random.Random(SEED)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 40, 150)]
    engine = EngineConfig(
        dtype="bfloat16", page_size=16, max_num_seqs=4, max_total_tokens=1024, graphs=graphs
    )
    want = engine_traces(model_dir, prompts, 6, engine, chunk=random_chunker(5, 3, 24))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        runner = ModelRunner(model_dir, engine, ops=select("npu"))
    assert [str(w.message) for w in caught if missing in str(w.message)] == [str(w.message) for w in caught]
    assert len(caught) == (1 if missing else 0)  # one family a missing op, none otherwise
    got = engine_traces(model_dir, prompts, 6, engine, chunk=random_chunker(5, 3, 24), runner=runner)
    worst = max(compare(w, g) for w, g in zip(want, got, strict=True))  # asserts the same tokens
    assert worst < 0.25, worst  # a few bf16 steps
    assert worst < min(_margins(want)), "every pick leads its runner-up by more than any deviation"
    assert {op for op in GLM_OPS if calls[op] > 0} == set(GLM_OPS) - {missing}
    if missing != OP:  # every call's context in the backend's one buffer: no layer or graph keeps a copy
        buffers = runner.ops.mla.attention.keywords["buffers"]  # type: ignore[attr-defined]
        ((_, c, _),) = buffers.context.values()
        assert keys == {c.untyped_storage().data_ptr()}
    assert bool(launches) == tritons
    if graphs:
        assert runner.graphs is not None and runner.graphs.graphs, "no decode step was captured"
        captured = [g.graph for g in runner.graphs.graphs.values()]
        layers = runner.model_cfg.num_layers
        for key, g in runner.graphs.graphs.items():  # a call a run of requests within GATHER_PAGES
            widest = -(-key.context // npu_mla.BLOCK)  # a request's pages: past GATHER_PAGES, the reference
            run = max(1, npu_mla.GATHER_PAGES // widest)
            calls_a_layer = 0 if missing == OP or widest > npu_mla.GATHER_PAGES else -(-key.batch // run)
            assert len(g.graph.updates) == layers * calls_a_layer, key  # type: ignore[union-attr]
        if gather_pages:
            assert any(len(g.updates) > layers for g in captured)  # type: ignore[union-attr]
        assert sum(g.graph.replays for g in captured) > 0  # type: ignore[union-attr]


def test_the_fakes_fia_is_attention_as_documented() -> None:
    """The fake itself, on a plain (non-MLA) GQA call: BSND, causal (sparse_mode 3) with its softmax_lse
    against torch's scaled_dot_product_attention; then the calls the documentation forbids."""
    fia = fake_torch_npu.fake_fused_infer_attention_score
    gen = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(2, 9, 8, 64, generator=gen).bfloat16(),
        torch.randn(2, 9, 2, 64, generator=gen).bfloat16(),
    )
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    out, lse = fia(
        q, k, k, num_heads=8, num_key_value_heads=2, input_layout="BSND", scale=0.125, sparse_mode=3,
        atten_mask=mask, softmax_lse_flag=True,
    )  # fmt: skip
    qf, kf = q.float().transpose(1, 2), k.float().transpose(1, 2).repeat_interleave(4, 1)  # (B, N, S, D)
    want = torch.nn.functional.scaled_dot_product_attention(qf, kf, kf, is_causal=True, scale=0.125)
    torch.testing.assert_close(out.float(), want.transpose(1, 2), rtol=1e-2, atol=1e-2)
    scores = (qf @ kf.transpose(-1, -2) * 0.125).masked_fill(mask[:9, :9], float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1, keepdim=True))  # (B, N, S, 1)
    query, rope = torch.zeros(3, 16, 512).bfloat16(), torch.zeros(3, 16, 64).bfloat16()
    pages, table = torch.zeros(2, 128, 512).bfloat16(), torch.zeros(1, 2, dtype=torch.int32)
    mla_call = {
        "query_rope": rope, "key_rope": torch.zeros(2, 128, 64).bfloat16(), "num_heads": 16,
        "num_key_value_heads": 1, "scale": 0.1, "block_table": table, "block_size": 128,
        "input_layout": "TND", "actual_seq_lengths": [3], "actual_seq_lengths_kv": [200],
        "sparse_mode": 3, "atten_mask": mask,
    }  # fmt: skip
    assert fia(query, pages, pages, **mla_call)[0].shape == (3, 16, 512)
    forbidden = [
        {"softmax_lse_flag": True},  # MLA at D 512 gives no softmax_lse
        {"actual_seq_lengths": torch.tensor([3])},  # lengths are host lists
        {"actual_seq_lengths": [2]},  # TND's cumulative query lengths end at T
        {"num_heads": 20, "query_rope": torch.zeros(3, 20, 64).bfloat16()},  # 20 heads: not an MLA count
        # pages of 8 (MLA takes multiples of 16)
        {"block_size": 8, "key_rope": torch.zeros(2, 8, 64).bfloat16(), "actual_seq_lengths_kv": [10]},
        {"atten_mask": ~mask},  # not the causal mask
        {"actual_seq_lengths_kv": [300]},  # past the block table
    ]
    for change in forbidden:
        with pytest.raises(AssertionError):
            query_ = query if "num_heads" not in change else torch.zeros(3, 20, 512).bfloat16()
            pages_ = pages if "block_size" not in change else torch.zeros(2, 8, 512).bfloat16()
            fia(query_, pages_, pages_, **(mla_call | change))
    with pytest.raises(AssertionError):  # non-contiguous inputs
        fia(torch.zeros(3, 16, 1024).bfloat16()[..., ::2], pages, pages, **mla_call)
