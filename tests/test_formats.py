"""Official MXFP4 routed experts and compressed-tensors W8A8 int8 checkpoints.

Each checkpoint is written here from the documented layouts (DeepSeek-V4's official checkpoint:
MXFP4 experts, FP8 blocks; compressed-tensors' int-quantized format): the packed bytes, scales and
config are built by this file's own code from the spec, not by the code that reads them.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from golden_harness import engine_traces
from safetensors.torch import load_file, save_file

from dsv4serve import Engine, SamplingParams, cli
from dsv4serve.config import ConfigError, EngineConfig
from dsv4serve.layers.formats import E2M1_VALUES, dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4
from dsv4serve.layers.linear import Fp8BlockWeight, Int8Weight, Mxfp4Weight, quantize_int8, resident_bytes
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.deepseek_v4.tiny import make_tiny, tiny_config
from dsv4serve.models.registry import config_from_dir
from dsv4serve.models.spec import CheckpointError
from tests.checkpoints import expert_slot, int8_names, load_checkpoint
from tests.kernel_cases import on_device

ENGINE = EngineConfig(dtype="float32", page_size=8, max_num_seqs=4, max_total_tokens=1024)
SEED = 6
VOCAB = 1024
INT8 = int8_names(DeepseekV4Config.from_dict(tiny_config(vocab_size=VOCAB)))  # the W8A8 projections


# ------------------------------------------------------------------------------ spec helpers


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """OCP e2m1 from its bits (sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0)."""
    sign = torch.where(code & 8 != 0, -1.0, 1.0)
    exp, mant = (code >> 1) & 3, (code & 1).double()
    subnormal = mant * 0.5
    normal = torch.ldexp(1.0 + mant / 2, (exp - 1).int())
    return sign * torch.where(exp == 0, subnormal, normal)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) int8, element 2j in the low nibble and 2j+1 in the high one."""
    low, high = codes[:, 0::2].to(torch.int32), codes[:, 1::2].to(torch.int32)
    return (low | (high << 4)).to(torch.uint8).view(torch.int8)


