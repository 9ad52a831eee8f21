"""Load a safetensors checkpoint of any family against its schema, as a flat dict of weights.

`load_weights` reads one `model.safetensors`, or the shards listed by `model.safetensors.index.json`
(or every `*.safetensors` file). Names lose a leading `model.` and map through the family's
`CheckpointNames` (DeepSeek-V4 also reads transformers' names and stacked experts); tensors the family
skips (an MTP block) are dropped. Before any data is read the headers are checked against the schema:
missing, unexpected and mis-shaped tensors raise one `CheckpointError` naming them. Each tensor then
goes through the format step (`formats.py`: FP8 blocks dequantized with their `.scale`, MXFP4 experts
decoded, W8A8 int8 kept as `Int8Weight`), is cast to its storage dtype (fp32 where the schema keeps
fp32, int64 stays, else `dtype`) and moved to `device`; each layer's routed experts are stacked into
`<stem>.{w1,w3}` [E, I, H] (the two halves of one [E, 2I, H] buffer when float) and `<stem>.w2`
[E, H, I]. Pickled checkpoints are refused.

An msModelSlim directory (Ascend W8A8, marked by `quant_model_description.json`, tensors in
`quant_model_weights*.safetensors`, shards listed by `quant_model_weights.safetensors.index.json`)
names each tensor's quant type; a compressed-tensors one says it in its `quantization_config`. Official
MXFP4 routed experts are decoded (`fp4_experts="float"`, exact), decoded and re-quantized to
per-channel int8 (`fp4_experts="int8"`), or kept packed as `Mxfp4Weight` (`fp4_experts="mxfp4"`: a
quarter of bf16's bytes; the reference decodes per call, the CUDA backend's expert kernels in
registers). `iter_weights` yields the same values one tensor at a time,
experts unstacked (what `quantize` streams through).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dsv4serve.config import FP4_EXPERTS, FP8_LINEARS
from dsv4serve.layers.formats import FP8_BLOCK, decode_e8m0, dequantize_mxfp4
from dsv4serve.layers.linear import Fp8BlockWeight, Int8Weight, Mxfp4Weight, Weight, quantize_int8
from dsv4serve.layers.parallel import Shard
from dsv4serve.models.formats import (
    INT8_SUFFIXES,
    MAX_NAMES,
    QUANT_W8A8_DYNAMIC,
    SCALE_SUFFIX,
    WEIGHT_OFFSET,
    WEIGHT_SCALE,
    compressed_tensors_config,
    ct_int8_weights,
    dequantize_or_keep,
    int8_companions,
    int8_weight,
    is_mxfp4,
    listed,
    mxfp4_shape_errors,
)
from dsv4serve.models.progress import Progress, silent
from dsv4serve.models.spec import CheckpointError, CheckpointNames, ModelSpec, Schema, TensorSpec
from dsv4serve.moe.experts import stacked_gate_up

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DESCRIPTION_FILE = "quant_model_description.json"  # msModelSlim: tensor name -> quant type
MODELSLIM_INDEX_FILE = "quant_model_weights.safetensors.index.json"
PICKLE_GLOBS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")
INT_HEADER_DTYPES = ("I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL")
FLOAT_HEADER_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor as a file's header describes it."""

    file: Path
    key: str  # the name in the file (may carry the `model.` prefix)
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3"
    part: tuple[int, int, int] | None = None  # (expert, first row, end row) of a stacked experts tensor


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    weight: HeaderEntry
    scale: HeaderEntry | None  # `.scale` (FP8 blocks, MXFP4), or `.weight_scale` (W8A8 int8)
    offset: HeaderEntry | None = None  # `.weight_offset` of msModelSlim W8A8_DYNAMIC weights
    int8: bool = False  # a W8A8 int8 weight (msModelSlim or compressed-tensors)


@dataclass(frozen=True)
class Expected:
    """What a checkpoint of one family and config holds: its schema, names and quantization."""

    schema: Schema
    naming: CheckpointNames
    quantization: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, spec: ModelSpec[Any], cfg: Any) -> Expected:
        return cls(spec.schema(cfg), spec.names(cfg), getattr(cfg, "quantization", None))

    @property
    def block(self) -> tuple[int, int]:
        """FP8 weights' scale block (quantization_config.weight_block_size, else 128 x 128)."""
        block = (self.quantization or {}).get("weight_block_size", FP8_BLOCK)
        return (int(block[0]), int(block[1]))


