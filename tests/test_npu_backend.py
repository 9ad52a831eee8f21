"""The npu backend on the CPU: the missing-torch_npu error, and its ops against the reference ops
through a fake `torch_npu` whose functions implement the documented semantics in plain PyTorch
(torch_npu's op-plugin docs: npu_dynamic_quant, npu_quant_matmul, npu_moe_init_routing_v2,
npu_grouped_matmul, npu_moe_token_unpermute). This checks our
wrappers' plumbing (layouts, transposes, dtypes, routing index bookkeeping), not the real kernels:
none of this has run on an Ascend NPU."""

from __future__ import annotations

import dataclasses
import random
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_torch_npu import install

from dsv4serve.backends import reference, select
from dsv4serve.backends.npu import FAMILY_OPS, NPU_OPS
from dsv4serve.layers.linear import Int8Weight, quantize_int8

REFERENCE = reference.backend()


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Install the fake torch_npu; returns how often each op was called."""
    return install(monkeypatch)


# --- import guard ------------------------------------------------------------------------------


def test_npu_backend_without_torch_npu_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    with pytest.raises(RuntimeError, match=r"pip install 'dsv4serve\[npu\]'"):
        select("npu")


def test_the_npu_backend_needs_no_triton() -> None:
    """triton-ascend is optional (GLM's split + norm compiles with it): without any triton, the npu
    backend imports and builds over the fake, that family on the reference."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.path.insert(0, 'tests')\n"
        "import pytest, fake_torch_npu\n"
        "from dsv4serve.backends import reference, select\n"
        "fake_torch_npu.install(pytest.MonkeyPatch())\n"
        "ops = select('npu')\n"
        "assert ops.mla.qkv_split_norm is reference.backend().mla.qkv_split_norm\n"
    )
    import subprocess

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_torch_npu_without_our_ops_runs_the_reference_with_a_warning_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    with pytest.warns(RuntimeWarning) as caught:
        ops = select("npu:0")
    assert len(caught) == len(FAMILY_OPS)
    for family in FAMILY_OPS:
        assert _family(ops, family) is _family(REFERENCE, family), family


def _family(ops: Any, name: str) -> Any:
    """An op family by its FAMILY_OPS name (`rms_norm`, `dsv4.rope`)."""
    for part in name.split("."):
        ops = getattr(ops, part)
    return ops


def test_every_mapped_family_runs_its_ascend_op(fake_npu: dict[str, int]) -> None:
    """Every op family of the seam is on an Ascend op but the steps' index metadata (`prepare`) and GLM's
    split + norm, which is Triton source compiled by triton-ascend (absent here: its own test)."""
    ops = select("npu")
    names = ["linear", "rms_norm", "add_rms_norm", "gating_top_k", "routed_experts"]
    names += [f"dsv4.{f.name}" for f in dataclasses.fields(REFERENCE.dsv4)]
    names += [f"mla.{f.name}" for f in dataclasses.fields(REFERENCE.mla)]
    mapped = {f for f in names if _family(ops, f) is not _family(REFERENCE, f)}
    assert mapped == set(FAMILY_OPS)
    assert set(names) - mapped == {"dsv4.prepare", "mla.prepare", "mla.qkv_split_norm"}
    assert mapped == {"linear", "rms_norm", "add_rms_norm", "gating_top_k", "routed_experts", "dsv4.rope",
                      "dsv4.q_norm_rope", "dsv4.kv_norm_rope_store", "dsv4.hc_pre", "dsv4.hc_post",
                      "dsv4.hc_head", "dsv4.compressor", "dsv4.sparse_attention", "dsv4.indexer_topk",
                      "mla.rope_store", "mla.attention"}  # fmt: skip


