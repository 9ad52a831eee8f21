"""NPU graphs of whole steps: the `Graph` of the npu backend, through torch_npu's `torch.npu` module
(the twin of `torch.cuda`'s: `NPUGraph`, `graph(..., pool=...)`, `graph_pool_handle`, streams). The
executor's capture code (`executor/graphs.py`: decode steps by batch-size and context buckets, fixed-shape
inputs in static buffers, no host syncs) is the CUDA backend's, unchanged; only this class differs.
**Never run on an Ascend NPU**: the tests capture and replay through a fake graph class that records a
step's ops and runs them again on replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import torch

from dsv4serve.protocol import StepItem

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


Update = Callable[[Sequence[int]], None]
_CAPTURING: list[NpuGraph] = []  # the graph whose capture is under way, if any


def capturing() -> NpuGraph | None:
    """The NpuGraph recording the current step (an op that takes host lengths registers its update)."""
    return _CAPTURING[-1] if _CAPTURING else None


class NpuGraph:
    """One step recorded on `device`, in memory pool `pool`. An op whose lengths are host lists (FIA's
    `actual_seq_lengths_kv`) frozen at capture is recorded in a task group and registers an update
    (`updates`): before each replay it re-issues the op with the step's lengths inside
    `graph_task_update_begin` / `_end` (torch_npu's aclgraph task update, as vllm-ascend's full graphs)."""

    def __init__(self, npu: ModuleType, device: torch.device, pool: Any) -> None:
        self.runtime, self.device, self.pool = npu.npu, device, pool
        self.graph = self.runtime.NPUGraph()
        self.updates: list[Update] = []
        self.seq_lens: list[int] = []

    def capture(self, step: Callable[[], T]) -> T:
        rt, device = self.runtime, self.device
        side = rt.Stream(device=device)
        side.wait_stream(rt.current_stream(device))
        with rt.stream(side):  # warm-up: compiles the kernels of these shapes
            step()
        rt.current_stream(device).wait_stream(side)
        with rt.graph(self.graph, pool=self.pool):
            _CAPTURING.append(self)
            try:
                out = step()
            finally:
                _CAPTURING.pop()
        return out

    def replay(self, items: Sequence[StepItem] | None = None) -> None:
        if items is not None and self.updates:
            self.seq_lens = [item.seq_len for item in items]
        for update in self.updates:
            update(self.seq_lens)
        self.graph.replay()
