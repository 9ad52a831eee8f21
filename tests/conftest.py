"""Shared fixtures: one tiny checkpoint per test session; Triton in its interpreter without a GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.triton_interpreter import patch_bf16_cast, patch_bf16_dot

    patch_bf16_dot()
    patch_bf16_cast()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny DeepSeek-V4 checkpoint (`make_tiny(dir, seed=0)`), shared by every test."""
    from dsv4serve.models.deepseek_v4.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-seed0"), seed=0)
