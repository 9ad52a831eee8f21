"""Sampled rows from plain lists, as the step-input packer builds them (executor/inputs.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dsv4serve.executor.inputs import SamplingFlags, StepLayout, StepShape, pack
from dsv4serve.executor.sampling import SamplingBatch
from dsv4serve.protocol import SamplingParams, StepItem


def sampling_batch(
    temperature: Sequence[float],
    top_p: Sequence[float],
    top_k: Sequence[int],
    seed: Sequence[int],
    position: Sequence[int],
    want_logprobs: bool = True,
) -> SamplingBatch:
    """One sampled row per entry: the request is one token at `position - 1` (it samples `position`)."""
    specs = [
        SamplingParams(temperature=t, top_p=p, top_k=k, logprobs=want_logprobs)
        for t, p, k in zip(temperature, top_p, top_k, strict=True)
    ]
    items = [
        StepItem(rid=str(i), prefix_len=pos - 1, token_ids=(0,), sample=True, sampling=spec, row=0)
        for i, (spec, pos) in enumerate(zip(specs, position, strict=True))
    ]
    layout = StepLayout(StepShape.of(items, ()), ())
    words = np.empty(layout.num_words, dtype=np.int64)
    pack(items, seed, layout, words, pad_row=0)
    flags = SamplingFlags.of(items)
    return layout.views(torch.from_numpy(words), max(position, default=0), flags)[1]