def random_mxfp4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed weight, ue8m0 scale (N, K/32) and the float64 value they encode (std ~ 1/sqrt(K))."""
    codes = torch.randint(0, 16, (n, k), generator=gen)
    centre = 127 - round(torch.tensor(k).sqrt().log2().item()) - 2
    exps = torch.randint(centre - 1, centre + 2, (n, k // 32), generator=gen)
    value = e2m1_value(codes) * torch.exp2((exps - 127).double()).repeat_interleave(32, 1)
    return pack_e2m1(codes), exps.to(torch.uint8).view(torch.float8_e8m0fnu), value


def write_dir(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(src / name, dst / name)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("formats-float"), seed=SEED, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def config(small: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((small / "config.json").read_text())
    return data


@pytest.fixture(scope="module")
def tensors(small: Path) -> dict[str, torch.Tensor]:
    return load_file(str(small / "model.safetensors"))


@pytest.fixture(scope="module")
def model(small: Path) -> DeepseekV4Config:
    return config_from_dir(small)


# ---------------------------------------------------------------------------------- MXFP4


def test_quantize_mxfp4_rounds_to_the_nearest_value_of_its_block() -> None:
    """Per 32 weights: the smallest power-of-two scale that fits the block's largest magnitude in 6,
    each weight the nearest of the 16 e2m1 values times it; decoded values are a fixed point."""
    w = torch.randn(2, 16, 96, generator=torch.Generator().manual_seed(4)) * 0.05
    w[0, 0, :32] = 0.0  # an all-zero block
    packed, scale = quantize_mxfp4(w)
    assert (
        packed.shape == (2, 16, 48)
        and scale.shape == (2, 16, 3)
        and packed.dtype == scale.dtype == torch.uint8
    )
    got = torch.stack([dequantize_mxfp4(p, s, torch.float64) for p, s in zip(packed, scale, strict=True)])
    step = torch.exp2(scale.double() - 127).repeat_interleave(32, -1)  # each weight's scale
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    nearest = (w.double()[..., None] - grid * step[..., None]).abs().min(-1).values
    assert torch.equal((w.double() - got).abs(), nearest)  # the nearest representable value
    blocks = w.abs().reshape(2, 16, 3, 32).amax(-1).double()
    fits = blocks <= 6 * torch.exp2(scale.double() - 127)
    tighter = blocks > 3 * torch.exp2(scale.double() - 127)  # half the scale would not fit
    assert fits.all() and (tighter | (blocks == 0)).all()
    again = quantize_mxfp4(got.float())
    redone = torch.stack([dequantize_mxfp4(p, s, torch.float64) for p, s in zip(*again, strict=True)])
    assert torch.equal(redone, got)


def test_quantize_fp8_block_is_the_official_rounding() -> None:
    """The package's vectorized FP8 block quantizer (benchmarks build official weights with it) equals
    the loop written from the format here, on a shape with partial blocks."""
    from test_loader import quantize_fp8

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(5)) * 0.02
    q, s = quantize_fp8_block(w)
    want_q, want_s = quantize_fp8(w)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(
        s, want_s.view(torch.uint8)
    )


def test_dequantize_mxfp4_follows_the_bit_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    packed, scale, value = random_mxfp4(24, 96, gen)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float64), value)
    scale = scale.view(torch.uint8).clone()
    scale[0, 0], scale[1, 2] = 0, 254  # 2^-127 and 2^127: the ends of the ue8m0 range
    codes = torch.stack((packed.view(torch.uint8) & 15, packed.view(torch.uint8) >> 4), -1).reshape(24, 96)
    want = e2m1_value(codes.int()) * torch.exp2((scale.int() - 127).double()).repeat_interleave(32, 1)
    for s in (scale, scale.view(torch.float8_e8m0fnu)):
        assert torch.equal(dequantize_mxfp4(packed, s, torch.float32), want.float())
        assert torch.equal(dequantize_mxfp4(packed.view(torch.uint8), s, torch.float32), want.float())
    # every value of the format is exact in bf16 (2 significant bits, fp32's exponent range)
    mid = scale.clamp(100, 150)
    assert torch.equal(
        dequantize_mxfp4(packed, mid, torch.bfloat16).float(), dequantize_mxfp4(packed, mid, torch.float32)
    )
    # one known byte: 0x9F = high nibble 9 (-0.5), low nibble 15 (-6): elements (-6, -0.5) * 2^1
    one = dequantize_mxfp4(
        torch.tensor([[0x9F] + [0] * 15], dtype=torch.uint8),
        torch.tensor([[128]], dtype=torch.uint8),
        torch.float32,
    )
    assert one[0, :2].tolist() == [-12.0, -1.0] and not one[0, 2:].any()
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_mxfp4(packed, scale[:, :2], torch.float32)


def official_pair(
    small: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], root: Path
) -> tuple[Path, Path]:
    """An official-layout twin pair: MXFP4 routed experts plus FP8 (e4m3, 128x128 ue8m0) shared
    experts and attention, and a float checkpoint holding exactly the values they encode."""
    from test_loader import quantize_fp8

    gen = torch.Generator().manual_seed(11)
    packed, floats = dict(tensors), dict(tensors)
    for name, t in tensors.items():
        base = name.removesuffix(".weight")
        if expert_slot(name):
            packed[name], packed[base + ".scale"], value = random_mxfp4(*t.shape, gen)
            floats[name] = value.float()
        elif ".shared_experts." in name or name.endswith(("attn.wq_a.weight", "attn.wo_a.weight")):
            packed[name], packed[base + ".scale"] = quantize_fp8(t)
            floats[name] = packed[name].float() * packed[base + ".scale"].float()
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    official = config | {"expert_dtype": "fp4", "quantization_config": fp8}
    return write_dir(small, root / "mxfp4", packed, official), write_dir(
        small, root / "float", floats, config
    )


@pytest.fixture(scope="module")
def official(
    small: Path, tensors: dict, config: dict, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    return official_pair(small, tensors, config, tmp_path_factory.mktemp("official"))


def test_mxfp4_experts_load_exactly_as_their_float_twin(
    official: tuple[Path, Path], model: DeepseekV4Config
) -> None:
    mx, twin = official
    got = load_checkpoint(mx, model, dtype=torch.float32)
    want = load_checkpoint(twin, model, dtype=torch.float32)
    assert got.keys() == want.keys()
    for name, w in got.items():
        assert isinstance(w, torch.Tensor) and torch.equal(w, want[name]), name
    bf16 = load_checkpoint(mx, model, dtype=torch.bfloat16)["layers.3.ffn.experts.w2"]
    assert isinstance(bf16, torch.Tensor) and bf16.dtype == torch.bfloat16
    assert torch.equal(bf16.float(), got["layers.3.ffn.experts.w2"])  # exact in bf16 too


def test_mxfp4_experts_requantized_to_int8(official: tuple[Path, Path], model: DeepseekV4Config) -> None:
    mx, twin = official
    got = load_checkpoint(mx, model, dtype=torch.float32, fp4_experts="int8")
    want = load_checkpoint(twin, model, dtype=torch.float32)
    for name, w in got.items():
        ref = want[name]
        assert isinstance(ref, torch.Tensor)
        if ".ffn.experts." in name:
            assert isinstance(w, Int8Weight), name
            q = quantize_int8(ref)
            assert torch.equal(w.qweight, q.qweight) and torch.equal(w.scale, q.scale), name
        else:
            assert isinstance(w, torch.Tensor) and torch.equal(w, ref), name


def test_fp8_linears_stay_fp8(official: tuple[Path, Path], model: DeepseekV4Config) -> None:
    """`fp8_linears="fp8"`: the FP8 projections the model takes through `linear` stay e4m3 with their
    block scales (a byte a weight), decoding to the float twin exactly; FP8 tensors the model uses
    otherwise, and everything else, load as before."""
    mx, twin = official
    got = load_checkpoint(mx, model, dtype=torch.bfloat16, fp8_linears="fp8")
    want = load_checkpoint(twin, model, dtype=torch.float32)
    stored = load_file(str(mx / "model.safetensors"))
    kept = {n for n, w in got.items() if isinstance(w, Fp8BlockWeight)}
    assert kept and all(stored[n].dtype == torch.float8_e4m3fn for n in kept)
    assert all(".ffn.experts." not in n for n in kept)
    for name in kept:
        w = got[name]
        assert isinstance(w, Fp8BlockWeight) and torch.equal(
            w.qweight.view(torch.uint8), stored[name].view(torch.uint8)
        )
        assert torch.equal(w.dequantized(torch.float32), want[name]), name
    assert resident_bytes(got)["fp8"] == sum(got[n].qweight.numel() + 4 * got[n].scale.numel() for n in kept)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="fp8_linears"):
        load_checkpoint(mx, model, dtype=torch.bfloat16, fp8_linears="int4")


def test_mxfp4_experts_stay_packed(official: tuple[Path, Path], model: DeepseekV4Config) -> None:
    """`fp4_experts="mxfp4"`: each layer's routed experts resident as the checkpoint stores them (the
    same bytes, a quarter of bf16's), decoding to the float twin exactly; everything else as before."""
    mx, twin = official
    got = load_checkpoint(mx, model, dtype=torch.bfloat16, fp4_experts="mxfp4")
    want = load_checkpoint(twin, model, dtype=torch.float32)
    stored = load_file(str(mx / "model.safetensors"))
    packed_bytes = sum(
        t.numel() * t.element_size()
        for n, t in stored.items()
        if expert_slot(n) or (n.endswith(".scale") and expert_slot(n.removesuffix(".scale") + ".weight"))
    )
    resident = 0
    for name, w in got.items():
        if ".ffn.experts." in name:
            assert isinstance(w, Mxfp4Weight) and w.shape == want[name].shape, name
            assert torch.equal(w.dequantized(torch.float32), want[name]), name
            resident += w.packed.numel() + w.scale.numel()
        else:
            assert isinstance(w, torch.Tensor), name
            assert torch.equal(w.float(), want[name].to(w.dtype).float()), name
    assert resident == packed_bytes > 0 and resident_bytes(got)["mxfp4"] == packed_bytes
    with Engine(mx, dtype="bfloat16", page_size=8, max_total_tokens=256, fp4_experts="mxfp4") as engine:
        held = engine.stats().weight_bytes  # what the engine reports: the experts' bytes as stored
    assert held["mxfp4"] == packed_bytes and set(held) == {"bfloat16", "float32", "int64", "mxfp4"}, held


