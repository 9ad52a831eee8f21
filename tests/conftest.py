"""Shared fixtures: one tiny checkpoint per test session; Triton in its interpreter without a GPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import structlog.testing
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


@pytest.fixture
def all_logs() -> Iterator[structlog.testing.LogCapture]:
    """structlog's entries at every level while the test runs (an earlier test may have configured
    warnings only); the configuration restored after."""
    saved, capture = structlog.get_config(), structlog.testing.LogCapture()
    structlog.configure(
        processors=[capture],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        cache_logger_on_first_use=False,
    )
    try:
        yield capture
    finally:
        structlog.configure(**saved)