@pytest.mark.parametrize("op", NPU_OPS)
def test_a_missing_op_falls_back_with_one_warning_naming_it(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    install(monkeypatch, missing=(op,))
    with pytest.warns(RuntimeWarning, match=op) as caught:
        ops = select("npu")
    needing = [f for f, names in FAMILY_OPS.items() if op in names]
    assert len(caught) == len(needing)
    for family in FAMILY_OPS:
        assert (_family(ops, family) is _family(REFERENCE, family)) == (family in needing), family


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_reference(fake_npu: dict[str, int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 3, 64, generator=gen) * 4).to(dtype)
    w = torch.rand(64, generator=gen) + 0.5  # fp32, as the engine keeps norms
    got = select("npu").rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and torch.equal(got, REFERENCE.rms_norm(x, w, 1e-6))
    assert fake_npu["npu_rms_norm"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_reference(fake_npu: dict[str, int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    x, delta = ((torch.randn(9, 64, generator=gen) * 4).to(dtype) for _ in range(2))
    w = torch.rand(64, generator=gen) + 0.5
    total, normed = select("npu").add_rms_norm(x, delta, w, 1e-6)
    want_total, want_normed = REFERENCE.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, want_total) and torch.equal(normed, want_normed) and total.dtype == dtype
    assert fake_npu["npu_add_rms_norm"] == 1


@pytest.mark.parametrize("state_mode", ["paged", "ring"])
@pytest.mark.parametrize("missing", [(), *((op,) for op in NPU_OPS)], ids=["all", *NPU_OPS])
def test_greedy_run_through_the_npu_backend_is_the_references(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, state_mode: str, missing: tuple[str, ...]
) -> None:
    """A tiny DeepSeek-V4 in fp32 through the executor on the npu backend (the fake's ops on CPU tensors,
    chunked prefills mixed with decodes): the reference backend's tokens; with an op missing, too."""
    import warnings

    from golden_harness import compare, engine_traces, random_chunker

    from dsv4serve.config import EngineConfig
    from dsv4serve.executor.runner import ModelRunner

    calls = install(monkeypatch, missing)
    rng = random.Random(9)
    prompts = [[rng.randrange(2, 129000) for _ in range(n)] for n in (3, 37)]
    engine = EngineConfig(
        dtype="float32", page_size=4, max_num_seqs=3, max_total_tokens=512, state_mode=state_mode
    )
    want = engine_traces(tiny_model_dir, prompts, 5, engine, chunk=random_chunker(2, 4, 11))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the missing op's, checked above
        runner = ModelRunner(tiny_model_dir, engine, ops=select("npu"))
    got = engine_traces(tiny_model_dir, prompts, 5, engine, chunk=random_chunker(2, 4, 11), runner=runner)
    assert max(compare(w, g) for w, g in zip(want, got, strict=True)) <= 1e-5
    for op in ("npu_rms_norm", "npu_moe_gating_top_k", "npu_rotary_mul"):  # the tiny model's Ascend ops
        assert (calls[op] > 0) == (op not in missing), op


def _streams(seed: int, tokens: int, hidden: int, dtype: torch.dtype) -> tuple[Any, ...]:
    from dsv4serve.layers.mhc import HcParams, HyperConnection

    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, 4, hidden, generator=gen)).to(dtype)
    hc = HyperConnection(
        fn=torch.randn(24, 4 * hidden, generator=gen) * 0.02,
        base=torch.randn(24, generator=gen) * 0.1,
        scale=torch.randn(3, generator=gen),
    )
    norm = torch.rand(hidden, generator=gen) + 0.5
    return h, hc, norm, HcParams(mult=4, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)


# each generation's mHC and sparse attention ops, by their `calls` keys
GENERATION_OPS = {
    "custom": ("npu_hc_pre_v2", "npu_hc_post", "npu_sparse_attn_sharedkv"),
    "cann": tuple(
        f"cann_ops_transformer.{op}" for op in ("mhc_pre_sinkhorn", "mhc_post", "sparse_flash_mla")
    ),
}


@pytest.mark.parametrize("generation", list(GENERATION_OPS))
@pytest.mark.parametrize("hidden", [4096, 7168])
def test_mhc_pre_and_post_on_their_ascend_ops_are_the_reference(
    monkeypatch: pytest.MonkeyPatch, hidden: int, generation: str
) -> None:
    """DeepSeek-V4's mHC at the dimensions the custom ops take (bf16 streams, hc 4, Flash's 4096 and
    Pro's 7168), on the custom libraries' ops or CANN's newer ones (the two eps apart, so a swap shows):
    the block input, post and comb, then the new streams, against the reference's."""
    calls = install(monkeypatch, older=generation == "custom")
    pre_op, post_op, _ = GENERATION_OPS[generation]
    h, hc, norm, p = _streams(3, 5, hidden, torch.bfloat16)
    p = dataclasses.replace(p, eps=1e-3)
    dsv4 = select("npu").dsv4
    x, post, comb = dsv4.hc_pre(h, hc, norm, p)
    want_x, want_post, want_comb = REFERENCE.dsv4.hc_pre(h, hc, norm, p)
    assert x.dtype == torch.bfloat16 and post.shape == (5, 4) and comb.shape == (5, 4, 4)
    torch.testing.assert_close(post, want_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, want_comb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, want_x)  # bf16's tolerance: the collapse's sums in another order
    out = torch.randn(5, hidden, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = dsv4.hc_post(out, h, post, comb)
    assert got.dtype == torch.bfloat16 and got.shape == h.shape
    want = REFERENCE.dsv4.hc_post(out.float(), h.float(), post, comb)  # the op mixes in fp32, then casts
    torch.testing.assert_close(got, want.to(torch.bfloat16))
    assert calls[pre_op] == calls[post_op] == 1


@pytest.mark.parametrize("generation", list(GENERATION_OPS))
@pytest.mark.parametrize("hidden", [4096, 7168])
def test_mhc_head_on_the_pre_op_is_the_reference(
    monkeypatch: pytest.MonkeyPatch, hidden: int, generation: str
) -> None:
    """The head's collapse (its own fn (hc, hc*D), base (hc,), scale (1,)) on hc_pre's op of either
    generation, its parameters padded once: the reference's normed collapse, within bf16's rounding;
    a wrong pad (a nonzero post / comb scale) cannot show, a wrong pre row would."""
    from dsv4serve.layers.mhc import HyperConnection

    calls = install(monkeypatch, older=generation == "custom")
    h, full, norm, p = _streams(7, 5, hidden, torch.bfloat16)
    head = HyperConnection(fn=full.fn[:4] * 10, base=full.base[:4], scale=full.scale[:1])
    dsv4 = select("npu").dsv4
    got = dsv4.hc_head(h, head, norm, p)
    want = REFERENCE.dsv4.hc_head(h, head, norm, p)
    assert got.dtype == torch.bfloat16 and got.shape == (5, hidden)
    torch.testing.assert_close(got, want)
    wrong = HyperConnection(fn=full.fn[4:8] * 10, base=full.base[:4], scale=full.scale[:1])
    assert not torch.allclose(REFERENCE.dsv4.hc_head(h, wrong, norm, p).float(), want.float(), atol=0.05)
    padded = dsv4.hc_head.keywords["padded"]  # type: ignore[attr-defined]
    dsv4.hc_head(h, head, norm, p)
    assert len(padded) == 1 and calls[GENERATION_OPS[generation][0]] == 2  # padded once, the op each call
    h, full, norm, p = _streams(7, 5, 64, torch.bfloat16)  # outside the op's limits: the reference itself
    head = HyperConnection(fn=full.fn[:4], base=full.base[:4], scale=full.scale[:1])
    assert torch.equal(dsv4.hc_head(h, head, norm, p), REFERENCE.dsv4.hc_head(h, head, norm, p))
    assert calls[GENERATION_OPS[generation][0]] == 2


def test_mhc_outside_the_custom_ops_limits_takes_the_reference(fake_npu: dict[str, int]) -> None:
    """fp32 streams, or a hidden size the ops do not take: the reference, not the op."""
    dsv4 = select("npu").dsv4
    for dtype, hidden in ((torch.float32, 4096), (torch.bfloat16, 64)):
        h, hc, norm, p = _streams(5, 3, hidden, dtype)
        got = dsv4.hc_pre(h, hc, norm, p)
        for a, b in zip(got, REFERENCE.dsv4.hc_pre(h, hc, norm, p), strict=True):
            assert torch.equal(a, b)
        out = h[:, 0]
        assert torch.equal(
            dsv4.hc_post(out, h, got[1], got[2]), REFERENCE.dsv4.hc_post(out, h, got[1], got[2])
        )
    assert fake_npu["npu_hc_pre_v2"] == fake_npu["npu_hc_post"] == 0


@pytest.mark.parametrize("state_mode", ["paged", "ring"])
def test_decode_steps_captured_as_npu_graphs_give_the_references_tokens(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, state_mode: str
) -> None:
    """Graphs on: the executor's capture code (the CUDA backend's) captures decode steps through the npu
    backend's graph class over the fake's `NPUGraph`, which records a step's ops and runs them again on
    replay (a host sync inside a capture raises); the replayed steps give the reference's tokens."""
    from golden_harness import compare, engine_traces, random_chunker

    from dsv4serve.backends.npu.graphs import NpuGraphs
    from dsv4serve.config import EngineConfig
    from dsv4serve.executor.runner import ModelRunner

    install(monkeypatch)
    monkeypatch.setattr(NpuGraphs, "device_type", "cpu")  # the fake's tensors live on the CPU
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 129000) for _ in range(n)] for n in (5, 23, 2)]
    engine = EngineConfig(
        dtype="float32", page_size=4, max_num_seqs=3, max_total_tokens=512, state_mode=state_mode
    )
    want = engine_traces(tiny_model_dir, prompts, 6, engine, chunk=random_chunker(2, 4, 12))
    runner = ModelRunner(tiny_model_dir, engine, ops=select("npu"))
    assert runner.graphs is not None and set(runner.graphs.graphs) == set(runner.graphs.startup_keys())
    got = engine_traces(tiny_model_dir, prompts, 6, engine, chunk=random_chunker(2, 4, 12), runner=runner)
    assert max(compare(w, g) for w, g in zip(want, got, strict=True)) <= 1e-5
    assert runner.graphs is not None and runner.graphs.graphs, "no decode step was captured"
    assert sum(g.graph.graph.replays for g in runner.graphs.graphs.values()) > 0  # type: ignore[union-attr]
    shared = runner.graphs.logits.data_ptr()  # every graph's logits in the one buffer, none in its pool
    assert {g.logits.data_ptr() for g in runner.graphs.graphs.values()} == {shared}