def _prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (7, 40)]


@pytest.mark.parametrize("fp4_experts", ["float", "mxfp4"])
def test_engine_on_mxfp4_equals_its_float_twin(official: tuple[Path, Path], fp4_experts: str) -> None:
    """Decoded at load (float) or kept as stored and decoded per call (mxfp4 experts, W4A16): the same
    greedy tokens and every logit equal the float twin's (fp32; the format's values are exact in fp32,
    and decoding per call is the same arithmetic as at load)."""
    mx, twin = official
    want = engine_traces(twin, _prompts(), 4, ENGINE)
    got = engine_traces(mx, _prompts(), 4, ENGINE.with_(fp4_experts=fp4_experts))
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        assert all(torch.equal(a, b) for a, b in zip(g.logits, w.logits, strict=True))


def next_token_agreement(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    """Mean KL(want || got) of the next-token distributions, top-1 agreement, max |logit diff|."""
    g, w = torch.stack(got).double(), torch.stack(want).double()
    kl = (w.softmax(-1) * (w.log_softmax(-1) - g.log_softmax(-1))).sum(-1)
    return {
        "mean_kl": float(kl.mean()),
        "top1": float((g.argmax(-1) == w.argmax(-1)).double().mean()),
        "max_abs_diff": float((g - w).abs().max()),
        "rel_rms": float((g - w).pow(2).mean().sqrt() / (w - w.mean(-1, keepdim=True)).pow(2).mean().sqrt()),
    }


def test_fp8_linears_w8a8_stay_within_e4m3_error(official: tuple[Path, Path]) -> None:
    """Official FP8 linears kept e4m3 (`fp8_linears="fp8"`, with MXFP4 experts) compute W8A8, as
    DeepSeek's own inference does: their activations are rounded to e4m3 (3 mantissa bits: up to 2^-4
    relative per value, ~2% rms), so logits move against the float twin (the same weights, activations
    unrounded). This tiny random model compounds that over its layers' chained FP8 projections and its
    discrete choices (routing, the indexer's top-k): first-token distributions of 64 random prompts
    (fp32) measured mean KL 0.044, top-1 agreement 0.89, max |logit diff| 6.6, rms diff 0.11 of the
    logits' rms (std ~4). The bounds sit about twice above that; the kernels' agreement with this
    reference is checked bit-tight in tests/test_kernels_linear.py."""
    mx, twin = official
    rng = random.Random(9)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 48))] for _ in range(64)]
    engine = ENGINE.with_(max_num_seqs=64, max_total_tokens=4096)
    want = engine_traces(twin, prompts, 1, engine)
    got = engine_traces(mx, prompts, 1, engine.with_(fp4_experts="mxfp4", fp8_linears="fp8"))
    stats = next_token_agreement([t.logits[0] for t in got], [t.logits[0] for t in want])
    assert stats["max_abs_diff"] > 0  # the activations are quantized: not the float twin's arithmetic
    assert stats["mean_kl"] < 0.1 and stats["top1"] >= 0.8 and stats["rel_rms"] < 0.2, stats


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t, n: t | {n: t[n][:, :-1].contiguous()},
            r"layers\.2\.ffn\.experts\.5\.w1\.weight \[32, 31\] \(expected packed \[32, 32\]\)",
        ),
        (
            lambda t, n: t | {n[:-7] + ".scale": t[n[:-7] + ".scale"][:, :1].contiguous()},
            r"experts\.5\.w1\.scale \[32, 1\] \(expected \[32, 2\]\)",
        ),
    ],
)
def test_misshaped_mxfp4_is_named(
    official: tuple[Path, Path],
    model: DeepseekV4Config,
    config: dict,
    small: Path,
    tmp_path: Path,
    change: Any,
    message: str,
) -> None:
    tensors = load_file(str(official[0] / "model.safetensors"))
    bad = change(tensors, "layers.2.ffn.experts.5.w1.weight")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(write_dir(small, tmp_path, bad, config), model, dtype=torch.float32)