def load_weights(
    model_dir: Path | str,
    spec: ModelSpec[Any],
    cfg: Any,
    *,
    dtype: torch.dtype,
    device: str = "cpu",
    fp4_experts: str = "float",
    fp8_linears: str = "float",
    progress: Progress[tuple[str, Any]] = silent,
    shard: Shard | None = None,
) -> dict[str, Weight]:
    """Every weight of the checkpoint by schema name (experts stacked), at its storage dtype, on
    `device`; int8 projections of a W8A8 checkpoint as `Int8Weight` (int8 + fp32 scale). `progress`
    wraps the tensors as they load (`progress.shown`: a bar or log lines). With a `shard` of a
    tensor-parallel group, each tensor is cut to the rank's share as it is read (`TensorSpec.split`;
    routed experts whole with expert parallelism): no rank holds more than one whole tensor at a time."""
    expected = Expected.of(spec, cfg)
    shard = shard or Shard()
    sizes = _stack_sizes(expected)
    held = sizes
    if shard.expert_parallel and (shard.expert_size or shard.size) > 1:
        held = {n: _count(shard.expert_span(e, f"{n}: routed experts")) for n, e in sizes.items()}
    out: dict[str, Weight] = {}
    for name, value in iter_weights(
        model_dir,
        spec,
        cfg,
        dtype=dtype,
        fp4_experts=fp4_experts,
        fp8_linears=fp8_linears,
        progress=progress,
        expected=expected,
    ):
        share = _share(name, value, expected, sizes, shard)
        if share is not None:
            _place(out, name, share[0], expected.naming, held, device, share[1])
    spec.check_weights(cfg, out)
    return out


def _count(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _share(
    name: str, value: Weight, expected: Expected, sizes: dict[str, int], shard: Shard
) -> tuple[Weight, int | None] | None:
    """The rank's share of a tensor, and a routed expert's index in the rank's stack; None when the
    tensor is another rank's (an expert of another rank's block)."""
    slot = expected.naming.expert(name)
    expert = None if slot is None else slot[1]
    if slot is not None and shard.expert_parallel and (shard.expert_size or shard.size) > 1:
        start, stop = shard.expert_span(sizes[slot[0]], f"{slot[0]}: routed experts")
        return (value, slot[1] - start) if start <= slot[1] < stop else None
    if shard.size == 1:
        return value, expert
    held = expected.schema[name]
    if held.split == "rows":
        return shard.rows(value, name, held.split_unit), expert
    if held.split == "cols":
        return shard.cols(value, name, held.split_unit), expert
    return value, expert


def iter_weights(
    model_dir: Path | str,
    spec: ModelSpec[Any],
    cfg: Any,
    *,
    dtype: torch.dtype,
    fp4_experts: str = "float",
    fp8_linears: str = "float",
    progress: Progress[tuple[str, Any]] = silent,
    expected: Expected | None = None,
) -> Iterator[tuple[str, Weight]]:
    """Each tensor of the schema (experts one by one, on the CPU), as `load_weights` reads it; the
    headers are checked before the first tensor is read."""
    if fp4_experts not in FP4_EXPERTS:
        raise ValueError(f"fp4_experts: {fp4_experts!r} is not one of {FP4_EXPERTS}")
    if fp8_linears not in FP8_LINEARS:
        raise ValueError(f"fp8_linears: {fp8_linears!r} is not one of {FP8_LINEARS}")
    expected = expected or Expected.of(spec, cfg)
    files = checkpoint_files(Path(model_dir))
    plan = plan_tensors(read_headers(files, expected.naming), expected, read_quant_types(Path(model_dir)))
    with ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in files}
        for name, item in progress(list(plan.items()), "weights"):
            raw = _read(handles, item.weight)
            scale = _read(handles, item.scale) if item.scale else None
            offset = _read(handles, item.offset) if item.offset else None
            kept = storage_dtype(expected.schema[name], dtype)
            # FP8 blocks kept as stored: the projections (those a W8A8 checkpoint may quantize, and
            # DeepSeek-V4's grouped wo_a), not experts, in the official 128 x 128 blocks
            held = expected.schema[name]
            fp8 = fp8_linears == "fp8" and (held.int8 or held.linear) and tuple(expected.block) == FP8_BLOCK
            fp8 = fp8 and expected.naming.expert(name) is None
            yield name, _value(name, item, raw, scale, offset, kept, expected.block, fp4_experts, fp8)


