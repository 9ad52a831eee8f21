"""The step-input packer (executor/inputs.py): every field against its per-token definition, and a
padded (graph) step as the eager step's fields followed by padding."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from dsv4serve.executor.inputs import SamplingFlags, StepLayout, StepShape, forward_batch, host_words, pack
from dsv4serve.executor.sampling import top_k_of
from dsv4serve.protocol import LOOKAHEAD, SamplingParams, StepItem

RATIOS = (4, 128)
INT_FIELDS = ("input_ids", "positions", "token_req", "rows", "prefix_lens", "seq_lens", "cu_seqlens")


def _item(rng: random.Random, i: int, prefix: int, length: int, sample: bool) -> StepItem:
    spec = SamplingParams(
        temperature=rng.random(), top_p=rng.random() or 1.0, top_k=rng.choice([0, 7, 2**40])
    )
    ids = tuple(rng.randrange(0, 99) for _ in range(length))
    return StepItem(
        rid=f"r{i}", prefix_len=prefix, token_ids=ids, sample=sample, sampling=spec, row=rng.randrange(9)
    )


def _spelled_out(items: list[StepItem]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {k: [] for k in ("input_ids", "positions", "token_req", "sample_index")}
    cu = [0]
    for r in RATIOS:
        out[f"win_req{r}"], out[f"win_index{r}"] = [], []
    for b, item in enumerate(items):
        for j, token in enumerate(item.token_ids):
            out["input_ids"].append(token)
            out["positions"].append(item.prefix_len + j)
            out["token_req"].append(b)
        cu.append(cu[-1] + len(item.token_ids))
        if item.sample:
            out["sample_index"].append(cu[-1] - 1)
        for r in RATIOS:  # window k closes when its last raw position k*r + r - 1 arrives in this step
            for k in range(item.seq_len // r):
                if item.prefix_len <= k * r + r - 1 < item.seq_len:
                    out[f"win_req{r}"].append(b)
                    out[f"win_index{r}"].append(k)
    out["cu_seqlens"] = cu
    out["rows"] = [i.row for i in items]
    out["prefix_lens"] = [i.prefix_len for i in items]
    out["seq_lens"] = [i.seq_len for i in items]
    return out


def test_every_field_equals_its_per_token_definition_on_random_batches() -> None:
    rng = random.Random(7)
    for _ in range(300):
        items = [
            _item(rng, i, rng.randrange(0, 300), rng.choice([0, 1, 1, 2, 5, 17, 130]), rng.random() < 0.7)
            for i in range(rng.randrange(0, 6))
        ]
        got = forward_batch(items, RATIOS, "cpu")
        want = _spelled_out(items)
        for name in INT_FIELDS:
            assert getattr(got, name).tolist() == want[name], name
        assert got.sample_index.tolist() == want["sample_index"]
        for r in RATIOS:
            assert got.windows[r].req.tolist() == want[f"win_req{r}"]
            assert got.windows[r].index.tolist() == want[f"win_index{r}"]
        assert got.input_ids.dtype == torch.int64
        assert got.max_seq_len == max((i.seq_len for i in items), default=0)


@pytest.mark.parametrize("n", [0, 1, 5, 8])
def test_a_padded_decode_step_is_the_eager_step_then_padding(n: int) -> None:
    """A decode graph's static inputs after packing: every field as the eager step has it, then
    padding (the pad row, one token at position 0, no window, greedy rows), into the same buffer
    refilled: nothing of a step before survives."""
    B, pad_row, rng = 8, 99, random.Random(n)
    layout = StepLayout(StepShape.decode(B, len(RATIOS)), RATIOS)
    words = np.full(layout.num_words, -7, dtype=np.int64)
    for size in (n, 0, n // 2, n):
        items = [
            _item(rng, j, rng.choice([rng.randrange(0, 1000), 127, 511, 1023]), 1, True) for j in range(size)
        ]
        items = [
            i if rng.random() < 0.5 else msgspec.structs.replace(i, token_ids=(LOOKAHEAD,)) for i in items
        ]
        seeds = [rng.randrange(2**40) for _ in items]
        pack(items, seeds, layout, words, pad_row)
        got, params = layout.views(torch.from_numpy(words.copy()), 1024, SamplingFlags.of(items))
        eager_layout, eager_words = host_words(items, seeds, RATIOS)
        eager, eager_params = eager_layout.views(eager_words, 1024, SamplingFlags.of(items))
        pads = B - size
        padding = {"rows": pad_row, "seq_lens": 1, "input_ids": 0, "positions": 0, "prefix_lens": 0}
        for name, pad in padding.items():
            assert getattr(got, name).tolist() == getattr(eager, name).tolist() + [pad] * pads, name
        assert got.token_req.tolist() == got.sample_index.tolist() == list(range(B))
        assert got.cu_seqlens.tolist() == list(range(B + 1))
        for r in RATIOS:
            closing = eager.windows[r].index.numel()
            assert got.windows[r].index.tolist() == eager.windows[r].index.tolist() + [-1] * (B - closing)
            assert got.windows[r].req.tolist()[:closing] == eager.windows[r].req.tolist()
            assert all(0 <= j < B for j in got.windows[r].req.tolist())
        assert params.temperature.tolist() == eager_params.temperature.tolist() + [0.0] * pads
        assert params.top_p.tolist() == eager_params.top_p.tolist() + [1.0] * pads
        assert params.top_k.tolist() == [top_k_of(i.sampling.top_k) for i in items] + [0] * pads
        assert params.seed.tolist() == [s & 0xFFFFFFFF for s in seeds] + [0] * pads
        assert params.position.tolist() == [i.prefix_len + 1 for i in items] + [1] * pads
