"""`python -m dsv4serve quantize IN OUT --format ...`: a float or official checkpoint to W8A8 int8.

The input is anything `load_checkpoint` reads (bf16/fp32, official FP8 and MXFP4, or an int8 one,
whose int8 projections are copied as they are). Tensors stream through one at a time, so memory
holds one output shard plus one tensor. Output names are the official DeepSeek-V4 ones (as the
Ascend msModelSlim exports keep them); the projections the model takes as int8 (`takes_int8`) are
quantized symmetric per output channel, everything else is written in floating point (`dtype`,
fp32 where the official checkpoints keep fp32: mHC, sinks, ape, gate bias; tid2eid int64).

- `w8a8-msmodelslim`: `quant_model_description.json` (`W8A8_DYNAMIC` / `FLOAT` per tensor),
  `X.weight` int8 [out, in], `X.weight_scale` fp32 [out, 1] = absmax/127 and `X.weight_offset` zeros
  [out, 1], in `quant_model_weights[-0000N-of-0000M].safetensors` (+ `.index.json`); `config.json`
  without `quantization_config`. Like msModelSlim's DeepSeek-V4 recipe it keeps `wo_b` in float.
- `w8a8-compressed-tensors`: `config.json` with a compressed-tensors `quantization_config` (targets
  `Linear`, an `ignore` list naming the float projections), `X.weight` int8 and `X.weight_scale` fp32
  [out, 1] = absmax/127.5 with values clamped to [-128, 127] (compressed-tensors' own rounding), in
  `model[-0000N-of-0000M].safetensors` (+ `model.safetensors.index.json`).

Both drop `expert_dtype` from `config.json`; other top-level files (tokenizer, generation config)
are copied.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsv4serve.config import QUANTIZE_FORMATS
from dsv4serve.layers.linear import Fp8BlockWeight, Int8Weight, Mxfp4Weight, Weight, quantize_int8
from dsv4serve.models.formats import (
    CT_FORMAT,
    CT_LINEAR,
    CT_METHOD,
    CT_REGEX,
    CT_STATUS,
    QUANT_FLOAT,
    QUANT_W8A8_DYNAMIC,
    WEIGHT_OFFSET,
    WEIGHT_SCALE,
)
from dsv4serve.models.loader import DESCRIPTION_FILE, INDEX_FILE, MODELSLIM_INDEX_FILE, iter_weights
from dsv4serve.models.registry import config_from_dir, spec_for
from dsv4serve.models.spec import CheckpointError, ModelSpec, Schema

MSMODELSLIM, COMPRESSED_TENSORS = FORMATS = QUANTIZE_FORMATS
DEFAULT_MAX_SHARD_BYTES = 4 << 30
CT_INT8_MAX = 127.5  # compressed-tensors' symmetric int8 scale: absmax / (255 / 2)
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")
NOT_COPIED = ("config.json", DESCRIPTION_FILE)


def quantize_checkpoint(
    src: Path | str,
    dst: Path | str,
    fmt: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str | None = None,
) -> Path:
    """Write the W8A8 int8 checkpoint of `src` in format `fmt` to the new directory `dst`;
    `dtype` is that of the float tensors (default: the config's `torch_dtype`)."""
    if fmt not in FORMATS:
        raise ValueError(f"format: {fmt!r} is not one of {FORMATS}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: must be >= 1, got {max_shard_bytes}")
    source, out = Path(src), Path(dst)
    model = config_from_dir(source)
    spec = spec_for(model.model_type)
    schema = spec.schema(model)
    if not any(t.int8 for t in schema.values()):
        raise CheckpointError(f"{model.model_type}: no projection takes W8A8 int8, nothing to quantize")
    float_dtype = getattr(torch, dtype or model.torch_dtype)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    weights = iter_weights(source, spec, model, dtype=torch.float32)
    tensors = _quantized(weights, schema, spec, fmt, float_dtype)
    description: dict[str, Any] = {
        "model_quant_type": QUANT_W8A8_DYNAMIC,
        "version": "1.0.0",
        "group_size": 0,
    }
    stem = "quant_model_weights" if fmt == MSMODELSLIM else "model"
    files = _described(tensors, description, offsets=fmt == MSMODELSLIM)
    written = _write_shards(files, out, stem, max_shard_bytes)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config.pop("expert_dtype", None)
    config.pop("quantization_config", None)
    if fmt == MSMODELSLIM:
        _write_json(out / DESCRIPTION_FILE, description)
    else:
        config["quantization_config"] = compressed_tensors_quantization_config(schema)
    config["torch_dtype"] = str(float_dtype).removeprefix("torch.")
    _write_json(out / "config.json", config)
    _copy_other_files(source, out)
    assert written, "a checkpoint has tensors"
    return out


def compressed_tensors_quantization_config(schema: Schema) -> dict[str, Any]:
    """The `quantization_config` of a compressed-tensors W8A8 int8 checkpoint this module writes."""
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    inputs = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    group = {"targets": [CT_LINEAR], "weights": weights, "input_activations": inputs}
    return {
        "quant_method": CT_METHOD,
        "format": CT_FORMAT,
        "quantization_status": CT_STATUS,
        "config_groups": {"group_0": group | {"output_activations": None}},
        "ignore": ct_ignore(schema),
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def quantize_int8_ct(w: torch.Tensor) -> Int8Weight:
    """compressed-tensors' symmetric channel-wise int8: scale = absmax / 127.5, q clamped to [-128, 127]."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / CT_INT8_MAX  # (out,)
    q = torch.round(w.float() / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return Int8Weight(q, scale)


def ct_ignore(schema: Schema) -> list[str]:
    """The modules a compressed-tensors output keeps in float: every 2-D weight not stored int8, by
    name, or by one regex per name with its layer index as `\\d+`."""
    out: list[str] = []
    for name, spec in schema.items():
        if len(spec.shape) != 2 or spec.int8 or not name.endswith(".weight"):
            continue
        exact = re.escape(name.removesuffix(".weight"))
        generic = re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", exact)
        item = name.removesuffix(".weight") if generic == exact else f"{CT_REGEX}{generic}$"
        if item not in out:
            out.append(item)
    return out


def _quantized(
    weights: Iterator[tuple[str, Weight]], schema: Schema, spec: ModelSpec[Any], fmt: str, dtype: torch.dtype
) -> Iterator[tuple[str, Weight]]:
    """Each tensor as the format stores it: int8 projections as `Int8Weight`, the rest cast (fp32 and
    int64 where the official checkpoint keeps them so)."""
    keep_float = spec.msmodelslim_float if fmt == MSMODELSLIM else ()
    for name, value in weights:
        if isinstance(value, Mxfp4Weight | Fp8BlockWeight):  # kept formats: their exact float values
            value = value.dequantized(torch.float32)
        if isinstance(value, Int8Weight):  # an int8 input: kept (layouts differ only in companions)
            yield name, value
        elif schema[name].int8 and not name.endswith(keep_float):
            yield name, quantize_int8(value) if fmt == MSMODELSLIM else quantize_int8_ct(value)
        elif schema[name].disk in ("int64", "fp32"):
            yield name, value
        else:
            yield name, value.to(dtype)


def _described(
    weights: Iterator[tuple[str, Weight]], description: dict[str, Any], offsets: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The file tensors of each weight (int8 ones with their scale, and zero offsets if `offsets`);
    fills msModelSlim's `description` on the way (unused for compressed-tensors: symmetric, no zero
    points on disk)."""
    for name, value in weights:
        if isinstance(value, torch.Tensor):
            description[name] = QUANT_FLOAT
            yield name, value.contiguous()
            continue
        assert isinstance(value, Int8Weight), name  # `_quantized` decodes MXFP4
        base = name.removesuffix(".weight")
        scale = value.scale.float().reshape(-1, 1).contiguous()  # (out, 1)
        parts = {name: value.qweight.contiguous(), base + WEIGHT_SCALE: scale}
        if offsets:
            parts[base + WEIGHT_OFFSET] = torch.zeros_like(scale)
        description |= dict.fromkeys(parts, QUANT_W8A8_DYNAMIC)
        yield from parts.items()


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, stem: str, max_bytes: int) -> int:
    """Shards of at most `max_bytes` (one tensor may exceed it alone): `{stem}.safetensors` when one
    suffices, else `{stem}-0000N-of-0000M.safetensors` and `{stem}.safetensors.index.json`."""
    parts: list[Path] = []
    weight_map: dict[str, int] = {}
    group: dict[str, torch.Tensor] = {}
    size = total = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > max_bytes:
            parts.append(_flush(group, out, stem, len(parts)))
            group, size = {}, 0
        group[name], weight_map[name] = tensor, len(parts)
        size, total = size + nbytes, total + nbytes
    parts.append(_flush(group, out, stem, len(parts)))
    single = len(parts) == 1
    names = (
        [f"{stem}.safetensors"] if single else [_shard_name(stem, i, len(parts)) for i in range(len(parts))]
    )
    for part, name in zip(parts, names, strict=True):
        part.rename(out / name)
        (out / name).chmod(0o644)  # the temporary file was private
    if single:
        return 1
    index = {"metadata": {"total_size": total}, "weight_map": {n: names[i] for n, i in weight_map.items()}}
    index_file = MODELSLIM_INDEX_FILE if stem == "quant_model_weights" else INDEX_FILE
    _write_json(out / index_file, index)
    return len(parts)


def _shard_name(stem: str, i: int, count: int) -> str:
    return f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors"


def _flush(group: dict[str, torch.Tensor], out: Path, stem: str, number: int) -> Path:
    path = out / f".{stem}-part{number}.safetensors.tmp"
    save_file(group, str(path), metadata={"format": "pt"})
    return path


def _copy_other_files(src: Path, dst: Path) -> None:
    weights = {p for pattern in WEIGHT_FILES for p in src.glob(pattern)}
    for path in sorted(src.iterdir()):
        if path.is_file() and path not in weights and path.name not in NOT_COPIED:
            shutil.copyfile(path, dst / path.name)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
