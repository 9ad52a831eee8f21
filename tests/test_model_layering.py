"""Model files hold only math: they import no actor, scheduler, executor or loader code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dsv4serve"
MATH_FILES = (
    "models/deepseek_v4.py",
    "models/glm4_moe_lite.py",
    "attention/mla.py",
    "attention/mla_triton.py",
)
FORBIDDEN = (
    "dsv4serve.actors",
    "dsv4serve.scheduler",
    "dsv4serve.executor",
    "dsv4serve.models.loader",
    "dsv4serve.models.schema_loader",
    "dsv4serve.models.registry",
    "dsv4serve.api",
    "dsv4serve.stdio",
)


@pytest.mark.parametrize("file", MATH_FILES)
def test_model_files_import_only_math(file: str) -> None:
    tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    bad = [m for m in imported if m.startswith(FORBIDDEN)]
    assert not bad, f"{file} imports {bad}"
    assert "print(" not in (ROOT / file).read_text(encoding="utf-8")
