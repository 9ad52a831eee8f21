"""Ascend msModelSlim W8A8_DYNAMIC checkpoints: the tiny writer, loading as Int8Weight, refusals."""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from golden_harness import engine_traces
from safetensors.torch import load_file, save_file

from dsv4serve import cli
from dsv4serve.config import EngineConfig
from dsv4serve.layers.linear import Int8Weight, quantize_int8, quantize_weights_int8
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.deepseek_v4.tiny import make_tiny
from dsv4serve.models.registry import config_from_dir
from dsv4serve.models.spec import CheckpointError
from tests.checkpoints import int8_names, load_checkpoint, loaded_int8_names, loaded_tensors

DESCRIPTION = "quant_model_description.json"
WEIGHTS = "quant_model_weights.safetensors"
WQ_A = "layers.0.attn.wq_a.weight"
ENGINE = EngineConfig(dtype="float32", page_size=8, max_num_seqs=4, max_total_tokens=1024)


@pytest.fixture(scope="module")
def w8a8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The int8 twin of the session's `tiny_model_dir` (same seed 0)."""
    return make_tiny(tmp_path_factory.mktemp("tiny-w8a8-seed0"), seed=0, quant="w8a8")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("small-w8a8"), seed=4, vocab_size=1024, quant="w8a8")


@pytest.fixture(scope="module")
def model(small: Path) -> DeepseekV4Config:
    return config_from_dir(small)


@pytest.fixture(scope="module")
def tensors(small: Path) -> dict[str, torch.Tensor]:
    return load_file(str(small / WEIGHTS))


@pytest.fixture(scope="module")
def description(small: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((small / DESCRIPTION).read_text())
    return data


def variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor], description: dict[str, object]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / WEIGHTS))
    (dst / DESCRIPTION).write_text(json.dumps(description))
    return dst


# ------------------------------------------------------------------------------------ the writer


def test_tiny_w8a8_has_the_msmodelslim_layout(small: Path, tensors: dict, description: dict) -> None:
    assert not (small / "model.safetensors").exists()
    assert "quantization_config" not in json.loads((small / "config.json").read_text())
    assert description["model_quant_type"] == "W8A8_DYNAMIC" and description["version"] == "1.0.0"
    assert set(tensors) <= set(description)  # every tensor described
    quantized = {n for n in tensors if description[n] == "W8A8_DYNAMIC" and n.endswith(".weight")}
    eligible = {n for n in tensors if n.endswith(".weight") and n in int8_names(config_from_dir(small))}
    # msModelSlim's DSV4 recipe keeps wo_b (with wo_a, compressors, router, ...) in floating point
    assert quantized == {n for n in eligible if not n.endswith("attn.wo_b.weight")}
    assert (
        "layers.3.ffn.experts.7.w2.weight" in quantized and "layers.1.attn.indexer.wq_b.weight" in quantized
    )
    for name in quantized:
        base = name.removesuffix(".weight")
        w, s, o = tensors[name], tensors[base + ".weight_scale"], tensors[base + ".weight_offset"]
        assert w.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (w.shape[0], 1)
        assert description[base + ".weight_scale"] == description[base + ".weight_offset"] == "W8A8_DYNAMIC"
        assert o.shape == s.shape and not o.any()
    companions = {n for n in tensors if n.endswith((".weight_scale", ".weight_offset"))}
    for name in set(tensors) - quantized - companions:
        assert description[name] == "FLOAT", name
        assert tensors[name].is_floating_point() or name.endswith("tid2eid"), name


def test_unknown_quant_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quant"):
        make_tiny(tmp_path, quant="int4")


def test_cli_make_tiny_passes_quant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[Path, int, str | None]] = []

    def make_tiny(out_dir: Path, seed: int, quant: str | None = None) -> Path:
        calls.append((out_dir, seed, quant))
        return out_dir

    fake = types.ModuleType("dsv4serve.models.deepseek_v4.tiny")
    fake.make_tiny = make_tiny  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dsv4serve.models.deepseek_v4.tiny", fake)
    assert cli.main(["make-tiny", str(tmp_path / "q"), "--seed", "2", "--quant", "w8a8"]) == 0
    assert cli.main(["make-tiny", str(tmp_path / "f")]) == 0
    assert calls == [(tmp_path / "q", 2, "w8a8"), (tmp_path / "f", 0, None)]
    capsys.readouterr()
    assert cli.main(["make-tiny", str(tmp_path / "x"), "--quant", "int4"]) == 2
    assert "--quant" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ loading


