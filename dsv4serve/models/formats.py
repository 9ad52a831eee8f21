"""Checkpoint formats beside the official FP8 blocks: MXFP4 routed experts and compressed-tensors W8A8.

MXFP4 (the official DeepSeek-V4 routed experts): `X.weight` int8 [N, K/2] holds two e2m1 codes per
byte, the low nibble being element 2j and the high nibble element 2j+1 along K; `X.scale` ue8m0
[N, K/32] holds one power-of-two exponent per 32 weights. `W[n, k] = E2M1[code] * 2^(S[n, k//32] - 127)`.
Every such value is exact in bf16 and fp32, so dequantizing loses nothing.

compressed-tensors W8A8 int8 (`quantization_config.quant_method: compressed-tensors`, format
`int-quantized`, status `compressed`): each quantized Linear `X` holds `X.weight` int8 [out, in] and
`X.weight_scale` [out, 1] (or [out]), symmetric (no zero point), channel-wise weights and dynamic
per-token int8 activations. Which modules are quantized is the config's: a module a config group
`targets` (`Linear`, an exact module name, or `re:<regex>`) and that `ignore` does not name. Names
and regexes are matched against the module name as the file writes it (with and without a leading
`model.`); `Linear` means every 2-D projection of DeepSeek-V4 except the embedding and the router.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dsv4serve.models.weights import (
    WEIGHT_SCALE,
    CheckpointError,
    Shape,
    check_uniform_experts,
    decode_e8m0,
    expert_slot,
    listed,
    takes_int8,
)

MXFP4_BLOCK = 32  # weights per ue8m0 scale along K
# e2m1 code -> value; bit 3 is the sign, bits 2-1 the exponent, bit 0 the mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_HEADER_DTYPES = ("F8_E8M0", "U8")

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


# -------------------------------------------------------------------------------------- MXFP4


def is_mxfp4(name: str, weight_dtype: str) -> bool:
    """Whether a weight that has a `.scale` companion is packed MXFP4 (int8/uint8 on disk)."""
    return weight_dtype in ("I8", "U8") and name.endswith(".weight")


def mxfp4_shape_errors(
    name: str, shape: Shape, scale_shape: Shape, scale_dtype: str, logical: Shape
) -> list[str]:
    """What is wrong with a packed MXFP4 weight `name` of logical shape [N, K] (empty if nothing)."""
    if expert_slot(name) is None:
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


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed e2m1 pairs (N, K/2) int8/uint8 with ue8m0 scales (N, K/32) -> (N, K) in `dtype`."""
    assert packed.dtype in (torch.int8, torch.uint8) and packed.dim() == 2, packed.dtype
    n, half = packed.shape
    k = 2 * half
    if tuple(scale.shape) != (n, k // MXFP4_BLOCK) or k % MXFP4_BLOCK:
        raise CheckpointError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match {n} rows of {k} weights in "
            f"blocks of {MXFP4_BLOCK}"
        )
    raw = packed.view(torch.uint8)
    codes = torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(n, k)  # (N, K): low nibble first
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes.long()]  # (N, K)
    s = decode_e8m0(scale.view(torch.uint8)).repeat_interleave(MXFP4_BLOCK, dim=1)  # (N, K)
    return (values * s).to(dtype)


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


def is_linear(name: str, shape: Shape) -> bool:
    """Whether official tensor `name` is the weight of a Linear (a 2-D projection, not the embedding
    nor the router): what a compressed-tensors `Linear` target names."""
    return (
        name.endswith(".weight")
        and len(shape) == 2
        and name != "embed.weight"
        and not name.endswith("ffn.gate.weight")
    )


def ct_int8_weights(
    keys: Mapping[str, str], expected: Mapping[str, Shape], config: CompressedTensorsConfig
) -> dict[str, str]:
    """Each int8 weight of a compressed-tensors checkpoint -> its `.weight_scale` name (official names;
    `keys` maps every official name in the file to the name the file writes). Refuses an int8 weight
    the config does not quantize, a weight it quantizes that is stored unquantized, and int8 on a
    tensor the model takes only in floating point."""
    out: dict[str, str] = {}
    wrong: list[str] = []
    for name, shape in expected.items():
        if not is_linear(name, shape) or name not in keys:
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
    refused = sorted(n for n in out if not takes_int8(n))
    if refused:
        raise CheckpointError(f"quantized tensors the model takes only in floating point: {listed(refused)}")
    check_uniform_experts(out, expected)
    return out