def test_mxfp4_outside_routed_experts_is_refused(
    small: Path, tensors: dict, config: dict, model: DeepseekV4Config, tmp_path: Path
) -> None:
    name = "layers.1.ffn.shared_experts.w1.weight"
    packed, scale, _ = random_mxfp4(32, 64, torch.Generator().manual_seed(1))
    bad = tensors | {name: packed, name[:-7] + ".scale": scale}
    with pytest.raises(CheckpointError, match=rf"{name}: MXFP4 weights are read only for routed experts"):
        load_checkpoint(write_dir(small, tmp_path, bad, config), model, dtype=torch.float32)


# ------------------------------------------------------------------------- compressed-tensors


def ct_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric channel-wise int8 (minmax observer): scale = absmax / 127.5."""
    scale = w.double().abs().amax(dim=1, keepdim=True) / 127.5  # (out, 1)
    return torch.round(w.double() / scale).clamp(-128, 127).to(torch.int8), scale


FLOAT_ONLY = ("re:.*head$", "re:.*wo_a$", "re:.*compressor\\.", "re:.*weights_proj$", "re:.*ffn\\.gate$")
KEPT_FLOAT = "model.layers.0.attn.wq_b"  # ignored by exact module name: stays float


def ct_config(**group: Any) -> dict[str, Any]:
    scheme = {
        "targets": ["Linear"],
        "weights": {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "channel",
            "dynamic": False,
            "group_size": None,
            "block_structure": None,
            "actorder": None,
            "observer": "minmax",
        },
        "input_activations": {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        },
        "output_activations": None,
    } | group
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme},
        "ignore": [*FLOAT_ONLY, KEPT_FLOAT],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "version": "0.12.2",
    }


def ct_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The file: `model.`-prefixed names, int8 + bf16 [out, 1] scales for every takes-int8 projection
    except KEPT_FLOAT."""
    out, quantized = {}, set()
    for name, t in tensors.items():
        if name in INT8 and "model." + name != KEPT_FLOAT + ".weight":
            q, s = ct_quantize(t)
            out["model." + name], out["model." + name[:-7] + ".weight_scale"] = q, s.bfloat16()
            quantized.add(name)
        else:
            out["model." + name] = t
    return out, quantized


