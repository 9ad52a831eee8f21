"""The two generations of Ascend's DeepSeek-V4 ops (`backends/npu`'s NEWER): the custom libraries' where a
build has them, else CANN's newer `torch.ops.cann_ops_transformer` ones, else the reference with one
warning naming both; the choice logged once. The ops' math against the reference is in test_npu_backend
(mHC, sparse attention), test_npu_compressor and test_npu_golden. None of this has run on an Ascend NPU."""

from __future__ import annotations

import warnings

import pytest
import structlog
import torch
from fake_torch_npu import install
from test_npu_backend import _streams

from dsv4serve.backends import reference, select
from dsv4serve.backends.npu import GENERATIONAL, NEWER

REFERENCE = reference.backend()
FAMILIES_OF = {  # the families each generational op serves
    "npu_hc_pre_v2": ("hc_pre", "hc_head"),
    "npu_hc_post": ("hc_post",),
    "npu_sparse_attn_sharedkv": ("sparse_attention",),
}
GENERATIONAL_FAMILIES = [f for families in FAMILIES_OF.values() for f in families]


@pytest.mark.parametrize("older", [True, False], ids=["custom", "cann"])
def test_each_familys_generation_is_chosen_and_logged_once(
    monkeypatch: pytest.MonkeyPatch, all_logs: structlog.testing.LogCapture, older: bool
) -> None:
    """The custom libraries' ops where present, else CANN's newer ones; no warning; one log line."""
    install(monkeypatch, fused_compressor=older, older=older)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dsv4 = select("npu").dsv4
    wrappers = {family: getattr(dsv4, family).func.__name__ for family in GENERATIONAL_FAMILIES}
    assert wrappers == {f: f"npu_{f}" for f in GENERATIONAL_FAMILIES}
    for family in GENERATIONAL_FAMILIES:  # each on the generation chosen
        assert getattr(dsv4, family).keywords["newer"] is not older, family
    lines = [e for e in all_logs.entries if e["event"] == "npu_generation"]
    assert len(lines) == 1 and lines[0]["actor"] == "npu"
    families = {f.removeprefix("dsv4.") for f in GENERATIONAL}
    assert families == {"compressor", *GENERATIONAL_FAMILIES}
    assert {f: lines[0][f] for f in families} == dict.fromkeys(families, "custom" if older else "cann")


@pytest.mark.parametrize("op", list(FAMILIES_OF))
def test_without_either_generation_the_reference_runs_with_one_warning_naming_both(
    monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """One warning for each family the op serves, naming both generations' ops; those families on the
    reference."""
    install(monkeypatch, missing=(op,))  # the custom op and its newer counterpart
    with pytest.warns(RuntimeWarning, match=op) as caught:
        ops = select("npu")
    assert len(caught) == len(FAMILIES_OF[op])
    assert all(f"cann_ops_transformer.{NEWER[op]}" in str(w.message) for w in caught)
    for family in FAMILIES_OF[op]:
        assert getattr(ops.dsv4, family) is getattr(REFERENCE.dsv4, family)


def test_a_family_never_mixes_the_generations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The custom attention without its metadata op: CANN's pair, not the custom op with CANN's metadata."""
    install(monkeypatch)
    monkeypatch.delattr(torch.ops._C_ascend, "npu_sparse_attn_sharedkv_metadata")
    attention = select("npu").dsv4.sparse_attention
    assert attention.keywords["newer"] is True  # type: ignore[attr-defined]
    assert attention.keywords["op"].__name__ == attention.keywords["metadata_op"].__name__ == "counted"  # type: ignore[attr-defined]


def test_newer_mhc_outside_its_limits_takes_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 streams, a hidden size off 128s, or not 20 Sinkhorn iterations: the reference, not the op."""
    calls = install(monkeypatch, older=False)
    dsv4 = select("npu").dsv4
    for dtype, hidden, iters in (
        (torch.float32, 4096, 20),
        (torch.bfloat16, 64, 20),
        (torch.bfloat16, 128, 3),
    ):
        h, hc, norm, p = _streams(5, 3, hidden, dtype)
        p = type(p)(mult=p.mult, sinkhorn_iters=iters, eps=p.eps, norm_eps=p.norm_eps)
        got = dsv4.hc_pre(h, hc, norm, p)
        for a, b in zip(got, REFERENCE.dsv4.hc_pre(h, hc, norm, p), strict=True):
            assert torch.equal(a, b)
        if dtype == torch.float32:
            out = h[:, 0]
            want = REFERENCE.dsv4.hc_post(out, h, got[1], got[2])
            assert torch.equal(dsv4.hc_post(out, h, got[1], got[2]), want)
    assert calls["cann_ops_transformer.mhc_pre_sinkhorn"] == calls["cann_ops_transformer.mhc_post"] == 0
