"""The backend seam: the op families the model math calls, typed, and the device they run on.

The seam sits at the height of the fused kernels: the attention ops read and write the pools through
the slot tables themselves, from metadata their `prepare` builds once per step in fixed shapes. The
model says what (attend over this layer's pools for these tokens), the backend says how. Op families
every model calls are fields of `Backend`; those only one model calls are grouped by it (`dsv4`,
`mla`). Every backend also says how its device takes a step's inputs and gives back its results
(`Transfers`) and whether it captures steps as graphs (`graphs`).

`select(device)` picks one, once, at start-up: `reference` (the pure-PyTorch executable spec, the CPU
backend), `cuda` (Triton kernels, CUDA graphs, pinned transfers) or `npu` (torch_npu ops where a
documented op has the contract, the reference elsewhere). Nothing outside this package branches on
the device. The signatures follow the Ascend ops' contracts (torch_npu's op-plugin documentation), so
the npu backend maps onto them one to one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from types import ModuleType
from typing import Protocol, TypeVar

import numpy as np
import torch

from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.attention.int8_index import Int8Rows
from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.mla import MlaDims, MlaMeta, QkvLatents
from dsv4serve.attention.rope import RopeTables
from dsv4serve.attention.step import StepMeta, StepTables
from dsv4serve.config import DEVICES, ConfigError
from dsv4serve.layers.linear import Weight
from dsv4serve.layers.mhc import HcParams, HyperConnection
from dsv4serve.protocol import StepItem

Tensor = torch.Tensor
T = TypeVar("T")
U = TypeVar("U")
Experts = tuple[Weight, Weight, Weight]  # w1 (gate), w2 (down), w3 (up)

# ------------------------------------------------------------------ op families every model calls


class Linear(Protocol):
    def __call__(self, x: Tensor, w: Weight, /) -> Tensor:
        """x (..., in) @ w^T -> (..., out) in x's dtype (layers/linear.py)."""
        ...


class GroupedLinear(Protocol):
    def __call__(self, x: Tensor, w: Weight, groups: int, /) -> Tensor:
        """x (T, groups * in), w (groups * R, in) -> (T, groups * R): each group's columns times its
        rows (layers/linear.py `grouped_linear`)."""
        ...


class RmsNorm(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, eps: float, /) -> Tensor: ...


class AddRmsNorm(Protocol):
    """(x + delta, rms_norm(x + delta)): the residual stream's sum (rounded to x's dtype before the norm
    reads it) and its norm, in one op."""

    def __call__(self, x: Tensor, delta: Tensor, weight: Tensor, eps: float, /) -> tuple[Tensor, Tensor]: ...


class GatingTopK(Protocol):
    def __call__(
        self,
        x: Tensor,
        k: int,
        *,
        bias: Tensor | None = None,
        input_ids: Tensor | None = None,
        tid2eid: Tensor | None = None,
        k_group: int = 1,
        group_count: int = 1,
        group_select_mode: int = 0,
        renorm: int = 0,
        norm_type: int = 0,
        routed_scaling_factor: float = 1.0,
        eps: float = 1e-20,
    ) -> tuple[Tensor, Tensor]:
        """npu_moe_gating_top_k's contract on router logits (moe/routing.py): (weights, ids) (T, k)."""
        ...


class RoutedExperts(Protocol):
    def __call__(
        self,
        x: Tensor,
        weights: Tensor,
        ids: Tensor,
        w1: Weight,
        w2: Weight,
        w3: Weight,
        limit: float,
        shared: Experts | None = None,
        /,
    ) -> Tensor:
        """Each token's chosen experts' clamped SwiGLU, weighted and summed, plus the shared expert
        (moe/experts.py)."""
        ...


# ------------------------------------------------------------------ DeepSeek-V4's op families


class PrepareStep(Protocol):
    def __call__(
        self, batch: ForwardBatch, tables: StepTables, rope: RopeTables, sliding_window: int, /
    ) -> StepMeta:
        """The step's metadata for every layer (attention/step.py)."""
        ...


class Rope(Protocol):
    def __call__(self, x: Tensor, meta: StepMeta, compress: bool, inverse: bool = False, /) -> Tensor: ...


class QNormRope(Protocol):
    def __call__(self, q: Tensor, meta: StepMeta, compress: bool, eps: float, /) -> Tensor: ...


