"""Load a float safetensors checkpoint against a model's declared schema (name -> shape).

For model families whose checkpoints are plain float tensors (GLM-4.7-Flash): the files are found as
for DeepSeek-V4 (`model.safetensors`, the shards of `model.safetensors.index.json`, or every
`*.safetensors`; pickles refused), names lose their `model.` prefix, tensors the model skips (an MTP
block) are dropped, and missing, unexpected, mis-shaped or non-float tensors raise one
`CheckpointError` naming them, before any data is read. Routed experts `P.experts.E.X.weight` are
stacked per layer into `P.experts.{w1, w2, w3}` ([E, I, H] for gate / up, [E, H, I] for down); gate
and up are the two halves of one [E, 2I, H] buffer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path

import torch

from dsv4serve.models.loader import FLOAT_HEADER_DTYPES, _open, checkpoint_files, read_headers
from dsv4serve.models.weights import CheckpointError, listed
from dsv4serve.moe.experts import stacked_gate_up
from dsv4serve.progress import shown
from dsv4serve.quant import Weight

Shape = tuple[int, ...]
EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
STACKED = {"gate": "w1", "down": "w2", "up": "w3"}


def load_by_schema(
    model_dir: Path | str,
    expected: Mapping[str, Shape],
    *,
    skip: Callable[[str], bool],
    fp32: Callable[[str], bool],
    dtype: torch.dtype,
    device: str = "cpu",
) -> dict[str, Weight]:
    """Every expected tensor cast to `dtype` (or fp32 where `fp32(name)`), experts stacked, on `device`."""
    files = checkpoint_files(Path(model_dir))
    headers = {n: e for n, e in read_headers(files, dsv4_names=False).items() if not skip(n)}
    missing = [n for n in expected if n not in headers]
    unexpected = sorted(set(headers) - set(expected))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensors: {listed(missing)}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensors: {listed(unexpected)}")
    shapes = [f"{n} {headers[n].shape} (expected {s})" for n, s in expected.items() if headers[n].shape != s]
    if shapes:
        raise CheckpointError(f"{len(shapes)} tensors have the wrong shape: {listed(shapes)}")
    formats = [f"{n} ({headers[n].dtype})" for n in expected if headers[n].dtype not in FLOAT_HEADER_DTYPES]
    if formats:
        raise CheckpointError(
            f"{len(formats)} tensors are not float (only float checkpoints): {listed(formats)}"
        )
    out: dict[str, Weight] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    gate_up: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (w1, w3) stacks by experts prefix
    sizes = {name: shape[0] for name, shape in loaded_names(expected).items() if name not in expected}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in files}
        for name in shown(list(expected), "weights"):
            entry = headers[name]
            value = handles[entry.file].get_tensor(entry.key).to(torch.float32 if fp32(name) else dtype)
            found = EXPERT_RE.match(name)
            if found is None:
                out[name] = value.to(device)
                continue
            key = f"{found[1]}.{STACKED[found[3]]}"
            experts.setdefault(key, {})[int(found[2])] = value
            if len(experts[key]) == sizes[key]:
                parts = experts.pop(key)
                stacked = torch.stack([parts[e] for e in sorted(parts)])  # (E, out, in)
                if found[3] == "down":
                    out[key] = stacked.to(device)
                    continue
                # gate and up: the two halves of one (E, 2I, H) buffer (one prefill GEMM, `gate_up_view`)
                if found[1] not in gate_up:
                    gate_up[found[1]] = stacked_gate_up(tuple(stacked.shape), stacked.dtype, device)
                w1, w3 = gate_up[found[1]]
                out[key] = (w1 if found[3] == "gate" else w3).copy_(stacked)
    assert not experts, f"incomplete expert stacks: {sorted(experts)}"
    return out


def loaded_names(expected: Mapping[str, Shape]) -> dict[str, Shape]:
    """The names and shapes `load_by_schema` returns (experts stacked)."""
    out: dict[str, Shape] = {}
    counts: dict[str, int] = {}
    for name, shape in expected.items():
        found = EXPERT_RE.match(name)
        if found is None:
            out[name] = shape
            continue
        key = f"{found[1]}.{STACKED[found[3]]}"
        counts[key] = counts.get(key, 0) + 1
        out[key] = (counts[key], *shape)
    return out