def test_loads_int8_weights_equal_to_online_quantization(w8a8_dir: Path, tiny_model_dir: Path) -> None:
    model = config_from_dir(w8a8_dir)
    got = load_checkpoint(w8a8_dir, model, dtype=torch.float32)
    plain = load_checkpoint(tiny_model_dir, model, dtype=torch.float32)
    assert {n: w.shape for n, w in got.items()} == loaded_tensors(model)
    int8 = {n for n, w in got.items() if isinstance(w, Int8Weight)}
    assert "layers.4.ffn.experts.w1" in int8 and "layers.0.ffn.shared_experts.w2.weight" in int8
    assert int8 == {n for n in got if n in loaded_int8_names(model) and not n.endswith("attn.wo_b.weight")}
    for name, w in got.items():
        ref = plain[name]
        assert isinstance(ref, torch.Tensor)
        if isinstance(w, Int8Weight):
            want = quantize_int8(ref)  # bit-exact: the same function on the same fp32 values
            assert w.qweight.dtype == torch.int8 and w.scale.dtype == torch.float32, name
            assert torch.equal(w.qweight, want.qweight) and torch.equal(w.scale, want.scale), name
        else:
            assert torch.equal(w, ref), name


def test_online_quantization_keeps_loaded_int8_weights(small: Path, model: DeepseekV4Config) -> None:
    got = load_checkpoint(small, model, dtype=torch.float32)
    again = quantize_weights_int8(got, loaded_int8_names(model))
    assert all(again[n] is w for n, w in got.items() if isinstance(w, Int8Weight))
    assert isinstance(again["layers.1.attn.wo_b.weight"], Int8Weight)  # float there: quantized online


def test_sharded_and_variant_layouts_load_the_same(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    reference = load_checkpoint(small, model, dtype=torch.float32)
    sharded = make_tiny(tmp_path / "sharded", seed=4, vocab_size=1024, quant="w8a8", shards=3)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"quant_model_weights-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert (sharded / "quant_model_weights.safetensors.index.json").is_file()
    # [N] instead of [N, 1] scales and offsets, a bf16 scale, and `model.`-prefixed names
    flat = {
        n: t.squeeze(1) if n.endswith((".weight_scale", ".weight_offset")) else t for n, t in tensors.items()
    }
    flat[WQ_A + "_scale"] = flat[WQ_A + "_scale"].bfloat16()
    prefixed = {"model." + n: t for n, t in flat.items()}
    described = {("model." + n if n in flat else n): t for n, t in description.items()}
    other = variant(small, tmp_path / "flat", prefixed, described)
    for src in (sharded, other):
        got = load_checkpoint(src, model, dtype=torch.float32)
        assert got.keys() == reference.keys()
        for name, w in got.items():
            ref = reference[name]
            if isinstance(w, Int8Weight) and isinstance(ref, Int8Weight):
                assert torch.equal(w.qweight, ref.qweight), name
                scale = ref.scale.bfloat16().float() if src == other and name == WQ_A else ref.scale
                assert torch.equal(w.scale, scale), name
            else:
                assert isinstance(w, torch.Tensor) and isinstance(ref, torch.Tensor)
                assert torch.equal(w, ref), name


# ------------------------------------------------------------------------------------ the engine


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 129000) for _ in range(n)] for n in (9, 33, 70)]


def test_engine_on_w8a8_equals_online_int8_quantization(w8a8_dir: Path, tiny_model_dir: Path) -> None:
    engine = ENGINE.with_(weight_quant="int8")  # quantizes the float wo_b in both; int8 kept as is
    ref = engine_traces(tiny_model_dir, _prompts(), 4, engine)
    got = engine_traces(w8a8_dir, _prompts(), 4, engine)
    for r, g in zip(ref, got, strict=True):
        assert g.tokens == r.tokens
        assert len(g.logits) == len(r.logits)
        assert all(torch.equal(a, b) for a, b in zip(r.logits, g.logits, strict=True))


