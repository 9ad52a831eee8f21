"""The Triton step metadata (`backends/cuda/step.prepare_step_fused`) equals `prepare_step`'s, field by field,
on random ragged steps: prefill chunks after cached prefixes, decodes, padded windows (index -1), a
step with no closing window, and a model without compressed layers (interpreter on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4serve.attention.step import StepMeta, prepare_step
from dsv4serve.backends.cuda.step import prepare_step_fused
from tests.kernel_cases import make_case

STEPS = [
    [(0, 9), (20, 1), (3, 5), (47, 1)],
    [(0, 1), (0, 2), (63, 1)],
    [(300, 1), (150, 2), (5, 1)],
    [(70, 70)] * 3,  # more tokens than one program's block
]


def _equal(got: StepMeta, want: StepMeta) -> None:
    assert torch.equal(got.token_row, want.token_row) and torch.equal(got.positions, want.positions)
    for c in (False, True):
        assert all(torch.equal(g, w) for g, w in zip(got.rope[c], want.rope[c], strict=True))
    assert got.keep_from.keys() == want.keep_from.keys() and got.windows.keys() == want.windows.keys()
    for r in want.keep_from:
        assert torch.equal(got.keep_from[r], want.keep_from[r])
    for r, w in want.windows.items():
        g = got.windows[r]
        for field in ("row", "index", "token0", "prefix", "cos", "sin"):
            assert torch.equal(getattr(g, field), getattr(w, field)), (r, field)
    assert got.num_entries == want.num_entries and got.sliding_window == want.sliding_window
    assert got.geometry is None


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("pad_windows", [False, True])
def test_fused_step_metadata_equals_prepare_step(steps: list, pad_windows: bool) -> None:
    case = make_case(5, steps, page_size=4, pad_windows=pad_windows)
    args = (case.batch, case.step_tables(), case.rope, case.cfg.sliding_window)
    _equal(prepare_step_fused(*args), prepare_step(*args, with_geometry=False))


def test_fused_step_metadata_without_windows() -> None:
    """A model without compressed layers has no window metadata (and no keep_from)."""
    case = make_case(5, STEPS[0], page_size=4)
    batch = dataclasses.replace(case.batch, windows={})
    args = (batch, case.step_tables(), case.rope, case.cfg.sliding_window)
    _equal(prepare_step_fused(*args), prepare_step(*args, with_geometry=False))
