"""Shared fixtures: one tiny checkpoint per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny DeepSeek-V4 checkpoint (`make_tiny(dir, seed=0)`), shared by every test."""
    from dsv4serve.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-seed0"), seed=0)
