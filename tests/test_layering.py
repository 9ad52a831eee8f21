"""The package's structure, read from its source: the top level holds only the faces, every import runs
down the layers (none back up, no cycle), model math imports no engine machinery, and nothing outside
`backends/` branches on the device."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dsv4serve"
# lowest first: a module may import its own layer's and the layers below
LAYERS = (
    ("protocol", "config", "logs"),
    ("memory", "scheduler", "chat"),
    ("attention", "moe", "layers"),
    ("backends",),
    ("models",),
    ("executor",),
    ("actors",),
    ("api", "params", "stdio", "http", "demo", "bench", "cli", "__init__", "__main__"),
)
FACES = {
    "__init__",
    "__main__",
    "api",
    "params",
    "cli",
    "config",
    "protocol",
    "stdio",
    "demo",
    "bench",
    "logs",
}
MATH = ("models/deepseek_v4", "models/glm4_moe_lite", "attention", "moe", "layers")
ENGINE_MACHINERY = ("actors", "scheduler", "executor", "api", "stdio", "http", "models.registry")
DEVICE_BRANCH = re.compile(r"torch\.cuda\.|import torch_npu|device\.type|[!=]= \"(cpu|cuda|npu)\"")


def _modules() -> dict[str, Path]:
    """Every module by dotted name under the package (`models.deepseek_v4.model`, `cli`, ...)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return out


def _imports(path: Path) -> list[str]:
    """The package modules `path` imports (at any depth: function-level imports count too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dsv4serve"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("dsv4serve")]
        out += [n.removeprefix("dsv4serve").removeprefix(".") for n in names]
    return [n for n in out if n]


def _layer(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_the_top_level_holds_only_the_faces() -> None:
    files = {p.stem for p in ROOT.glob("*.py")}
    assert files <= FACES, f"not faces: {sorted(files - FACES)}"
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages <= {name for layer in LAYERS for name in layer}, sorted(packages)


def test_every_import_runs_down_the_layers() -> None:
    modules = _modules()
    up = []
    for name, path in modules.items():
        for target in _imports(path):
            if target in modules and _layer(target) > _layer(name):
                up.append(f"{name} -> {target}")
    assert not up, up


def test_the_import_graph_has_no_cycle() -> None:
    modules = _modules()
    graph = {
        name: {t for t in _imports(path) if t in modules and t != name} for name, path in modules.items()
    }
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("package", MATH)
def test_model_math_imports_no_engine_machinery(package: str) -> None:
    for path in (ROOT / package).rglob("*.py"):
        bad = [m for m in _imports(path) if m.startswith(ENGINE_MACHINERY)]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
        assert "print(" not in path.read_text(encoding="utf-8"), path


def test_no_device_branch_outside_backends() -> None:
    found = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] == "backends":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if DEVICE_BRANCH.search(line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, found
