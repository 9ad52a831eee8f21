"""Compile every Triton kernel of the CUDA backend for the H200 (sm_90) on a machine with no GPU.

Runs the backend's op wrappers on CPU tensors at DeepSeek-V4-Flash dimensions (and tiny ones) with
a stand-in driver that reports an sm_90 target and with every launch turned into a compile-only
warm-up, with programmatic dependent launch on as on the H200; Triton's own compiler and ptxas do the
rest. Catches what the interpreter cannot: code that does not lower to PTX, and register spills.
Prints one JSON object.

    python tools/compile_kernels.py [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile-only needs the real compiler"
os.environ["DSV4SERVE_TEST_DEVICE"] = "cpu"  # the shapes are built on the CPU, whatever the machine has

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

CUOBJDUMP = str(Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")

COMPILED: list[dict[str, object]] = []


class _Sm90Driver:
    """Just enough of a driver for JITFunction.run to compile: device 0, stream 0, target sm_90."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 64)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _compile_only(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> object:
    start = time.perf_counter()
    kernel = _original_run(self, *args, grid=grid, warmup=True, **kwargs)
    meta = kernel.metadata if kernel is not None else None
    consts = {k: v for k, v in kwargs.items() if k.isupper() or k in ("num_warps", "num_stages")}
    COMPILED.append(
        {
            "kernel": self.fn.__name__,
            "consts": consts,
            "s": round(time.perf_counter() - start, 2),
            "shared": getattr(meta, "shared", None),
            "spills": _spills(kernel),
        }
    )
    return kernel


def _spills(kernel: object) -> dict[str, int] | None:
    """Registers and local-memory bytes per thread, from cuobjdump's resource report of the cubin."""
    asm = getattr(kernel, "asm", {}) or {}
    cubin = asm.get("cubin") if isinstance(asm, dict) else None
    if not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", report))
    return {k: int(v) for k, v in usage.items()}


_original_run = JITFunction.run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="tiny dims only (fast)")
    args = parser.parse_args()
    driver.set_active(_Sm90Driver())  # type: ignore[arg-type]
    JITFunction.run = _compile_only  # type: ignore[method-assign]
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from dsv4serve.backends.cuda import triton_utils

    triton_utils.pdl_enabled = lambda device: True  # type: ignore[assignment]  # as on the H200
    from tools.kernel_shapes import exercise_backend

    failures = exercise_backend(tiny=args.tiny)
    by_kernel: dict[str, int] = {}
    for c in COMPILED:
        by_kernel[str(c["kernel"])] = by_kernel.get(str(c["kernel"]), 0) + 1
    spilling = sorted(
        {
            str(c["kernel"])
            for c in COMPILED
            if c["spills"] and (c["spills"].get("LOCAL") or c["spills"].get("STACK"))
        }
    )  # type: ignore[union-attr]
    regs = {}
    for c in COMPILED:
        if c["spills"]:
            regs[str(c["kernel"])] = max(regs.get(str(c["kernel"]), 0), c["spills"].get("REG", 0))  # type: ignore[union-attr]
    for c in COMPILED:
        if c["spills"] and (c["spills"].get("LOCAL") or c["spills"].get("STACK")):  # type: ignore[union-attr]
            print("spill:", c["kernel"], c["consts"], c["spills"], file=sys.stderr)
    print(
        json.dumps(
            {
                "compiled": len(COMPILED),
                "kernels": by_kernel,
                "spilling": spilling,
                "max_regs": regs,
                "failures": failures,
            }
        )
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
