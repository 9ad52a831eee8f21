"""Checkpoint formats: how low-precision and int8 tensors sit in a checkpoint, with their companions.

- FP8 blocks (`X.weight` float8_e4m3 with a `X.scale` companion) and packed MXFP4 routed experts
  (`X.weight` int8/uint8 with a ue8m0 `X.scale`), decoded by `layers/formats.py`.
- msModelSlim W8A8_DYNAMIC (Ascend): `quant_model_description.json` names each tensor's quant type;
  `X.weight` int8 with `X.weight_scale` / `X.weight_offset` becomes an `Int8Weight`.
- compressed-tensors W8A8 int8 (`quantization_config.quant_method: compressed-tensors`, format
  `int-quantized`, status `compressed`): each quantized Linear `X` holds `X.weight` int8 [out, in] and
  `X.weight_scale` [out, 1] (or [out]), symmetric channel-wise weights, dynamic per-token int8 inputs.
  Which modules are quantized is the config's: a module a config group `targets` (`Linear`, an exact
  module name, or `re:<regex>`) and that `ignore` does not name, matched against the module name as
  the file writes it (with and without a leading `model.`); `Linear` means every tensor the family's
  schema marks `linear`.
Int8 is accepted only on the projections the schema marks `int8`, and each layer's routed experts are
all int8 or all float per projection, gate and up alike (they load into one buffer).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dsv4serve.layers.formats import FP8_BLOCK, MXFP4_BLOCK, dequantize_fp8_block
from dsv4serve.layers.linear import Int8Weight
from dsv4serve.models.spec import CheckpointError, CheckpointNames, Schema, Shape

SCALE_SUFFIX = ".scale"
# msModelSlim / compressed-tensors int8 companions (W8A8); recognised so that they are refused by name.
INT8_SUFFIXES = (
    ".weight_scale",
    ".weight_offset",
    ".input_scale",
    ".input_offset",
    ".deq_scale",
    ".quant_bias",
)
WEIGHT_SCALE = ".weight_scale"
WEIGHT_OFFSET = ".weight_offset"
# msModelSlim quant types (quant_model_description.json) the loader reads
QUANT_FLOAT = "FLOAT"
QUANT_W8A8_DYNAMIC = "W8A8_DYNAMIC"
FP8_DTYPES = (torch.float8_e4m3fn,)
PACKED_FP4_DTYPES = (torch.int8, torch.uint8)
E8M0_HEADER_DTYPES = ("F8_E8M0", "U8")
MAX_NAMES = 10  # names an error message lists before `... and N more`

CT_METHOD = "compressed-tensors"
CT_FORMAT = "int-quantized"
CT_STATUS = "compressed"
CT_LINEAR = "Linear"
CT_REGEX = "re:"
# The one scheme read: QuantizationArgs fields (missing ones take compressed-tensors' defaults).
CT_DEFAULTS: dict[str, Any] = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
CT_WEIGHTS: dict[str, Any] = {"strategy": "channel", "dynamic": False, "group_size": None}
CT_INPUTS: dict[str, Any] = {"strategy": "token", "dynamic": True}
CT_REQUIRED: dict[str, Any] = {"num_bits": 8, "type": "int", "symmetric": True}


def listed(names: list[str]) -> str:
    """The first MAX_NAMES names, comma-separated, then how many more."""
    more = len(names) - MAX_NAMES
    return ", ".join(names[:MAX_NAMES]) + (f" ... and {more} more" if more > 0 else "")


def dequantize_or_keep(
    name: str,
    tensor: torch.Tensor,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    block: tuple[int, int] = FP8_BLOCK,
) -> torch.Tensor:
    """The logical value of one checkpoint tensor (consuming its `.scale` companion), cast to `dtype`."""
    if scale is None:
        if tensor.dtype in FP8_DTYPES:
            raise CheckpointError(f"{name}: float8 tensor without a {SCALE_SUFFIX} companion")
        return tensor.to(dtype)
    if tensor.dtype in FP8_DTYPES:
        try:
            return dequantize_fp8_block(tensor, scale, dtype, block)
        except ValueError as exc:
            raise CheckpointError(f"{name}{SCALE_SUFFIX}: {exc}") from None
    if tensor.dtype in PACKED_FP4_DTYPES:
        raise CheckpointError(f"{name}: packed MXFP4 is read by dequantize_mxfp4, not here")
    raise CheckpointError(f"{name}: dtype {tensor.dtype} cannot carry a {SCALE_SUFFIX} companion")


def int8_weight(
    name: str, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None
) -> Int8Weight:
    """W8A8 `X.weight` int8 (out, in) with `X.weight_scale` (and msModelSlim's `X.weight_offset`;
    [out] or [out, 1]) -> `Int8Weight` with an fp32 (out,) scale. Offsets must be zero (symmetric)."""
    base = name.removesuffix(".weight")
    if qweight.dtype != torch.int8:
        raise CheckpointError(f"{name}: W8A8_DYNAMIC weight of dtype {qweight.dtype}, expected int8")
    if offset is not None and bool(offset.ne(0).any()):
        raise CheckpointError(
            f"{base}{WEIGHT_OFFSET}: non-zero offsets (asymmetric int8) are not supported, "
            "W8A8_DYNAMIC weights must be symmetric"
        )
    flat = scale.float().reshape(-1)  # (out,)
    if not bool(torch.isfinite(flat).all()):
        raise CheckpointError(f"{base}{WEIGHT_SCALE}: non-finite scales")
    return Int8Weight(qweight, flat)


# ---------------------------------------------------------------------------- msModelSlim


def int8_companions(
    names: Collection[str], quant_types: Mapping[str, str], schema: Schema, naming: CheckpointNames
) -> dict[str, tuple[str, str]]:
    """Each W8A8_DYNAMIC weight among `names` (msModelSlim types; absent = FLOAT) -> its
    (`.weight_scale`, `.weight_offset`) names. Refuses other quant types, int8 on tensors the model
    takes only in floating point, missing companions, and experts of one layer mixing formats."""
    typed = {n: quant_types.get(n, QUANT_FLOAT) for n in names}
    other = [f"{n} ({t})" for n, t in typed.items() if t not in (QUANT_FLOAT, QUANT_W8A8_DYNAMIC)]
    if other:
        raise CheckpointError(
            f"quant types other than {QUANT_W8A8_DYNAMIC} and {QUANT_FLOAT} are not supported: "
            f"{listed(sorted(other))}"
        )
    quantized = [
        n
        for n, t in typed.items()
        if t == QUANT_W8A8_DYNAMIC and not n.endswith((WEIGHT_SCALE, WEIGHT_OFFSET))
    ]
    refused = [f"{n} ({QUANT_W8A8_DYNAMIC})" for n in quantized if n in schema and not schema[n].int8]
    if refused:
        raise CheckpointError(
            f"quantized tensors the model takes only in floating point: {listed(sorted(refused))}"
        )
    out: dict[str, tuple[str, str]] = {}
    for name in quantized:
        base = name.removesuffix(".weight")
        pair = (base + WEIGHT_SCALE, base + WEIGHT_OFFSET)
        absent = [c for c in pair if c not in typed]
        if absent:
            raise CheckpointError(f"{name}: {QUANT_W8A8_DYNAMIC} weight without {' and '.join(absent)}")
        out[name] = pair
    check_uniform_experts(out, schema, naming)
    return out


def check_uniform_experts(int8: Mapping[str, object], schema: Schema, naming: CheckpointNames) -> None:
    """Each layer's experts are all int8 or all float per projection, gate and up alike (they load into
    one buffer)."""
    kinds: dict[str, set[bool]] = {}
    for name in schema:
        slot = naming.expert(name)
        if slot is not None:
            stem, _, leaf = slot[0].rpartition(".")
            kinds.setdefault(f"{stem}.w1/w3" if leaf in ("w1", "w3") else slot[0], set()).add(name in int8)
    mixed = sorted(stacked for stacked, seen in kinds.items() if len(seen) > 1)
    if mixed:
        raise CheckpointError(f"experts mix {QUANT_W8A8_DYNAMIC} and {QUANT_FLOAT}: {listed(mixed)}")


# ---------------------------------------------------------------------------------- MXFP4


def is_mxfp4(name: str, weight_dtype: str) -> bool:
    """Whether a weight that has a `.scale` companion is packed MXFP4 (int8/uint8 on disk)."""
    return weight_dtype in ("I8", "U8") and name.endswith(".weight")


def mxfp4_shape_errors(
    name: str, shape: Shape, scale_shape: Shape, scale_dtype: str, logical: Shape, expert: bool
) -> list[str]:
    """What is wrong with a packed MXFP4 weight `name` (a routed `expert`'s or not) of logical shape
    [N, K] (empty if nothing)."""
    if not expert:
        raise CheckpointError(f"{name}: MXFP4 weights are read only for routed experts")
    if scale_dtype not in E8M0_HEADER_DTYPES:
        raise CheckpointError(f"{name}: MXFP4 scale of dtype {scale_dtype}, expected F8_E8M0")
    n, k = logical
    bad = []
    if k % MXFP4_BLOCK:
        bad.append(f"{name} in-features {k} (MXFP4 needs a multiple of {MXFP4_BLOCK})")
    if shape != (n, k // 2):
        bad.append(f"{name} {list(shape)} (expected packed [{n}, {k // 2}])")
    if scale_shape != (n, k // MXFP4_BLOCK):
        base = name.removesuffix(".weight")
        bad.append(f"{base}.scale {list(scale_shape)} (expected [{n}, {k // MXFP4_BLOCK}])")
    return bad


# --------------------------------------------------------------------------- compressed-tensors


@dataclass(frozen=True, slots=True)
class CompressedTensorsConfig:
    """The W8A8 int8 scheme of a compressed-tensors `quantization_config` (checked on construction)."""

    targets: tuple[str, ...]  # the union of every config group's targets
    ignore: tuple[str, ...]

    def quantizes(self, module: str, official: str, linear: bool) -> bool:
        """Whether the config quantizes `module` (as the file names it; `official` is its official name)."""
        return _matches(self.targets, module, official, linear) and not _matches(
            self.ignore, module, official, linear
        )


def compressed_tensors_config(quant: Mapping[str, Any] | None) -> CompressedTensorsConfig | None:
    """The scheme of a compressed-tensors `quantization_config`, None for any other (or no) method;
    anything but symmetric channel-wise int8 weights with dynamic per-token int8 inputs is refused."""
    if not quant or quant.get("quant_method") != CT_METHOD:
        return None
    where = f"quantization_config ({CT_METHOD})"
    for key, want in (("format", CT_FORMAT), ("quantization_status", CT_STATUS)):
        if quant.get(key, want) != want:
            raise CheckpointError(f"{where}: {key} {quant.get(key)!r} is not supported (only {want!r})")
    for key in ("kv_cache_scheme", "sparsity_config"):
        if quant.get(key):
            raise CheckpointError(f"{where}: {key} is not supported")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: config_groups must be a non-empty object")
    targets: list[str] = []
    for group, scheme in groups.items():
        _check_group(f"{where}: config_groups.{group}", scheme)
        targets += scheme["targets"]
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise CheckpointError(f"{where}: ignore must be a list of strings")
    for pattern in targets + ignore:
        _check_pattern(where, pattern)
    return CompressedTensorsConfig(tuple(targets), tuple(ignore))


def _check_group(where: str, scheme: Any) -> None:
    if not isinstance(scheme, dict):
        raise CheckpointError(f"{where}: expected an object")
    targets = scheme.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise CheckpointError(f"{where}.targets: expected a non-empty list of strings")
    if scheme.get("output_activations") is not None:
        raise CheckpointError(f"{where}.output_activations: output quantization is not supported")
    if scheme.get("input_activations") is None:
        raise CheckpointError(
            f"{where}.input_activations: weight-only int8 is not supported (W8A8 needs dynamic "
            "per-token int8 inputs)"
        )
    _check_args(f"{where}.weights", scheme.get("weights"), CT_WEIGHTS)
    _check_args(f"{where}.input_activations", scheme["input_activations"], CT_INPUTS)


def _check_args(where: str, args: Any, want: dict[str, Any]) -> None:
    if not isinstance(args, dict):
        raise CheckpointError(f"{where}: expected an object")
    for key, value in (CT_REQUIRED | want).items():
        got = args.get(key, CT_DEFAULTS.get(key))
        if got != value:
            raise CheckpointError(f"{where}.{key}: {got!r} is not supported (W8A8 int8 needs {value!r})")
    for key in ("block_structure", "actorder"):
        if args.get(key) is not None:
            raise CheckpointError(f"{where}.{key}: {args[key]!r} is not supported")


def _check_pattern(where: str, pattern: str) -> None:
    if pattern.startswith(CT_REGEX):
        try:
            re.compile(pattern.removeprefix(CT_REGEX))
        except re.error as exc:
            raise CheckpointError(f"{where}: bad regex {pattern!r} ({exc})") from None
    elif pattern[:1].isupper() and "." not in pattern and pattern != CT_LINEAR:
        raise CheckpointError(f"{where}: module class {pattern!r} is not understood (only {CT_LINEAR!r})")


def _matches(patterns: tuple[str, ...], module: str, official: str, linear: bool) -> bool:
    names = {module, module.removeprefix("model."), official}
    for pattern in patterns:
        if pattern == CT_LINEAR:
            if linear:
                return True
        elif pattern.startswith(CT_REGEX):
            regex = re.compile(pattern.removeprefix(CT_REGEX))
            if any(regex.match(n) for n in names):
                return True
        elif pattern in names:
            return True
    return False


def ct_int8_weights(
    keys: Mapping[str, str], schema: Schema, naming: CheckpointNames, config: CompressedTensorsConfig
) -> dict[str, str]:
    """Each int8 weight of a compressed-tensors checkpoint -> its `.weight_scale` name (schema names;
    `keys` maps every schema name in the file to the name the file writes). Refuses an int8 weight
    the config does not quantize, a weight it quantizes that is stored unquantized, and int8 on a
    tensor the model takes only in floating point."""
    out: dict[str, str] = {}
    wrong: list[str] = []
    for name, spec in schema.items():
        if not spec.linear or name not in keys:
            continue
        module = keys[name].removesuffix(".weight")
        scale = name.removesuffix(".weight") + WEIGHT_SCALE
        quantized = config.quantizes(module, name.removesuffix(".weight"), linear=True)
        if (scale in keys) != quantized:
            wrong.append(f"{module} ({'int8, not quantized' if scale in keys else 'float, quantized'})")
        elif quantized:
            out[name] = scale
    if wrong:
        raise CheckpointError(
            f"tensors whose storage disagrees with quantization_config targets/ignore: {listed(wrong)}"
        )
    refused = sorted(n for n in out if not schema[n].int8)
    if refused:
        raise CheckpointError(f"quantized tensors the model takes only in floating point: {listed(refused)}")
    check_uniform_experts(out, schema, naming)
    return out
