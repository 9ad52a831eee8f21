"""`build_forward_batch` (numpy index arithmetic) against the per-token definition of every field."""

from __future__ import annotations

import random

import torch

from dsv4serve.attention.metadata import BatchItem, build_forward_batch

RATIOS = (4, 128)


def _spelled_out(items: list[BatchItem]) -> dict[str, list[int]]:
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
        seq = item.prefix_len + len(item.token_ids)
        for r in RATIOS:  # window k closes when its last raw position k*r + r - 1 arrives in this step
            for k in range(seq // r):
                if item.prefix_len <= k * r + r - 1 < seq:
                    out[f"win_req{r}"].append(b)
                    out[f"win_index{r}"].append(k)
    out["cu_seqlens"] = cu
    out["rows"] = [i.row for i in items]
    out["prefix_lens"] = [i.prefix_len for i in items]
    out["seq_lens"] = [i.prefix_len + len(i.token_ids) for i in items]
    return out


def test_every_field_equals_its_per_token_definition_on_random_batches() -> None:
    rng = random.Random(7)
    for _ in range(300):
        items = [
            BatchItem(
                row=rng.randrange(0, 9),
                prefix_len=rng.randrange(0, 300),
                token_ids=tuple(rng.randrange(0, 99) for _ in range(rng.choice([0, 1, 1, 2, 5, 17, 130]))),
                sample=rng.random() < 0.7,
            )
            for _ in range(rng.randrange(0, 6))
        ]
        got = build_forward_batch(items, RATIOS, "cpu")
        want = _spelled_out(items)
        for name in ("input_ids", "positions", "token_req", "rows", "prefix_lens", "seq_lens", "cu_seqlens"):
            assert getattr(got, name).tolist() == want[name], name
        assert got.sample_index.tolist() == want["sample_index"]
        for r in RATIOS:
            assert got.windows[r].req.tolist() == want[f"win_req{r}"]
            assert got.windows[r].index.tolist() == want[f"win_index{r}"]
        assert got.input_ids.dtype == torch.int64
        assert got.max_seq_len == max((i.prefix_len + len(i.token_ids) for i in items), default=0)
