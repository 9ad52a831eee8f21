"""CUDA graphs of whole steps: the `Graph` of the CUDA backend (the executor decides what to capture)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from dsv4serve.protocol import StepItem

T = TypeVar("T")


class CudaGraphs:
    """Makes the graphs of one backend: those of a device share one memory pool (their steps never
    run at once) and one side stream for their warm-ups (each new stream would hold its own cuBLAS
    workspace for the rest of the process)."""

    def __init__(self) -> None:
        self.pools: dict[torch.device, tuple[object, torch.cuda.Stream]] = {}

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"  # not the CPU tensors of Triton's interpreter

    def __call__(self, device: torch.device) -> CudaGraph:
        if device not in self.pools:
            self.pools[device] = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device=device))
        return CudaGraph(device, *self.pools[device])


class CudaGraph:
    """One step recorded on `device`, in memory pool `pool`, warmed up on stream `side`."""

    def __init__(self, device: torch.device, pool: object, side: torch.cuda.Stream) -> None:
        self.device, self.pool, self.side = device, pool, side
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, step: Callable[[], T]) -> T:
        device, side = self.device, self.side  # the runner's, not necessarily the current device
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: compiles the kernels of these shapes
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        # thread_local: the trio thread's slot-table copies (pinned staging, event waits) run while a
        # worker thread captures; under the default global mode they invalidated the capture
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):  # type: ignore[arg-type]
            out = step()
        return out

    def replay(self, items: Sequence[StepItem] | None = None) -> None:
        self.graph.replay()  # (its kernels read the lengths from the step's device words)