def _visible_picks(case: Any, gen: torch.Generator, topk: int) -> torch.Tensor:
    """(T, topk) random distinct visible ratio-4 entries per token, in index order, -1 padded."""
    positions = case.batch.positions.tolist()
    out = torch.full((len(positions), topk), -1, dtype=torch.int32)
    for t, p in enumerate(positions):
        visible = (p + 1) // 4
        chosen = torch.randperm(visible, generator=gen)[: min(topk, visible)].sort().values
        out[t, : chosen.numel()] = chosen.to(torch.int32)
    return out


@pytest.mark.parametrize("generation", list(GENERATION_OPS))
@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("poison", [False, True])
def test_sparse_attention_on_its_ascend_op_is_the_reference(
    monkeypatch: pytest.MonkeyPatch, ratio: int, poison: bool, generation: str
) -> None:
    """DeepSeek-V4's attention at the op's dimensions (64 heads of 512, window 128, bf16, pages of 16) over
    real pools and tables (cached prefixes over earlier steps, evicted window pages, stale rows; with
    `poison`, every slot no query may read holds NaN / inf): the npu backend's call of
    `npu_sparse_attn_sharedkv`, or of CANN's newer `sparse_flash_mla` (block tables from the slot tables,
    each token its own batch entry) gives the reference's output."""
    calls = install(monkeypatch, older=generation == "custom")
    attention_op = GENERATION_OPS[generation][2]
    from kernel_cases import kernel_model, make_case, pool_of

    cfg = kernel_model(
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, sliding_window=128,
        compress_ratios=[0, 4, 128], o_groups=8, index_topk=512,
    )  # fmt: skip
    case = make_case(
        7, [(300, 3), (0, 140), (255, 2)], page_size=16, dtype="bfloat16", poison=poison, cfg=cfg
    )
    layer = cfg.compress_ratios.index(ratio)
    gen = torch.Generator().manual_seed(3)
    T = case.batch.num_tokens
    q = (torch.randn(T, 64, 512, generator=gen) * 4).to(torch.bfloat16)  # peaked: each key's weight shows
    sinks = torch.randn(64, generator=gen)
    swa = case.buffer("swa", layer)
    cmp = case.buffer(pool_of(ratio), layer) if ratio else None
    picks = _visible_picks(case, gen, 300) if ratio == 4 else None
    got = select("npu").dsv4.sparse_attention(q, swa, cmp, picks, case.fused, sinks, 512**-0.5, ratio)
    assert calls[attention_op] == 1 and sum(calls[ops[2]] for ops in GENERATION_OPS.values()) == 1
    fp32 = [None if t is None else t.float() for t in (q, swa, cmp)]  # the reference in fp32
    want = REFERENCE.dsv4.sparse_attention(
        fp32[0], fp32[1], fp32[2], picks, case.ref, sinks, 512**-0.5, ratio
    )
    assert got.dtype == torch.bfloat16 and not want.isnan().any()
    torch.testing.assert_close(
        got.float(), want, rtol=2e-2, atol=2e-2
    )  # bf16 rounding of out, then of its rope
    assert (got.float() - want).abs().mean() < 2e-3


