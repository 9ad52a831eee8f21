"""The checkpoint loader: layouts, name checks, refusals, and the FP8 format step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsv4serve.layers.formats import decode_e8m0, dequantize_fp8_block
from dsv4serve.models.deepseek_v4 import SPEC
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.deepseek_v4.tiny import make_tiny
from dsv4serve.models.loader import storage_dtype
from dsv4serve.models.registry import config_from_dir
from dsv4serve.models.spec import CheckpointError
from dsv4serve.models.tiny import write_safetensors
from dsv4serve.moe.experts import gate_up_view
from tests.checkpoints import expected_tensors, load_checkpoint, loaded_tensors

FP32_NAMES = (
    "hc_head_fn",
    "layers.2.hc_attn_base",
    "layers.1.attn.attn_sink",
    "layers.1.attn.compressor.ape",
)
FP32_NAMES += (
    "layers.3.ffn.gate.bias",
    "norm.weight",
    "layers.0.attn.kv_norm.weight",
    "layers.1.attn.q_norm.weight",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=3, vocab_size=1024)


@pytest.fixture(scope="module")
def model(tiny: Path) -> DeepseekV4Config:
    return config_from_dir(tiny)


@pytest.fixture(scope="module")
def tensors(tiny: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny / "model.safetensors"))


def variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "config.json", dst / "config.json")
    write_safetensors(tensors, dst, shards)
    return dst


def test_loads_official_names_with_stacked_experts(
    tiny: Path, model: DeepseekV4Config, tensors: dict
) -> None:
    w = load_checkpoint(tiny, model, dtype=torch.bfloat16)
    assert {k: tuple(v.shape) for k, v in w.items()} == loaded_tensors(model)
    assert w["layers.0.ffn.experts.w1"].shape == (8, 32, 64) and w["layers.0.ffn.experts.w2"].shape == (
        8,
        64,
        32,
    )
    for e in (0, 5, 7):
        for proj in ("w1", "w2", "w3"):
            expected = tensors[f"layers.3.ffn.experts.{e}.{proj}.weight"].to(torch.bfloat16)
            assert torch.equal(w[f"layers.3.ffn.experts.{proj}"][e], expected)
    both = gate_up_view(w["layers.3.ffn.experts.w1"], w["layers.3.ffn.experts.w3"])
    assert both is not None  # gate and up stacked as one (E, 2I, H) buffer: one prefill GEMM
    assert torch.equal(both[5, 32:], tensors["layers.3.ffn.experts.5.w3.weight"].to(torch.bfloat16))
    assert w["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert torch.equal(w["embed.weight"], tensors["embed.weight"].to(torch.bfloat16))
    for name in FP32_NAMES:
        assert w[name].dtype == torch.float32 and torch.equal(w[name], tensors[name]), name
    assert w["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    schema = SPEC.schema(model)
    assert storage_dtype(schema["layers.0.ffn.gate.weight"], torch.bfloat16) == torch.bfloat16
    assert set(expected_tensors(model)) == set(tensors)


@pytest.mark.parametrize(("shards", "prefix"), [(3, ""), (1, "model."), (2, "model.")])
def test_sharded_and_prefixed_layouts_load_the_same(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path, shards: int, prefix: str
) -> None:
    src = variant(tiny, tmp_path, {prefix + k: v for k, v in tensors.items()}, shards)
    assert (src / "model.safetensors.index.json").is_file() == (shards > 1)
    reference = load_checkpoint(tiny, model, dtype=torch.float32)
    got = load_checkpoint(src, model, dtype=torch.float32)
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in got)


def test_mtp_tensors_are_skipped(tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path) -> None:
    extra = {"mtp.0.enorm.weight": torch.ones(64), "model.mtp.0.e_proj.weight": torch.ones(64, 64)}
    extra["mtp.0.e_proj.scale"] = torch.ones(1, 1)
    got = load_checkpoint(variant(tiny, tmp_path, tensors | extra), model, dtype=torch.float32)
    assert not [k for k in got if "mtp" in k]


def test_missing_tensor_is_named(tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path) -> None:
    src = variant(tiny, tmp_path, {k: v for k, v in tensors.items() if k != "layers.2.attn.compressor.ape"})
    with pytest.raises(CheckpointError, match=r"missing 1 tensors: layers\.2\.attn\.compressor\.ape"):
        load_checkpoint(src, model, dtype=torch.float32)


def test_many_missing_tensors_are_listed_briefly(tiny: Path, tensors: dict, tmp_path: Path) -> None:
    bigger = DeepseekV4Config.from_dict(
        json.loads((tiny / "config.json").read_text()) | {"n_routed_experts": 16}
    )
    with pytest.raises(CheckpointError, match=r"missing 120 tensors: .* and 110 more") as err:
        load_checkpoint(tiny, bigger, dtype=torch.float32)
    assert "layers.0.ffn.experts.8.w1.weight" in str(err.value)


def test_unexpected_tensor_is_named(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    extra = {
        "layers.0.attn.compressor.wkv.weight": torch.ones(128, 64),
        "layers.1.attn.wq_a.scale": torch.ones(1),
    }
    with pytest.raises(CheckpointError, match="unexpected") as err:
        load_checkpoint(variant(tiny, tmp_path, tensors | extra), model, dtype=torch.float32)
    assert "layers.0.attn.compressor.wkv.weight" in str(err.value)
    assert "layers.1.attn.wq_a.scale" not in str(err.value)  # a scale of an expected weight is consumed


def test_orphan_scale_is_unexpected(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    extra = {"layers.0.attn.bogus.scale": torch.ones(1, 1)}
    with pytest.raises(CheckpointError, match=r"unexpected tensors: layers\.0\.attn\.bogus\.scale"):
        load_checkpoint(variant(tiny, tmp_path, tensors | extra), model, dtype=torch.float32)


def test_misshaped_tensor_is_named(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    bad = tensors | {"layers.4.attn.wo_b.weight": torch.ones(64, 65)}
    with pytest.raises(
        CheckpointError, match=r"mis-shaped tensors: layers\.4\.attn\.wo_b\.weight \[64, 65\]"
    ):
        load_checkpoint(variant(tiny, tmp_path, bad), model, dtype=torch.float32)


def test_duplicate_names_across_prefixes_are_refused(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    dup = tensors | {"model.norm.weight": tensors["norm.weight"].clone()}
    with pytest.raises(CheckpointError, match=r"norm\.weight: present twice"):
        load_checkpoint(variant(tiny, tmp_path, dup), model, dtype=torch.float32)


@pytest.mark.parametrize("file", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickled_checkpoints_are_refused(
    tiny: Path, model: DeepseekV4Config, tmp_path: Path, file: str
) -> None:
    shutil.copyfile(tiny / "config.json", tmp_path / "config.json")
    (tmp_path / file).write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pickled checkpoints are refused") as err:
        load_checkpoint(tmp_path, model, dtype=torch.float32)
    assert file in str(err.value)


def test_empty_directory_and_missing_shard(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path, model, dtype=torch.float32)
    src = variant(tiny, tmp_path / "sharded", tensors, shards=2)
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors"):
        load_checkpoint(src, model, dtype=torch.float32)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_file_is_named(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path, damage: str
) -> None:
    src = variant(tiny, tmp_path, tensors, shards=2)
    shard = src / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x20" + data[1:])
    with pytest.raises(CheckpointError, match=f"{shard}: unreadable safetensors file"):
        load_checkpoint(src, model, dtype=torch.float32)


def test_tid2eid_out_of_range_is_refused(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    table = tensors["layers.1.ffn.gate.tid2eid"].clone()
    table[7, 1] = 8
    src = variant(tiny, tmp_path, tensors | {"layers.1.ffn.gate.tid2eid": table})
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.gate\.tid2eid: expert ids outside"):
        load_checkpoint(src, model, dtype=torch.float32)


# ------------------------------------------------------------------ quantized formats


def quantize_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block power-of-two scales (ue8m0), as the official FP8 checkpoints store them."""
    n, k = w.shape
    grid = torch.zeros((n + block - 1) // block, (k + block - 1) // block, dtype=torch.int32)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            blk = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            exp = int(torch.ceil(torch.log2(blk.abs().max().clamp(min=1e-4) / 448)))
            grid[i, j] = exp
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (blk / 2.0**exp).to(
                torch.float8_e4m3fn
            )
    return q, (grid + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def test_decode_e8m0() -> None:
    raw = torch.tensor([0, 1, 120, 127, 128, 254, 255], dtype=torch.uint8)
    got = decode_e8m0(raw.view(torch.float8_e8m0fnu))
    assert got[0] == 2.0**-127 and got[2] == 2.0**-7 and got[3] == 1 and got[4] == 2 and got[5] == 2.0**127
    assert torch.isnan(got[6])
    torch.testing.assert_close(decode_e8m0(raw), got, rtol=0, atol=0, equal_nan=True)


def test_dequantize_fp8_block_on_a_ragged_grid() -> None:
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(300, 260, generator=gen) * 100).to(torch.float8_e4m3fn)
    exps = torch.randint(-10, 10, (3, 3), generator=gen)
    scale = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    got = dequantize_fp8_block(q, scale, torch.float32)
    for n, k in [(0, 0), (127, 128), (128, 127), (299, 259), (256, 3), (5, 256)]:
        assert got[n, k] == float(q[n, k].float()) * 2.0 ** int(exps[n // 128, k // 128]), (n, k)
    fp32 = dequantize_fp8_block(q, 2.0 ** exps.float(), torch.float32)  # Base checkpoints: fp32 scales
    assert torch.equal(fp32, got)
    with pytest.raises(ValueError, match=r"scale shape \(3, 2\)"):
        dequantize_fp8_block(q, scale[:, :2], torch.float32)


def test_fp8_weights_are_dequantized_at_load(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    names = (
        "layers.0.attn.wq_b.weight",
        "layers.3.ffn.shared_experts.w2.weight",
        "layers.2.ffn.experts.1.w3.weight",
    )
    quantized = dict(tensors)
    expected = {}
    for name in names:
        q, s = quantize_fp8(tensors[name])
        quantized[name], quantized[name.removesuffix(".weight") + ".scale"] = q, s
        expected[name] = dequantize_fp8_block(q, s, torch.bfloat16)
        assert 0 < (expected[name].float() - tensors[name]).abs().max() < 0.1 * tensors[name].abs().max()
    got = load_checkpoint(variant(tiny, tmp_path, quantized), model, dtype=torch.bfloat16)
    assert torch.equal(got["layers.0.attn.wq_b.weight"], expected["layers.0.attn.wq_b.weight"])
    assert torch.equal(
        got["layers.3.ffn.shared_experts.w2.weight"], expected["layers.3.ffn.shared_experts.w2.weight"]
    )
    assert torch.equal(got["layers.2.ffn.experts.w3"][1], expected["layers.2.ffn.experts.1.w3.weight"])


def test_fp8_without_scale_is_refused(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    bad = tensors | {"layers.0.attn.wkv.weight": tensors["layers.0.attn.wkv.weight"].to(torch.float8_e4m3fn)}
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wkv\.weight: float8 tensor without"):
        load_checkpoint(variant(tiny, tmp_path, bad), model, dtype=torch.float32)


def test_mxfp4_experts_with_fp32_scales_are_refused(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    """MXFP4 experts load (tests/test_formats.py); their scales must be ue8m0."""
    name = "layers.2.ffn.experts.4.w1.weight"
    packed = {
        name: torch.zeros(32, 32, dtype=torch.int8),
        "layers.2.ffn.experts.4.w1.scale": torch.ones(32, 2),
    }
    with pytest.raises(CheckpointError, match=rf"{name}: MXFP4 scale of dtype F32"):
        load_checkpoint(variant(tiny, tmp_path, tensors | packed), model, dtype=torch.float32)


def test_int8_companions_without_a_quant_format_are_refused(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    """int8 companions without quant_model_description.json or a compressed-tensors config;
    those directories load (tests/test_loader_int8.py, tests/test_formats.py)."""
    extra = {"layers.0.attn.wq_a.weight_scale": torch.ones(32, 1)}
    with pytest.raises(CheckpointError, match=r"W8A8 .*msModelSlim.*layers\.0\.attn\.wq_a\.weight_scale"):
        load_checkpoint(variant(tiny, tmp_path / "a", tensors | extra), model, dtype=torch.float32)


def test_integer_tensor_without_scale_is_refused(
    tiny: Path, model: DeepseekV4Config, tensors: dict, tmp_path: Path
) -> None:
    bad = tensors | {"layers.0.attn.wq_a.weight": torch.zeros(32, 64, dtype=torch.int8)}
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight: unexpected dtype I8"):
        load_checkpoint(variant(tiny, tmp_path, bad), model, dtype=torch.float32)