def storage_dtype(spec: TensorSpec, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is kept in: int64 stays, fp32 where the schema says, else `dtype`."""
    if spec.disk == "int64":
        return torch.int64
    return torch.float32 if spec.fp32 else dtype


def loaded_schema(schema: Schema, naming: CheckpointNames) -> Schema:
    """The tensors `load_weights` returns: each layer's routed experts stacked, [E, ...]."""
    out: Schema = {}
    for name, spec in schema.items():
        slot = naming.expert(name)
        if slot is None:
            out[name] = spec
        else:
            stacked = out.get(slot[0])
            count = stacked.shape[0] + 1 if stacked is not None else 1
            out[slot[0]] = replace(spec, shape=(count, *spec.shape))
    return out


def _stack_sizes(expected: Expected) -> dict[str, int]:
    return {
        n: s.shape[0]
        for n, s in loaded_schema(expected.schema, expected.naming).items()
        if n not in expected.schema
    }


def _value(
    name: str,
    item: PlannedTensor,
    raw: torch.Tensor,
    scale: torch.Tensor | None,
    offset: torch.Tensor | None,
    dtype: torch.dtype,
    block: tuple[int, int],
    fp4_experts: str,
    fp8_native: bool = False,
) -> Weight:
    if item.int8:
        assert scale is not None
        return int8_weight(name, raw, scale, offset)
    if scale is not None and is_mxfp4(name, item.weight.dtype):
        try:
            if fp4_experts == "mxfp4":
                return Mxfp4Weight(raw.view(torch.uint8), scale.view(torch.uint8))
            value = dequantize_mxfp4(raw, scale, torch.float32 if fp4_experts == "int8" else dtype)
        except ValueError as exc:
            raise CheckpointError(f"{name}: {exc}") from None
        return quantize_int8(value) if fp4_experts == "int8" else value
    if fp8_native and scale is not None and raw.dtype == torch.float8_e4m3fn:
        s = decode_e8m0(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float()
        try:
            return Fp8BlockWeight(raw, s)
        except ValueError as exc:
            raise CheckpointError(f"{name}.scale: {exc}") from None
    return dequantize_or_keep(name, raw, scale, dtype, block)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files to read, in order; refuses pickles and incomplete shard sets."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    for index in (model_dir / MODELSLIM_INDEX_FILE, model_dir / INDEX_FILE):
        if index.is_file():
            return _index_files(index)
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p.name for g in PICKLE_GLOBS for p in model_dir.glob(g))
    if pickles:
        raise CheckpointError(
            f"{model_dir}: only pickled checkpoint files ({', '.join(pickles[:MAX_NAMES])}); "
            "pickled checkpoints are refused (they can run arbitrary code), convert them to safetensors"
        )
    raise CheckpointError(f"{model_dir}: no *.safetensors files")


def read_quant_types(model_dir: Path) -> dict[str, str] | None:
    """msModelSlim's tensor name (without `model.`) -> quant type; None without a description file."""
    path = model_dir / DESCRIPTION_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a valid quant description ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a valid quant description (not a JSON object)")
    # global keys (model_quant_type, version, metadata, ...) never match a tensor name
    return {k.removeprefix("model."): v for k, v in data.items() if isinstance(v, str)}


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise CheckpointError(f"{index}: lists shard files that do not exist: {listed(missing)}")
    return [index.parent / n for n in names]


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from None


def read_headers(files: list[Path], naming: CheckpointNames) -> dict[str, HeaderEntry]:
    """Every tensor of every file by its schema name (`naming`'s renames, a tensor of every expert split
    per expert); two tensors with one name are an error."""
    out: dict[str, HeaderEntry] = {}
    for file in files:
        with _open(file) as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                part = handle.get_slice(key)
                shape, dtype = tuple(part.get_shape()), part.get_dtype()
                for name, entry in _entries(file, key, shape, dtype, naming):
                    if name in out:
                        first = out[name]
                        raise CheckpointError(
                            f"{name}: present twice ({first.key} in {first.file.name}, {key} in {file.name})"
                        )
                    out[name] = entry
    return out


def _entries(
    file: Path, key: str, shape: tuple[int, ...], dtype: str, naming: CheckpointNames
) -> list[tuple[str, HeaderEntry]]:
    name = naming.rename(key.removeprefix("model."))
    parts = naming.split(name, shape)
    if parts is None:
        return [(name, HeaderEntry(file, key, shape, dtype))]
    return [
        (expert_name, HeaderEntry(file, key, (end - start, *shape[2:]), dtype, (expert, start, end)))
        for expert_name, expert, start, end in parts
    ]


def plan_tensors(
    headers: dict[str, HeaderEntry], expected: Expected, quant_types: dict[str, str] | None = None
) -> dict[str, PlannedTensor]:
    """Pair each tensor of the schema with its `.scale` (or, for msModelSlim W8A8_DYNAMIC ones given
    `quant_types`, its `.weight_scale` / `.weight_offset`); raise on missing / unexpected / mis-shaped
    ones, on unsupported quant types and on int8 where the model math takes only floating point."""
    schema = expected.schema
    names = {n: e for n, e in headers.items() if not expected.naming.skip(n)}
    int8 = _int8_companions(names, expected, quant_types)
    scales = {n.removesuffix(SCALE_SUFFIX) + ".weight": n for n in names if n.endswith(SCALE_SUFFIX)}
    present = set(names) - set(scales.values()) - {c for pair in int8.values() for c in pair if c}
    missing = [n for n in schema if n not in present]
    unexpected = sorted((present - schema.keys()) | {s for w, s in scales.items() if w not in schema})
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensors: {listed(missing)}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensors: {listed(unexpected)}")
    plan = {n: _planned(n, names, scales, int8) for n in schema}
    _check_shapes(plan, expected)
    return plan


def _int8_companions(
    names: dict[str, HeaderEntry], expected: Expected, quant_types: dict[str, str] | None
) -> dict[str, tuple[str, str | None]]:
    """Each int8 weight -> its (scale, offset) companions: msModelSlim's description, or the
    compressed-tensors config (no offsets); neither: int8 companions are refused."""
    ct = compressed_tensors_config(expected.quantization)
    schema, naming = expected.schema, expected.naming
    if quant_types is not None:
        if ct is not None:
            raise CheckpointError(f"both {DESCRIPTION_FILE} and a compressed-tensors quantization_config")
        return dict(int8_companions(names, quant_types, schema, naming))
    if ct is not None:
        found = ct_int8_weights({n: e.key for n, e in names.items()}, schema, naming, ct)
        return {n: (s, None) for n, s in found.items()}
    _refuse_int8_companions(names)
    return {}


def _planned(
    name: str,
    names: dict[str, HeaderEntry],
    scales: dict[str, str],
    int8: dict[str, tuple[str, str | None]],
) -> PlannedTensor:
    if name in int8:
        scale, offset = int8[name]
        return PlannedTensor(names[name], names[scale], names[offset] if offset else None, int8=True)
    return PlannedTensor(names[name], names[scales[name]] if name in scales else None)


def _refuse_int8_companions(names: dict[str, HeaderEntry]) -> None:
    unsupported = sorted(n for n in names if n.endswith(INT8_SUFFIXES))
    if unsupported:
        raise CheckpointError(
            f"W8A8 int8 tensors outside an msModelSlim checkpoint (no {DESCRIPTION_FILE}) or a "
            f"compressed-tensors one (quantization_config): {listed(unsupported)}"
        )


def _check_shapes(plan: dict[str, PlannedTensor], expected: Expected) -> None:
    bad = []
    for name, item in plan.items():
        shape, integer = expected.schema[name].shape, expected.schema[name].disk == "int64"
        if item.int8:
            bad += _int8_shape_errors(name, item, shape)
            continue
        if item.scale is not None and is_mxfp4(name, item.weight.dtype):
            scale, expert = item.scale, expected.naming.expert(name) is not None
            bad += mxfp4_shape_errors(name, item.weight.shape, scale.shape, scale.dtype, shape, expert)
            continue
        if item.scale is None and item.weight.dtype.startswith("F8_"):
            raise CheckpointError(f"{name}: float8 tensor without a {SCALE_SUFFIX} companion")
        if item.scale is None and (item.weight.dtype in INT_HEADER_DTYPES) != integer:
            raise CheckpointError(f"{name}: unexpected dtype {item.weight.dtype} for an unscaled tensor")
        if item.weight.shape != shape:
            bad.append(f"{name} {list(item.weight.shape)} (expected {list(shape)})")
    if bad:
        raise CheckpointError(f"checkpoint has {len(bad)} mis-shaped tensors: {listed(bad)}")


def _int8_shape_errors(name: str, item: PlannedTensor, shape: tuple[int, ...]) -> list[str]:
    assert item.scale is not None
    if item.weight.dtype != "I8":
        raise CheckpointError(
            f"{name}: {QUANT_W8A8_DYNAMIC} weight of dtype {item.weight.dtype}, expected I8"
        )
    base, rows = name.removesuffix(".weight"), shape[0]
    bad = [] if item.weight.shape == shape else [f"{name} {list(item.weight.shape)} (expected {list(shape)})"]
    for suffix, entry in ((WEIGHT_SCALE, item.scale), (WEIGHT_OFFSET, item.offset)):
        if entry is None:
            continue
        if entry.dtype not in FLOAT_HEADER_DTYPES:
            raise CheckpointError(
                f"{base}{suffix}: dtype {entry.dtype}, expected one of {FLOAT_HEADER_DTYPES}"
            )
        if entry.shape not in ((rows,), (rows, 1)):
            bad.append(f"{base}{suffix} {list(entry.shape)} (expected [{rows}] or [{rows}, 1])")
    return bad


def _read(handles: dict[Path, Any], entry: HeaderEntry) -> torch.Tensor:
    try:
        if entry.part is None:
            tensor: torch.Tensor = handles[entry.file].get_tensor(entry.key)
        else:
            expert, start, end = entry.part
            tensor = handles[entry.file].get_slice(entry.key)[expert, start:end]
        return tensor
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{entry.file}: cannot read {entry.key} ({exc})") from None


def _place(
    out: dict[str, Weight],
    name: str,
    value: Weight,
    naming: CheckpointNames,
    sizes: dict[str, int],
    device: str,
    expert: int | None,
) -> None:
    """Put a tensor on the device; a routed expert (`expert`: its index in this rank's stack) into its
    layer's stack."""
    slot = naming.expert(name)
    if slot is None or expert is None:
        out[name] = value.to(device)
        return
    stacked = slot[0]
    if stacked not in out:
        out |= _empty_stacks(stacked, value, sizes[stacked], device, out)
    target = out[stacked]
    if isinstance(value, Int8Weight) and isinstance(target, Int8Weight):
        target.qweight[expert].copy_(value.qweight)
        target.scale[expert].copy_(value.scale)
    elif isinstance(value, Mxfp4Weight) and isinstance(target, Mxfp4Weight):
        target.packed[expert].copy_(value.packed)
        target.scale[expert].copy_(value.scale)
    elif isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor):
        target[expert].copy_(value)
    else:  # int8 checkpoints are checked before (check_uniform_experts); MXFP4 with int8 is not
        raise CheckpointError(f"{name}: experts of {stacked} mix formats (e.g. MXFP4 and bf16)")


