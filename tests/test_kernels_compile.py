"""Every Triton kernel of the CUDA backend compiles for the H200 (sm_90) with the real Triton compiler
and ptxas, on this machine without a GPU (tools/compile_kernels.py, tiny shapes, in a subprocess: the
interpreter this test session uses must stay off there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compile_kernels.py"), "--tiny"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["failures"] and report["compiled"] > 50
    kernels = ("_sparse_attention_kernel", "_split_partials_kernel", "_token_meta_kernel")
    for kernel in (
        *kernels,
        "_close_windows_kernel",
        "_gate_up_kernel",
        "_gating_top_k_kernel",
        "_split_norm_kernel",
        "_mla_attention_kernel",
        "_mla_fold_kernel",
        "_mla_prefill_kernel",
        "_rope_store_kernel",
        "_window_meta_kernel",
    ):
        assert report["kernels"].get(kernel, 0) > 0, kernel