@pytest.mark.parametrize("poison", [False, True])
def test_indexer_on_npu_lightning_indexer_picks_the_references_entries(
    fake_npu: dict[str, int], poison: bool
) -> None:
    """The lightning indexer at the op's dimensions (64 heads of 128, bf16, pages of 16) over real pools
    and tables (a token with no visible entry, tokens with more than top-k): the same entries, in the
    same order, as the reference given the head weights the op takes (fp32 weights x scale, in bf16)."""
    from kernel_cases import kernel_model, make_case

    cfg = kernel_model(
        index_n_heads=64, index_head_dim=128, index_topk=16, compress_ratios=[0, 4, 16], sliding_window=128
    )
    case = make_case(8, [(300, 3), (0, 70), (2, 1)], page_size=16, dtype="bfloat16", poison=poison, cfg=cfg)
    layer = cfg.compress_ratios.index(4)
    gen = torch.Generator().manual_seed(5)
    T = case.batch.num_tokens
    q = torch.randn(T, 64, 128, generator=gen).to(torch.bfloat16)
    head_w = torch.randn(T, 64, generator=gen)
    keys = case.buffer("c4_index", layer)
    got = select("npu").dsv4.indexer_topk(q, head_w, keys, case.fused, 16, 128**-0.5)
    assert fake_npu["npu_lightning_indexer"] == 1
    rounded = (head_w * 128**-0.5).to(torch.bfloat16).float()  # what the op is given
    want = REFERENCE.dsv4.indexer_topk(q, rounded, keys, case.ref, 16, 1.0)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert (want[-1] == -1).all() and (want[:3] >= 0).all()  # position 2: nothing visible; 300+: all 16