def test_engine_on_w8a8_without_weight_quant_tracks_the_float_model(
    w8a8_dir: Path, tiny_model_dir: Path
) -> None:
    """No online quantization: the checkpoint's int8 projections run as int8, wo_b as float."""
    ref = engine_traces(tiny_model_dir, _prompts(), 4, ENGINE)
    got = engine_traces(w8a8_dir, _prompts(), 4, ENGINE)
    int8 = engine_traces(tiny_model_dir, _prompts(), 4, ENGINE.with_(weight_quant="int8"))
    corr, differs = [], False
    for r, g, q in zip(ref, got, int8, strict=True):
        for a, b, c in zip(r.logits[:-3], g.logits, q.logits, strict=False):  # prompt positions
            corr.append(float(torch.corrcoef(torch.stack([a, b]))[0, 1]))
            differs |= not torch.equal(b, c)  # wo_b float here, int8 there
    # Measured: median logit correlation 0.9996, mean 0.996 over the 112 prompt positions; a wrong
    # scale or layout gives correlations near 0.
    corr.sort()
    assert corr[len(corr) // 2] > 0.995 and sum(corr) / len(corr) > 0.97, corr[:5]
    assert differs


# ------------------------------------------------------------------------------------ refusals


def _load(src: Path, model: DeepseekV4Config) -> None:
    load_checkpoint(src, model, dtype=torch.float32)


def test_nonzero_offset_is_refused(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    name = "layers.2.ffn.experts.3.w2.weight_offset"
    bad = tensors | {name: tensors[name].clone().index_fill_(0, torch.tensor([5]), 1.0)}
    with pytest.raises(CheckpointError, match=rf"{name}: non-zero offsets .*symmetric"):
        _load(variant(small, tmp_path, bad, description), model)


def test_unsupported_quant_type_is_named(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    static = description | dict.fromkeys((WQ_A, WQ_A + "_scale", WQ_A + "_offset"), "W8A8")
    with pytest.raises(CheckpointError, match=rf"not supported: .*{WQ_A} \(W8A8\)"):
        _load(variant(small, tmp_path, tensors, static), model)


def test_int8_on_a_float_only_tensor_is_named(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    name = "layers.1.attn.wo_a.weight"
    q = quantize_int8(tensors[name])
    parts = {
        name: q.qweight,
        name + "_scale": q.scale[:, None],
        name + "_offset": torch.zeros(len(q.scale), 1),
    }
    desc = description | dict.fromkeys(parts, "W8A8_DYNAMIC")
    with pytest.raises(CheckpointError, match=rf"only in floating point: {name} \(W8A8_DYNAMIC\)"):
        _load(variant(small, tmp_path, tensors | parts, desc), model)


@pytest.mark.parametrize("suffix", ["_scale", "_offset"])
def test_missing_companion_is_named(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path, suffix: str
) -> None:
    bad = {n: t for n, t in tensors.items() if n != WQ_A + suffix}
    with pytest.raises(CheckpointError, match=rf"{WQ_A}: W8A8_DYNAMIC weight without {WQ_A}{suffix}$"):
        _load(variant(small, tmp_path, bad, description), model)


def test_misshaped_companions_and_weights_are_named(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    scale = "layers.3.attn.wkv.weight_scale"
    weight = "layers.0.ffn.shared_experts.w1.weight"
    bad = tensors | {scale: torch.ones(64, 2), weight: tensors[weight][:, :-1].contiguous()}
    with pytest.raises(CheckpointError, match=r"2 mis-shaped") as err:
        _load(variant(small, tmp_path, bad, description), model)
    assert f"{scale} [64, 2] (expected [64] or [64, 1])" in str(err.value)
    assert f"{weight} [32, 63] (expected [32, 64])" in str(err.value)


def test_orphan_companion_is_unexpected(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    orphan = "layers.0.attn.wo_b.weight_scale"  # wo_b is FLOAT
    extra = tensors | {orphan: torch.ones(64, 1)}
    with pytest.raises(CheckpointError, match=rf"1 unexpected tensors: {orphan}"):
        _load(variant(small, tmp_path, extra, description | {orphan: "W8A8_DYNAMIC"}), model)


def test_int8_weight_described_as_float_is_refused(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    desc = description | {WQ_A: "FLOAT"}
    with pytest.raises(CheckpointError, match=rf"2 unexpected tensors: {WQ_A}_offset, {WQ_A}_scale"):
        _load(variant(small, tmp_path / "a", tensors, desc), model)
    alone = {n: t for n, t in tensors.items() if not n.startswith(WQ_A + "_")}
    with pytest.raises(CheckpointError, match=rf"{WQ_A}: unexpected dtype I8"):
        _load(variant(small, tmp_path / "b", alone, desc), model)


def test_float_weight_described_as_int8_is_refused(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    bad = tensors | {WQ_A: tensors[WQ_A].float()}
    with pytest.raises(CheckpointError, match=rf"{WQ_A}: W8A8_DYNAMIC weight of dtype F32, expected I8"):
        _load(variant(small, tmp_path, bad, description), model)


def test_experts_of_one_layer_must_share_a_format(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    name = "layers.2.ffn.experts.1.w3.weight"
    base = name.removesuffix(".weight")
    q = tensors[name]
    bad = {n: t for n, t in tensors.items() if not n.startswith(base + ".weight_")}
    bad[name] = q.float() * tensors[base + ".weight_scale"]
    with pytest.raises(
        CheckpointError, match=r"experts mix W8A8_DYNAMIC and FLOAT: layers\.2\.ffn\.experts\.w1/w3"
    ):
        _load(variant(small, tmp_path, bad, description | {name: "FLOAT"}), model)


def test_gate_and_up_experts_must_share_a_format(
    small: Path, model: DeepseekV4Config, tensors: dict, description: dict, tmp_path: Path
) -> None:
    """Every w3 float, every w1 int8: each projection is uniform, but gate and up load into one buffer."""
    bad, floats = dict(tensors), {}
    for name in [n for n in tensors if re.fullmatch(r"layers\.2\.ffn\.experts\.\d+\.w3\.weight", n)]:
        base = name.removesuffix(".weight")
        bad[name] = tensors[name].float() * tensors[base + ".weight_scale"]
        for suffix in (".weight_scale", ".weight_offset"):
            bad.pop(base + suffix, None)
        floats[name] = "FLOAT"
    assert floats
    with pytest.raises(CheckpointError, match=r"experts mix .*layers\.2\.ffn\.experts\.w1/w3"):
        _load(variant(small, tmp_path, bad, description | floats), model)


def test_malformed_description_is_named(
    small: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    src = variant(small, tmp_path, tensors, {})
    (src / DESCRIPTION).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=DESCRIPTION):
        _load(src, model)
