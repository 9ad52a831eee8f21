"""`python -m dsv4serve quantize`: round trips in both int8 layouts, and int8 accuracy on tiny models."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from golden_harness import engine_traces
from safetensors import safe_open
from test_formats import ENGINE, SEED, VOCAB, official_pair

from dsv4serve import cli
from dsv4serve.layers.linear import Int8Weight, quantize_int8
from dsv4serve.models.deepseek_v4.tiny import make_tiny
from dsv4serve.models.registry import config_from_dir
from tests.checkpoints import load_checkpoint

MS, CT = "w8a8-msmodelslim", "w8a8-compressed-tensors"
SHARD_MIB = "0.05"  # ~50 KiB: the small model splits into several shards


def quantize(src: Path, out: Path, fmt: str, *extra: str) -> Path:
    assert (
        cli.main(["quantize", str(src), str(out), "--format", fmt, "--max-shard-mib", SHARD_MIB, *extra]) == 0
    )
    return out


def ct_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' documented rounding, in fp32: scale = absmax / 127.5, q in [-128, 127]."""
    scale = w.float().abs().amax(dim=1) / 127.5
    return torch.round(w.float() / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("quantize-float"), seed=SEED, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def floats(small: Path) -> dict[str, Any]:
    return load_checkpoint(small, config_from_dir(small), dtype=torch.float32)


def _file_names(out: Path) -> dict[str, str]:
    names = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names |= {k: handle.get_slice(k).get_dtype() for k in handle.keys()}  # noqa: SIM118
    return names


def test_msmodelslim_round_trip(small: Path, floats: dict, tmp_path: Path) -> None:
    out = quantize(small, tmp_path / "ms", MS)
    index = json.loads((out / "quant_model_weights.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(s.startswith("quant_model_weights-000") for s in shards)
    assert {p.name for p in out.glob("*.safetensors")} == set(shards)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (small / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    description = json.loads((out / "quant_model_description.json").read_text())
    assert description["model_quant_type"] == "W8A8_DYNAMIC"
    on_disk = _file_names(out)
    assert set(on_disk) == set(index["weight_map"]) and set(on_disk) <= set(description)
    assert (
        on_disk["layers.2.ffn.experts.3.w1.weight"] == "I8" and on_disk["layers.2.attn.wo_b.weight"] == "F32"
    )
    assert description["layers.2.ffn.experts.3.w1.weight_offset"] == "W8A8_DYNAMIC"
    got = load_checkpoint(out, config_from_dir(out), dtype=torch.float32)
    assert got.keys() == floats.keys()
    for name, w in got.items():
        if isinstance(w, Int8Weight):
            q = quantize_int8(floats[name])  # absmax / 127, as msModelSlim's W8A8_DYNAMIC
            assert torch.equal(w.qweight, q.qweight) and torch.equal(w.scale, q.scale), name
        else:
            assert torch.equal(w, floats[name]), name
    assert isinstance(got["layers.1.attn.wq_a.weight"], Int8Weight)
    assert not isinstance(got["layers.1.attn.wo_b.weight"], Int8Weight)  # the recipe keeps wo_b float


def test_compressed_tensors_round_trip(small: Path, floats: dict, tmp_path: Path) -> None:
    out = quantize(small, tmp_path / "ct", CT, "--dtype", "bfloat16")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "int-quantized"
    assert quant["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert config["torch_dtype"] == "bfloat16"
    on_disk = _file_names(out)
    assert not any(n.endswith(("_offset", "zero_point")) for n in on_disk)  # symmetric: none on disk
    assert on_disk["layers.0.attn.wo_b.weight_scale"] == "F32" and on_disk["head.weight"] == "BF16"
    assert on_disk["hc_head_fn"] == "F32"  # kept fp32, as the official checkpoints do
    got = load_checkpoint(out, config_from_dir(out), dtype=torch.float32)
    int8 = {n for n, w in got.items() if isinstance(w, Int8Weight)}
    assert "layers.0.attn.wo_b.weight" in int8 and "layers.3.ffn.experts.w2" in int8
    for name, w in got.items():
        if isinstance(w, Int8Weight):
            q, s = ct_int8(floats[name]) if w.qweight.dim() == 2 else _stacked_ct(floats[name])
            assert torch.equal(w.qweight, q) and torch.equal(w.scale, s), name
        else:
            fp32 = name.startswith("hc_") or ".hc_" in name or name.endswith(("sink", ".ape", "gate.bias"))
            kept = fp32 or name.endswith("tid2eid")
            assert torch.equal(w, floats[name] if kept else floats[name].bfloat16().float()), name


def _stacked_ct(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [ct_int8(e) for e in w]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def test_quantize_reads_official_mxfp4_and_fp8(small: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config = json.loads((small / "config.json").read_text())
    mx, twin = official_pair(small, load_file(str(small / "model.safetensors")), config, tmp_path)
    a, b = (quantize(src, tmp_path / name, CT) for src, name in ((mx, "a"), (twin, "b")))
    a, b = (load_checkpoint(p, config_from_dir(p), dtype=torch.float32) for p in (a, b))
    assert a.keys() == b.keys()
    for name, w in a.items():
        ref = b[name]
        if isinstance(w, Int8Weight):
            assert isinstance(ref, Int8Weight)
            assert torch.equal(w.qweight, ref.qweight) and torch.equal(w.scale, ref.scale), name
        else:
            assert isinstance(ref, torch.Tensor) and torch.equal(w, ref), name
    assert "expert_dtype" not in json.loads((tmp_path / "a" / "config.json").read_text())


def test_int8_input_converts_between_layouts_losslessly(small: Path, tmp_path: Path) -> None:
    ms = quantize(small, tmp_path / "ms", MS)
    ct = quantize(ms, tmp_path / "ct", CT)
    back = quantize(ct, tmp_path / "back", MS)
    first, mid, last = (load_checkpoint(p, config_from_dir(p), dtype=torch.float32) for p in (ms, ct, back))
    for name, w in first.items():
        for other in (mid[name], last[name]):
            if isinstance(w, Int8Weight):
                assert isinstance(other, Int8Weight)
                assert torch.equal(w.qweight, other.qweight) and torch.equal(w.scale, other.scale), name
            elif name.endswith("attn.wo_b.weight"):  # float in msModelSlim, quantized by the CT step
                assert isinstance(last[name], Int8Weight)
                break
            else:
                assert isinstance(other, torch.Tensor) and torch.equal(w, other), name


def test_quantize_refuses_a_non_empty_output_and_bad_formats(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert cli.main(["quantize", str(small), str(tmp_path / "full"), "--format", MS]) == 2  # a user error
    assert "exists and is not empty" in capsys.readouterr().err
    assert cli.main(["quantize", str(small), str(tmp_path / "o"), "--format", "int4"]) == 2
    assert "--format" in capsys.readouterr().err
    assert cli.main(["quantize", str(tmp_path / "missing"), str(tmp_path / "o"), "--format", MS]) == 2


# ------------------------------------------------------------------------------------ accuracy


def logit_metrics(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    """Mean KL(ref || got) in nats, top-1 agreement and max |logit diff| over positions."""
    a, b = torch.stack(ref).double(), torch.stack(got).double()  # (positions, vocab)
    kl = (a.log_softmax(-1).exp() * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1)
    return {
        "kl": float(kl.mean()),
        "top1": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
        "max_abs": float((a - b).abs().max()),
    }


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 129000) for _ in range(n)] for n in (9, 33, 70)]


def _prompt_logits(model_dir: Path, **engine: Any) -> list[torch.Tensor]:
    """Logits at every prompt position (teacher-forced: the same inputs for every checkpoint)."""
    traces = engine_traces(model_dir, _prompts(), 1, ENGINE.with_(**engine))
    return [row for t, p in zip(traces, _prompts(), strict=True) for row in t.logits[: len(p)]]


def test_int8_accuracy_against_float(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`make_tiny(seed=0)` (hidden 64, 5 layers, 8 experts, vocab 129280) quantized by `quantize`,
    against its float logits at 112 prompt positions (benchmarks/RESULTS.md, "Quantized checkpoints
    against the float model")."""
    ref = _prompt_logits(tiny_model_dir)
    figures = {
        fmt: logit_metrics(
            ref, _prompt_logits(quantize(tiny_model_dir, tmp_path / fmt, fmt, "--max-shard-mib", "64"))
        )
        for fmt in (MS, CT)
    }
    # Measured (CPU, fp32): msModelSlim kl 0.054, top-1 0.920, max |diff| 7.18; compressed-tensors
    # kl 0.040, top-1 0.884, max |diff| 6.96 (logits ~ N(0, 4^2)). A transposed or mis-scaled weight
    # gives kl > 1 and top-1 near 0.
    for fmt, m in figures.items():
        assert 0 < m["kl"] < 0.1 and m["top1"] >= 0.85 and 0 < m["max_abs"] < 10, (fmt, m)


def test_mxfp4_int8_requantization_accuracy(small: Path, tmp_path: Path) -> None:
    """`--fp4-experts int8` against the exact dequantization (`make_tiny(seed=6, vocab_size=1024)`
    with random MXFP4 experts), 80 prompt positions."""
    from safetensors.torch import load_file

    config = json.loads((small / "config.json").read_text())
    mx, twin = official_pair(small, load_file(str(small / "model.safetensors")), config, tmp_path)
    prompts = [[random.Random(i).randrange(2, VOCAB) for _ in range(40)] for i in range(2)]
    ref = engine_traces(twin, prompts, 1, ENGINE)
    got = engine_traces(mx, prompts, 1, ENGINE.with_(fp4_experts="int8"))
    m = logit_metrics([r for t in ref for r in t.logits[:40]], [r for t in got for r in t.logits[:40]])
    # Measured (CPU, fp32): kl 0.0093, top-1 0.925, max |diff| 2.36 over 80 prompt positions.
    assert 0 < m["kl"] < 0.03 and m["top1"] >= 0.85 and 0 < m["max_abs"] < 5, m


def checkpoint_bytes(path: Path, dtype: torch.dtype) -> int:
    """A checkpoint's tensor bytes, its float tensors counted in `dtype` (those the engine holds in its
    compute dtype; FP8 values and e8m0 scales as stored); msModelSlim's weight offsets (zero in its
    symmetric W8A8, which the loader checks) are not counted: nothing holds them."""
    total, wide = 0, torch.empty(0, dtype=dtype).element_size()
    packed = (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                t = handle.get_tensor(name)
                if name.endswith(".weight_offset"):
                    continue
                floating = t.is_floating_point() and t.dtype not in packed
                total += t.numel() * wide if floating else t.nbytes
    return total


@pytest.mark.parametrize("fmt", [MS, CT])
def test_resident_weight_bytes_match_the_checkpoint(fmt: str, small: Path, tmp_path: Path) -> None:
    """The engine holds an int8 checkpoint's projections as int8 with their channel scales, so the bytes
    it reports resident (`stats().weight_bytes`, what `plan` and the `loaded` line print) are within 1%
    of the checkpoint's tensor bytes. (Official checkpoints: MXFP4 experts and FP8 linears are held as
    stored, tests/test_formats.py; their grouped `wo_a` is still held dequantized.)"""
    from dsv4serve import Engine

    path = quantize(small, tmp_path / "q", fmt)
    stored = checkpoint_bytes(path, torch.float32)
    with Engine(path, dtype="float32", page_size=8, max_total_tokens=256) as engine:
        held = engine.stats().weight_bytes
    assert "int8" in held and abs(sum(held.values()) - stored) <= 0.01 * stored, (held, stored)
