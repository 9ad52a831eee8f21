"""NPU graphs of whole steps: the `Graph` of the npu backend, through torch_npu's `torch.npu` module
(the twin of `torch.cuda`'s: `NPUGraph`, `graph(..., pool=...)`, `graph_pool_handle`, streams). The
executor's capture code (`executor/graphs.py`: decode steps by batch-size and context buckets, fixed-shape
inputs in static buffers, no host syncs) is the CUDA backend's, unchanged; only this class differs.
**Never run on an Ascend NPU**: the tests capture and replay through a fake graph class that records a
step's ops and runs them again on replay.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import torch

T = TypeVar("T")


class NpuGraphs:
    """Makes the graphs of one backend: those of a device share one memory pool (their steps never
    run at once)."""

    device_type: ClassVar[str] = "npu"  # the devices whose steps it captures

    def __init__(self, npu: ModuleType) -> None:
        self.npu = npu
        self.pools: dict[torch.device, Any] = {}

    def supports(self, device: torch.device) -> bool:
        return device.type == self.device_type

    def __call__(self, device: torch.device) -> NpuGraph:
        if device not in self.pools:
            self.pools[device] = self.npu.npu.graph_pool_handle()
        return NpuGraph(self.npu, device, self.pools[device])


class NpuGraph:
    """One step recorded on `device`, in memory pool `pool`."""

    def __init__(self, npu: ModuleType, device: torch.device, pool: Any) -> None:
        self.runtime, self.device, self.pool = npu.npu, device, pool
        self.graph = self.runtime.NPUGraph()

    def capture(self, step: Callable[[], T]) -> T:
        rt, device = self.runtime, self.device
        side = rt.Stream(device=device)
        side.wait_stream(rt.current_stream(device))
        with rt.stream(side):  # warm-up: compiles the kernels of these shapes
            step()
        rt.current_stream(device).wait_stream(side)
        with rt.graph(self.graph, pool=self.pool):
            out = step()
        return out

    def replay(self) -> None:
        self.graph.replay()