class KvNormRopeStore(Protocol):
    def __call__(
        self, kv: Tensor, weight: Tensor, window: Tensor, meta: StepMeta, compress: bool, eps: float, /
    ) -> None: ...


class Compressor(Protocol):
    def __call__(
        self,
        x: Tensor,
        w: CompressorWeights,
        state: Tensor,
        out: Tensor | Int8Rows,
        meta: StepMeta,
        ratio: int,
        eps: float,
        /,
    ) -> None: ...


class IndexerTopK(Protocol):
    def __call__(
        self, q: Tensor, head_w: Tensor, keys: Tensor | Int8Rows, meta: StepMeta, topk: int, scale: float, /
    ) -> Tensor: ...


class SparseAttention(Protocol):
    def __call__(
        self,
        q: Tensor,
        window: Tensor,
        compressed: Tensor | None,
        indices: Tensor | None,
        meta: StepMeta,
        sinks: Tensor,
        scale: float,
        ratio: int,
        /,
    ) -> Tensor: ...


class HcPre(Protocol):
    def __call__(
        self, h: Tensor, hc: HyperConnection, norm_weight: Tensor, p: HcParams, /
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class HcPost(Protocol):
    def __call__(self, out: Tensor, h: Tensor, post: Tensor, comb: Tensor, /) -> Tensor: ...


class HcHead(Protocol):
    def __call__(self, h: Tensor, hc: HyperConnection, norm_weight: Tensor, p: HcParams, /) -> Tensor: ...


@dataclass(frozen=True)
class Dsv4Ops:
    """DeepSeek-V4's op families; contracts: attention/dsv4.py (attention, compressor, indexer, norm +
    rope + store), attention/step.py (prepare), layers/mhc.py (hc_pre / hc_post / hc_head)."""

    prepare: PrepareStep
    rope: Rope
    q_norm_rope: QNormRope
    kv_norm_rope_store: KvNormRopeStore
    compressor: Compressor
    indexer_topk: IndexerTopK
    sparse_attention: SparseAttention
    hc_pre: HcPre
    hc_post: HcPost
    hc_head: HcHead  # the head's collapse and the model's last norm


# ------------------------------------------------------------------ MLA's op families (GLM-4.7-Flash)


class MlaPrepare(Protocol):
    def __call__(self, batch: ForwardBatch, table: Tensor, inv_freq: Tensor, /) -> MlaMeta: ...


class QkvSplitNorm(Protocol):
    def __call__(
        self,
        y: Tensor,
        q_norm: Tensor | None,
        kv_norm: Tensor,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        eps: float,
        /,
    ) -> QkvLatents: ...


class MlaRopeStore(Protocol):
    def __call__(self, q_pe: Tensor, latents: QkvLatents, cache: Tensor, meta: MlaMeta, /) -> None: ...


class MlaAttention(Protocol):
    def __call__(self, q: Tensor, cache: Tensor, kv_b: Tensor, meta: MlaMeta, dims: MlaDims, /) -> Tensor: ...


@dataclass(frozen=True)
class MlaOps:
    """Multi-head latent attention's op families; contracts: attention/mla.py."""

    prepare: MlaPrepare
    qkv_split_norm: QkvSplitNorm
    rope_store: MlaRopeStore
    attention: MlaAttention


# ------------------------------------------------------------------ the device


class HostCopy(Protocol):
    """A device tensor on its way to the host."""

    def ready(self) -> bool:
        """Whether `read` would return at once."""
        ...

    def read(self, convert: Callable[[Tensor], T]) -> T:
        """Wait for the copy (the GIL released), then `convert(host tensor)`; the host tensor may be
        reused once `read` returns."""
        ...


class Stager(Protocol):
    """The host side of one device tensor's repeated uploads (a graph's static inputs)."""

    def stage(self) -> np.ndarray:
        """A host buffer of the tensor's shape to fill; `send` then queues its copy."""
        ...

    def send(self) -> None: ...


class Graph(Protocol):
    """One step captured on the device: `capture(step)` runs it once to warm up, records it and returns
    its outputs (static: rewritten by every replay); `replay` runs it again on the same inputs, given
    the step's items (None: the last replay's) for a graph whose ops take host lengths (the npu
    backend's FIA re-issues them before each replay; CUDA's read nothing of them)."""

    def capture(self, step: Callable[[], T]) -> T: ...

    def replay(self, items: Sequence[StepItem] | None = None) -> None: ...


class Graphs(Protocol):
    """Makes a device's graphs (those of one device share a memory pool)."""

    def supports(self, device: torch.device) -> bool: ...

    def __call__(self, device: torch.device) -> Graph: ...


class Transfers(Protocol):
    """How a step's inputs reach the device and its results come back, never waiting for the device."""

    def upload(self, host: Tensor, device: torch.device) -> Tensor: ...

    def download(self, out: Tensor) -> HostCopy: ...

    def stager(self, dst: Tensor) -> Stager: ...

    def synchronize(self, device: torch.device) -> None: ...

    def memory(self, device: torch.device) -> tuple[int, int] | None:
        """(free, total) bytes of the device's own memory, the allocator's cached blocks given back
        first; None where the device is the host's memory (the KV is then sized by a fixed default)."""
        ...


class Beside(Protocol):
    def __call__(self, like: Tensor, main: Callable[[], T], aux: Callable[[], U], /) -> tuple[T, U]:
        """(main(), aux()) for two pieces of a step of `like`'s rows on `like`'s device that do not
        read what the other writes: a backend may run them at once, and calls their host code in an
        order of its own; their results are whole on return."""
        ...


def in_turn(like: Tensor, main: Callable[[], T], aux: Callable[[], U], /) -> tuple[T, U]:
    """`Backend.beside` one after the other: main's ops, then aux's."""
    return main(), aux()


def no_workspace(weights: Mapping[str, Weight]) -> int:
    """A backend whose ops take no workspace beyond a step's activations."""
    return 0


@dataclass(frozen=True)
class Backend:
    """One implementation of every op family, and its device's transfers and graphs."""

    name: str
    linear: Linear
    grouped_linear: GroupedLinear
    rms_norm: RmsNorm
    add_rms_norm: AddRmsNorm
    gating_top_k: GatingTopK
    routed_experts: RoutedExperts
    dsv4: Dsv4Ops
    mla: MlaOps
    transfers: Transfers
    graphs: Graphs | None = None  # None: the backend captures no graphs
    collectives: str = "gloo"  # torch.distributed's backend between ranks on this device
    # device bytes the ops take for a while beyond a step's activations, given the resident weights
    # (the KV is sized beside them; `runner.sized_engine`)
    workspace: Callable[[Mapping[str, Weight]], int] = no_workspace
    beside: Beside = in_turn  # two independent pieces of a step (the queries' and the keys' chains)


BACKENDS = {"cpu": "reference", "cuda": "cuda", "npu": "npu"}  # device kind -> module


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device under tensor parallelism: the CPU for every rank, else the device's index
    + rank (`cuda:1` -> rank 1 on `cuda:2`)."""
    kind, _, index = device.partition(":")
    return device if kind == "cpu" else f"{kind}:{int(index or 0) + rank}"


def computes_on_host(device: str) -> bool:
    """Whether `device` is this host's CPU (the engine's arithmetic competes with its other processes)."""
    return device.partition(":")[0] == "cpu"


def share_host(device: str, ranks: int) -> None:
    """A process of its own that computes on this host's CPU (device `cpu`: an engine core or a rank),
    one of `ranks` there: each takes its share of the cores left after one for the server's other
    processes (the fronts, the parent). torch's default, every core in each, oversubscribes them: a
    worker thread waiting on a descheduled one spins, and a step took 80x as long beside one busy
    process (4.2 s against 53 ms, 2 cores). An $OMP_NUM_THREADS the user set is kept."""
    if computes_on_host(device) and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, ((os.cpu_count() or 1) - 1) // ranks))


def check_device(device: str) -> ModuleType:
    """The backend module of `device` ('cpu', 'cuda', 'cuda:N', 'npu') once this machine is found to have
    the device (a ConfigError naming it otherwise); no device memory is touched. A front checks it before
    it starts an engine-core process, whose own failure would only be a crash there."""
    kind = device.split(":")[0]
    if kind not in DEVICES:
        raise ConfigError(f"device: {device!r} is not cpu, cuda, cuda:N or npu")
    module = import_module(f"dsv4serve.backends.{BACKENDS[kind]}")
    module.check_device(device)
    return module


def select(device: str) -> Backend:
    """The backend of `device` (`check_device`). 'cuda' imports triton and 'npu' torch_npu (a
    RuntimeError without them)."""
    backend: Backend = check_device(device).backend()
    return backend
