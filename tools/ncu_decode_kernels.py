"""Eager calls of the decode kernels for Nsight Compute: Flash's MXFP4 routed experts at 1 and 8 tokens
(each twice) and FP8 GEMMs of one row (N x K 1024 x 4096 and 4096 x 8192), on a CUDA GPU:

    ncu --clock-control none -k regex:"gate_up|down_kernel|_gemm_kernel" --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section SchedulerStats \
        python3 tools/ncu_decode_kernels.py [SPLIT_BELOW]

(PYTHONPATH holding the repository and benchmarks/.) SPLIT_BELOW: `experts.SPLIT_BELOW` (0: never split).
"""

from __future__ import annotations

import sys

import bench_experts as be
import torch

from dsv4serve.backends.cuda import experts as kt
from dsv4serve.backends.cuda import linear as lk
from dsv4serve.layers.formats import quantize_fp8_block

if len(sys.argv) > 1:
    kt.SPLIT_BELOW = int(sys.argv[1])
w = be.weights("mxfp4")
for t in (1, 8):
    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(t, 256, device="cuda", generator=gen).argsort(-1)[:, :6].to(torch.int32)
    r = torch.rand(t, 6, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        kt.routed_experts(x, r, ids, *w, 7.0)
torch.cuda.synchronize()
for n, k in ((1024, 4096), (4096, 8192)):
    wq, e = quantize_fp8_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    s = torch.exp2(e.float() - 127)
    a = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        lk.gemm(a, wq.view(torch.uint8), torch.bfloat16, fp8=s)
torch.cuda.synchronize()
print("done; SPLIT_BELOW", kt.SPLIT_BELOW)