def _empty_stacks(
    stacked: str, value: Weight, num: int, device: str, made: Mapping[str, Weight]
) -> dict[str, Weight]:
    """The stack `stacked` for experts like `value`; float w1 and w3 (gate, up) as the two halves of
    one (E, 2I, H) buffer, so that the prefill experts run them as one GEMM (`gate_up_view`), unless
    the other one is made already (of another kind: int8)."""
    if isinstance(value, torch.Tensor):
        stem, _, leaf = stacked.rpartition(".")
        if leaf not in ("w1", "w3") or f"{stem}.w1" in made or f"{stem}.w3" in made:
            return {stacked: torch.empty((num, *value.shape), dtype=value.dtype, device=device)}
        w1, w3 = stacked_gate_up((num, *value.shape), value.dtype, device)
        return {f"{stem}.w1": w1, f"{stem}.w3": w3}
    if isinstance(value, Mxfp4Weight):
        return {
            stacked: Mxfp4Weight(
                torch.empty((num, *value.packed.shape), dtype=torch.uint8, device=device),  # (E, out, in/2)
                torch.empty((num, *value.scale.shape), dtype=torch.uint8, device=device),  # (E, out, in/32)
            )
        }
    return {
        stacked: Int8Weight(
            torch.empty((num, *value.qweight.shape), dtype=torch.int8, device=device),  # (E, out, in)
            torch.empty((num, *value.scale.shape), dtype=torch.float32, device=device),  # (E, out)
        )
    }