@pytest.fixture(scope="module")
def ct_dir(small: Path, tensors: dict, config: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    file, _ = ct_tensors(tensors)
    return write_dir(
        small, tmp_path_factory.mktemp("ct"), file, config | {"quantization_config": ct_config()}
    )


def test_compressed_tensors_loads_as_int8(ct_dir: Path, tensors: dict, model: DeepseekV4Config) -> None:
    file, quantized = ct_tensors(tensors)
    got = load_checkpoint(ct_dir, config_from_dir(ct_dir), dtype=torch.float32)
    int8 = set()
    for name, w in got.items():
        if isinstance(w, Int8Weight):
            int8.add(name)
            if ".ffn.experts." in name:  # stacked: check every expert
                for e in range(model.n_routed_experts):
                    src = f"model.{name.replace('experts.', f'experts.{e}.')}"
                    assert torch.equal(w.qweight[e], file[src + ".weight"]), src
                    assert torch.equal(w.scale[e], file[src + ".weight_scale"].float().flatten()), src
            else:
                base = "model." + name.removesuffix(".weight")
                assert torch.equal(w.qweight, file[base + ".weight"]), name
                assert torch.equal(w.scale, file[base + ".weight_scale"].float().flatten()), name
        else:
            assert torch.equal(w, file["model." + name].float()), name
    stacked = {expert_slot(n)[0] if expert_slot(n) else n for n in quantized}  # type: ignore[index]
    assert int8 == stacked and "layers.0.attn.wq_b.weight" not in int8
    assert {
        "layers.4.attn.wo_b.weight",
        "layers.1.attn.indexer.wq_b.weight",
        "layers.2.ffn.experts.w2",
    } <= int8


def test_engine_on_compressed_tensors_runs_its_int8(ct_dir: Path, small: Path) -> None:
    """Logits track the float model and differ from it (the int8 path really runs); accuracy
    bounds are in tests/test_quantize.py."""
    want = engine_traces(small, _prompts(), 3, ENGINE)
    got = engine_traces(ct_dir, _prompts(), 3, ENGINE)
    corr = []
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.logits[:7], w.logits[:7], strict=True):  # prompt positions
            assert not torch.equal(a, b)
            corr.append(float(torch.corrcoef(torch.stack([a, b]))[0, 1]))
    corr.sort()
    # a wrong scale or layout gives correlations near 0
    assert corr[len(corr) // 2] > 0.98 and corr[0] > 0.9, corr


def _ct_variant(
    small: Path, tmp_path: Path, tensors: dict, config: dict, quant: dict, file: dict | None = None
) -> None:
    file = file if file is not None else ct_tensors(tensors)[0]
    src = write_dir(small, tmp_path, file, config | {"quantization_config": quant})
    load_checkpoint(src, config_from_dir(src), dtype=torch.float32)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "weights",
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"},
            r"weights\.strategy: 'tensor'",
        ),
        (
            "weights",
            {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"},
            r"weights\.num_bits: 4",
        ),
        (
            "weights",
            {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"},
            r"weights\.symmetric: False",
        ),
        ("weights", {"num_bits": 8, "strategy": "group", "group_size": 128}, r"weights\.strategy: 'group'"),
        ("input_activations", None, r"weight-only int8 is not supported"),
        (
            "input_activations",
            {"num_bits": 8, "strategy": "tensor", "dynamic": False},
            r"input_activations\.strategy",
        ),
        ("targets", ["DeepseekV4Experts"], r"module class 'DeepseekV4Experts' is not understood"),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_named(
    small: Path, tensors: dict, config: dict, tmp_path: Path, field: str, value: Any, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        _ct_variant(small, tmp_path, tensors, config, ct_config(**{field: value}))


def test_unsupported_compressed_tensors_format_is_named(
    small: Path, tensors: dict, config: dict, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError, match=r"format 'pack-quantized' is not supported"):
        _ct_variant(small, tmp_path, tensors, config, ct_config() | {"format": "pack-quantized"})


def test_storage_disagreeing_with_targets_and_ignore_is_named(
    small: Path, tensors: dict, config: dict, tmp_path: Path
) -> None:
    quant = ct_config()
    # layer 1's wq_b is int8 on disk but ignored; layer 0's wq_b (no longer ignored) and layer 1's
    # wkv are float on disk but targeted: all three named
    quant["ignore"] = [*FLOAT_ONLY, "re:.*layers\\.1\\.attn\\.wq_b$"]
    file, _ = ct_tensors(tensors)
    file["model.layers.1.attn.wkv.weight"] = tensors["layers.1.attn.wkv.weight"]
    del file["model.layers.1.attn.wkv.weight_scale"]
    with pytest.raises(CheckpointError, match="disagrees with quantization_config") as err:
        _ct_variant(small, tmp_path, tensors, config, quant, file)
    assert "model.layers.1.attn.wq_b (int8, not quantized)" in str(err.value)
    assert "model.layers.0.attn.wq_b (float, quantized)" in str(err.value)
    assert "model.layers.1.attn.wkv (float, quantized)" in str(err.value)


def test_int8_on_a_float_only_projection_is_named(
    small: Path, tensors: dict, config: dict, tmp_path: Path
) -> None:
    quant = ct_config()
    quant["ignore"] = [p for p in quant["ignore"] if p != "re:.*wo_a$"]
    file, _ = ct_tensors(tensors)
    for layer in range(5):
        name = f"layers.{layer}.attn.wo_a.weight"
        q, s = ct_quantize(tensors[name])
        file["model." + name], file["model." + name[:-7] + ".weight_scale"] = q, s.float()
    with pytest.raises(CheckpointError, match=r"only in floating point: layers\.0\.attn\.wo_a\.weight"):
        _ct_variant(small, tmp_path, tensors, config, quant, file)


# ------------------------------------------------------------------------------ the engine knob


def test_fp4_experts_is_an_engine_and_cli_knob(
    official: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="fp4_experts: 'fp8' is not one of"):
        EngineConfig(fp4_experts="fp8")
    args = cli.build_parser().parse_args(
        ["generate", "--model", "m", "--prompt", "p", "--fp4-experts", "int8"]
    )
    assert cli._engine_knobs(args)["fp4_experts"] == "int8"
    assert cli.main(["generate", "--model", "m", "--prompt", "p", "--fp4-experts", "bf16"]) == 2
    assert "--fp4-experts" in capsys.readouterr().err
    mx, _ = official
    prompts = _prompts()
    want = engine_traces(mx, prompts, 5, ENGINE.with_(fp4_experts="int8"))
    with Engine(mx, dtype="float32", page_size=8, max_total_tokens=1024, fp4_experts="int8") as engine:
        got = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    for c, w in zip(got, want, strict=True):  # EOS (id 1) may end one early
        assert list(c.token_ids) == w.tokens[: len(c.token_ids)] and len(c.token_ids) > 0


def test_experts_mixing_formats_are_refused(
    official: tuple[Path, Path],
    small: Path,
    tensors: dict,
    config: dict,
    model: DeepseekV4Config,
    tmp_path: Path,
) -> None:
    mixed = load_file(str(official[0] / "model.safetensors"))
    name = "layers.3.ffn.experts.6.w2.weight"
    mixed[name] = tensors[name]
    del mixed[name[:-7] + ".scale"]
    src = write_dir(small, tmp_path / "mx", mixed, config)
    load_checkpoint(src, model, dtype=torch.float32)  # dequantized: all float, fine
    for kept in ("int8", "mxfp4"):  # one expert float among packed or int8 ones: refused, named
        with pytest.raises(
            CheckpointError, match=rf"{name}: experts of layers\.3\.ffn\.experts\.w2 mix formats"
        ):
            load_checkpoint(src, model, dtype=torch.float32, fp4_experts=kept)
    quant = ct_config()
    quant["ignore"].append("re:.*layers\\.3\\.ffn\\.experts\\.6\\.w2$")
    file, _ = ct_tensors(tensors)
    file["model." + name] = tensors[name]
    del file["model." + name[:-7] + ".weight_scale"]
    with pytest.raises(CheckpointError, match=r"experts mix .*layers\.3\.ffn\.experts\.w2"):
        _ct_variant(small, tmp_path / "ct", tensors, config, quant, file)


@pytest.mark.parametrize("backend", ["reference", "triton", "triton_one_launch"])
def test_grouped_wo_a_kept_fp8_is_a_w8a8_linear_per_group(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V4's grouped output projection kept FP8 (each group's 128 output rows whole blocks):
    each group is the W8A8 linear of its own input slice and rows, on the reference and the Triton
    kernels (on the test device: a launch per group, or one for all) alike; where a group's rows split
    blocks, the model decodes wo_a instead."""
    from types import SimpleNamespace

    from dsv4serve.backends.cuda import linear as triton_linear
    from dsv4serve.layers import linear as reference
    from dsv4serve.layers.formats import quantize_fp8_block
    from dsv4serve.models.deepseek_v4.attention import AttentionWeights, _grouped_output
    from dsv4serve.models.deepseek_v4.model import fp8_rows_or_plain

    gen = torch.Generator().manual_seed(4)
    G, R, inner, T = 2, 128, 256, 5
    q, s = quantize_fp8_block(torch.randn(G * R, inner, generator=gen) / inner**0.5)
    wo_a = Fp8BlockWeight(q, torch.exp2(s.float() - 127))
    wo_b = torch.randn(64, G * R, generator=gen) / (G * R) ** 0.5
    out = torch.randn(T, G * inner, generator=gen)
    dev = (lambda t: t) if backend == "reference" else on_device  # the kernels run on the test device
    on = Fp8BlockWeight(dev(q), dev(wo_a.scale))
    w = AttentionWeights(None, None, None, None, None, on, dev(wo_b), None, None, None)  # type: ignore[arg-type]
    cfg = SimpleNamespace(o_groups=G, o_lora_rank=R)
    monkeypatch.setattr(triton_linear, "GROUPED_FP8_LAUNCH", backend == "triton_one_launch")
    ops = (
        SimpleNamespace(linear=reference.linear, grouped_linear=reference.grouped_linear)
        if backend == "reference"
        else SimpleNamespace(linear=triton_linear.linear, grouped_linear=triton_linear.grouped_linear)
    )
    got = _grouped_output(dev(out), w, cfg, ops).cpu()  # type: ignore[arg-type]
    mixed = torch.cat(
        [
            reference.linear(out[:, g * inner : (g + 1) * inner], wo_a.rows(g * R, (g + 1) * R))
            for g in range(G)
        ],
        1,
    )
    torch.testing.assert_close(got, reference.linear(mixed, wo_b), atol=1e-5, rtol=1e-5)
    weights = {"embed.weight": torch.zeros(4, 4, dtype=torch.bfloat16), "wo_a": wo_a}
    assert fp8_rows_or_plain(weights, "wo_a", R) is wo_a
    decoded = fp8_rows_or_plain(weights, "wo_a", 64)  # 64-row groups split the 128-row blocks
    assert isinstance(decoded, torch.Tensor) and torch.equal(decoded, wo_a.dequantized(torch.bfloat16))


def test_ranks_hold_their_share_of_official_weights(
    official: tuple[Path, Path], model: DeepseekV4Config
) -> None:
    """Two expert-parallel ranks loading the official pair, MXFP4 experts kept packed: each rank's block
    of whole experts decodes to the float twin's same block, and two ranks serve the same greedy tokens
    as one. Without expert parallelism the tiny experts' intermediate (32) cannot split over two ranks
    on MXFP4's 32-column scale groups: refused, naming the tensor."""
    from dsv4serve.layers.parallel import Shard, ShardError

    mx, twin = official
    want = load_checkpoint(twin, model, dtype=torch.float32)
    for rank in range(2):
        got = load_checkpoint(mx, model, dtype=torch.float32, fp4_experts="mxfp4", shard=Shard(rank, 2))
        for name, w in got.items():
            if ".ffn.experts." in name:
                whole = want[name]
                assert isinstance(w, Mxfp4Weight) and isinstance(whole, torch.Tensor), name
                part = whole.shape[0] // 2
                assert torch.equal(w.dequantized(torch.float32), whole[rank * part : (rank + 1) * part]), name
    with pytest.raises(ShardError, match=r"experts\.0\.w2\.weight.*scale groups"):
        load_checkpoint(
            mx, model, dtype=torch.float32, fp4_experts="mxfp4", shard=Shard(0, 2, expert_parallel=False)
        )
    knobs = {"max_total_tokens": 512, "page_size": 8, "fp4_experts": "mxfp4"}
    params = SamplingParams(max_tokens=6, temperature=0)
    with Engine(mx, **knobs) as engine:
        one = [c.token_ids for c in engine.generate(_prompts(), params)]
    with Engine(mx, **knobs, tensor_parallel_size=2, expert_parallel_size=2) as engine:
        assert [c.token_ids for c in engine.generate(_prompts(), params)] == one