def test_cpu_backend_does_not_import_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert select("cpu").linear is REFERENCE.linear


# --- linear ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_is_exact_on_integer_inputs(fake_npu: dict[str, int], dtype: torch.dtype) -> None:
    """int8-valued weights and activations with a 127 in every row: all scales are 1."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (24, 40), generator=gen).float()
    w[:, 3] = 127.0
    x = torch.randint(-127, 128, (2, 5, 40), generator=gen).float()
    x[..., 7] = -127.0
    qw, xd = quantize_int8(w), x.to(dtype)
    got = select("npu").linear(xd, qw)
    assert got.dtype == dtype and got.shape == (2, 5, 24)
    assert torch.equal(got, REFERENCE.linear(xd, qw))
    assert fake_npu["npu_quant_matmul"] == 1 and fake_npu["npu_dynamic_quant"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_matches_the_reference_on_random_inputs(
    fake_npu: dict[str, int], dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    ops = select("npu")
    for tokens, d_in, d_out in ((1, 64, 32), (17, 256, 96), (3, 96, 200)):
        x = torch.randn(tokens, d_in, generator=gen).to(dtype)
        qw = quantize_int8(torch.randn(d_out, d_in, generator=gen))
        ref = REFERENCE.linear(x, qw).float()
        got = ops.linear(x, qw).float()
        assert got.dtype == ref.dtype and float((got - ref).abs().max() / ref.abs().max()) < 1e-2
    assert fake_npu["npu_quant_matmul"] == 3


def test_fp32_and_float_weights_take_the_reference(fake_npu: dict[str, int]) -> None:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 32, generator=gen), torch.randn(16, 32, generator=gen)
    ops = select("npu")
    assert torch.equal(ops.linear(x, quantize_int8(w)), REFERENCE.linear(x, quantize_int8(w)))
    assert torch.equal(ops.linear(x, w), REFERENCE.linear(x, w))
    assert fake_npu["npu_quant_matmul"] == 0


# --- routed experts ----------------------------------------------------------------------------


def _moe_inputs(seed: int, tokens: int, experts: int = 6, top_k: int = 3, hidden: int = 32, inter: int = 24):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])  # (T, k)
    weights = torch.rand(tokens, top_k, generator=gen)
    w1 = torch.randn(experts, inter, hidden, generator=gen) / hidden**0.5
    w3 = torch.randn(experts, inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return x, weights, ids, w1, w2, w3


@pytest.mark.parametrize("tokens", [1, 5, 40, 100])
@pytest.mark.parametrize("stacked", [False, True])
def test_float_routed_experts_match_the_reference_in_fp32(
    fake_npu: dict[str, int], tokens: int, stacked: bool
) -> None:
    """Gate and up as two grouped GEMMs, or as one over a stacked [W1; W3] (the loaders' layout)."""
    x, weights, ids, w1, w2, w3 = _moe_inputs(tokens, tokens)
    if stacked:
        w13 = torch.cat([w1, w3], dim=1)
        w1, w3 = w13[:, : w1.shape[1]], w13[:, w1.shape[1] :]
    ref = REFERENCE.routed_experts(x, weights, ids, w1, w2, w3, 0.5)  # low limit: the clamp bites
    got = select("npu").routed_experts(x, weights, ids, w1, w2, w3, 0.5)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert fake_npu["npu_grouped_matmul"] == (2 if stacked else 3)
    assert fake_npu["npu_moe_token_unpermute"] == 1


def test_routed_experts_with_unused_experts_and_int64_ids(fake_npu: dict[str, int]) -> None:
    x, weights, ids, w1, w2, w3 = _moe_inputs(7, 9, experts=16, top_k=2)
    ids = ids % 5  # experts 5..15 get no tokens; (T, k) may repeat an expert per token
    ref = REFERENCE.routed_experts(x, weights, ids, w1, w2, w3, 10.0)
    got = select("npu").routed_experts(x, weights, ids, w1, w2, w3, 10.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_routed_experts_match_the_reference(fake_npu: dict[str, int], dtype: torch.dtype) -> None:
    x, weights, ids, w1, w2, w3 = _moe_inputs(3, 20)
    x, weights = x.to(dtype), weights.to(dtype)
    q1, q2, q3 = quantize_int8(w1), quantize_int8(w2), quantize_int8(w3)
    ref = REFERENCE.routed_experts(x, weights, ids, q1, q2, q3, 1.0).float()
    got = select("npu").routed_experts(x, weights, ids, q1, q2, q3, 1.0)
    assert got.dtype == dtype
    assert float((got.float() - ref).abs().max() / ref.abs().max()) < 3e-2
    assert fake_npu["npu_dynamic_quant"] == 2 and fake_npu["npu_grouped_matmul"] == 3


def test_int8_experts_with_fp32_activations_take_the_fallback(fake_npu: dict[str, int]) -> None:
    x, weights, ids, w1, w2, w3 = _moe_inputs(4, 6)
    q1, q2, q3 = quantize_int8(w1), quantize_int8(w2), quantize_int8(w3)
    ref = REFERENCE.routed_experts(x, weights, ids, q1, q2, q3, 1.0)
    got = select("npu").routed_experts(x, weights, ids, q1, q2, q3, 1.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert fake_npu["npu_grouped_matmul"] == 0 and isinstance(q1[0], Int8Weight)
