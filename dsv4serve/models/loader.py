"""Load a DeepSeek-V4 safetensors checkpoint into a flat dict of tensors under official names.

`load_checkpoint` reads one `model.safetensors`, or the shards listed by `model.safetensors.index.json`
(or every `*.safetensors` file). Names may carry a `model.` prefix; `mtp.*` tensors are skipped.
Before any data is read the headers are checked against `expected_tensors(model)`: missing,
unexpected and mis-shaped tensors raise one `CheckpointError` naming them. Each tensor then goes
through the format step (`dequantize_or_keep`, which consumes a `.scale` companion), is cast to its
storage dtype (`storage_dtype`) and moved to `device`; routed experts are stacked per layer into
`layers.L.ffn.experts.{w1,w3}` [E, I, H] and `.w2` [E, H, I]. Pickled checkpoints are refused.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dsv4serve.config import ModelConfig
from dsv4serve.models.weights import (
    DEFAULT_BLOCK,
    INT8_SUFFIXES,
    SCALE_SUFFIX,
    CheckpointError,
    dequantize_or_keep,
    expected_tensors,
    expert_slot,
    loaded_tensors,
    storage_dtype,
)

__all__ = ["CheckpointError", "expected_tensors", "load_checkpoint", "loaded_tensors"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_GLOBS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")
MAX_NAMES = 10
PACKED_FP4_HEADER_DTYPES = ("I8", "U8")
INT_HEADER_DTYPES = ("I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL")


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor as a file's header describes it."""

    file: Path
    key: str  # the name in the file (may carry the `model.` prefix)
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3"


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    weight: HeaderEntry
    scale: HeaderEntry | None


def load_checkpoint(
    model_dir: Path | str, model: ModelConfig, *, dtype: torch.dtype, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every weight of `model` by official name (experts stacked), cast by `storage_dtype`, on `device`."""
    files = checkpoint_files(Path(model_dir))
    plan = plan_tensors(read_headers(files), model)
    block = _block_size(model)
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in files}
        for name, item in plan.items():
            raw = _read(handles, item.weight)
            scale = _read(handles, item.scale) if item.scale else None
            value = dequantize_or_keep(name, raw, scale, storage_dtype(name, dtype), block)
            _place(out, name, value, model, device)
    _check_tid2eid(out, model)
    return out


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files to read, in order; refuses pickles and incomplete shard sets."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    if (model_dir / "quant_model_description.json").is_file():
        raise NotImplementedError(f"{model_dir}: msModelSlim W8A8 int8 checkpoints are not supported yet")
    index = model_dir / INDEX_FILE
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


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise CheckpointError(f"{index}: lists shard files that do not exist: {_names(missing)}")
    return [index.parent / n for n in names]


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from None


def read_headers(files: list[Path]) -> dict[str, HeaderEntry]:
    """Every tensor of every file by its name without a `model.` prefix; duplicates are an error."""
    out: dict[str, HeaderEntry] = {}
    for file in files:
        with _open(file) as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                name = key.removeprefix("model.")
                if name in out:
                    raise CheckpointError(f"{name}: present twice ({out[name].file.name}, {file.name})")
                part = handle.get_slice(key)
                out[name] = HeaderEntry(file, key, tuple(part.get_shape()), part.get_dtype())
    return out


def plan_tensors(headers: dict[str, HeaderEntry], model: ModelConfig) -> dict[str, PlannedTensor]:
    """Pair each expected tensor with its `.scale`; raise on missing / unexpected / mis-shaped ones."""
    names = {n: e for n, e in headers.items() if not n.startswith("mtp.")}
    unsupported = sorted(n for n in names if n.endswith(INT8_SUFFIXES))
    if unsupported:
        raise NotImplementedError(f"W8A8 int8 tensors are not supported yet: {_names(unsupported)}")
    scales = {n.removesuffix(SCALE_SUFFIX) + ".weight": n for n in names if n.endswith(SCALE_SUFFIX)}
    expected = expected_tensors(model)
    present = set(names) - set(scales.values())
    missing = [n for n in expected if n not in present]
    unexpected = sorted((present - expected.keys()) | {s for w, s in scales.items() if w not in expected})
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensors: {_names(missing)}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensors: {_names(unexpected)}")
    plan = {n: PlannedTensor(names[n], names[scales[n]] if n in scales else None) for n in expected}
    _check_shapes(plan, expected)
    return plan


def _check_shapes(plan: dict[str, PlannedTensor], expected: dict[str, tuple[int, ...]]) -> None:
    bad = []
    for name, item in plan.items():
        if item.scale is not None and item.weight.dtype in PACKED_FP4_HEADER_DTYPES:
            raise NotImplementedError(
                f"{name}: MXFP4 (int8-packed e2m1 + ue8m0 1x32 scales) is not supported yet"
            )
        if item.scale is None and (item.weight.dtype in INT_HEADER_DTYPES) != name.endswith("tid2eid"):
            raise CheckpointError(f"{name}: unexpected dtype {item.weight.dtype} for an unscaled tensor")
        if item.weight.shape != expected[name]:
            bad.append(f"{name} {list(item.weight.shape)} (expected {list(expected[name])})")
    if bad:
        raise CheckpointError(f"checkpoint has {len(bad)} mis-shaped tensors: {_names(bad)}")


def _read(handles: dict[Path, Any], entry: HeaderEntry) -> torch.Tensor:
    try:
        tensor: torch.Tensor = handles[entry.file].get_tensor(entry.key)
        return tensor
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{entry.file}: cannot read {entry.key} ({exc})") from None


def _place(
    out: dict[str, torch.Tensor], name: str, value: torch.Tensor, model: ModelConfig, device: str
) -> None:
    slot = expert_slot(name)
    if slot is None:
        out[name] = value.to(device)
        return
    stacked, expert = slot
    if stacked not in out:
        out[stacked] = torch.empty((model.n_routed_experts, *value.shape), dtype=value.dtype, device=device)
    out[stacked][expert].copy_(value)


def _check_tid2eid(out: dict[str, torch.Tensor], model: ModelConfig) -> None:
    for layer in range(model.num_hash_layers):
        name = f"layers.{layer}.ffn.gate.tid2eid"
        table = out[name]
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= model.n_routed_experts):
            raise CheckpointError(f"{name}: expert ids outside [0, {model.n_routed_experts})")


def _block_size(model: ModelConfig) -> tuple[int, int]:
    block = (model.quantization or {}).get("weight_block_size", DEFAULT_BLOCK)
    return (int(block[0]), int(block[1]))


def _names(names: list[str]) -> str:
    more = len(names) - MAX_NAMES
    return ", ".join(names[:MAX_NAMES]) + (f" ... and {more} more" if more > 0 else "")
