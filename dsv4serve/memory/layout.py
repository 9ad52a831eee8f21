"""A model's KV layout: the pools it caches into, declared as data that the memory layer reads.

Every pool is one slot space (paged, `PoolSizes` pages of `page_size` slots; page 0 the sentinel) and
one packed field of the per-request slot message (`CacheLocs`), named by the pool, in layout order.
Pool names are any identifiers; the first pool is the request's address space (raw, no window: one
slot per position, `max_total_tokens` of them). A pool's `index` says which of a request's logical
indices keep a slot there:
  raw         raw positions [0, seq); with `window` W > 0 only the last W stay live (pages below are
              evicted), 0 = all of them
  compressed  compressed indices [0, seq // ratio): one per closed window of `ratio` raw tokens
  state       raw positions from `keep_start(ratio, seq)`: the compressor's open window(s)
Its buffers are per layer: each of `layers` holds one row of `width` elements per slot, in the KV
dtype or a fixed one (fp32 compressor state, DSV4's int8 index keys and their fp16 scales). A pool
without buffers is an address space only (DSV4's `full`).

The allocator, the slot tables, the engine's sizing, `plan` and the KV writer work from this
declaration alone (they never name a pool); the model's math reads the buffers the model spec
allocates from it, and its tables, by the names it declared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

PoolIndex = Literal["raw", "compressed", "state"]
STORAGE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass(frozen=True, slots=True)
class BufferSpec:
    name: str
    width: int  # elements per slot per layer
    layers: tuple[int, ...]
    dtype: str | None = None  # a torch dtype's name ("float32", "int8", ..); None: the engine's KV dtype

    def bytes_per_slot(self, kv_bytes: int) -> int:
        return len(self.layers) * self.width * self.element_bytes(kv_bytes)

    def element_bytes(self, kv_bytes: int) -> int:
        return kv_bytes if self.dtype is None else STORAGE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str  # an identifier; names the slot message's field and the slot table
    index: PoolIndex
    ratio: int = 1  # raw tokens per logical index (compressed, state)
    window: int = 0  # raw pools: the live window, 0 = every position
    buffers: tuple[BufferSpec, ...] = ()

    def __post_init__(self) -> None:
        assert self.name.isidentifier(), f"pool name {self.name!r} is not an identifier"
        assert self.ratio >= 1 and self.window >= 0, self

    def bytes_per_slot(self, kv_bytes: int) -> int:
        return sum(b.bytes_per_slot(kv_bytes) for b in self.buffers)


@dataclass(frozen=True, slots=True)
class KVLayout:
    pools: tuple[PoolSpec, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.pools]
        assert len(set(names)) == len(names), f"duplicate pools in {names}"
        first = self.pools[0] if self.pools else None
        assert first and first.index == "raw" and not first.window, "the first pool: raw, no window"
        buffers = [b.name for p in self.pools for b in p.buffers]
        assert len(set(buffers)) == len(buffers), f"duplicate buffers in {buffers}"

    def get(self, name: str) -> PoolSpec | None:
        return next((p for p in self.pools if p.name == name), None)

    def has(self, name: str) -> bool:
        return self.get(name) is not None

    def ratio(self, name: str) -> int:
        """The pool's ratio, 0 when the model has no such pool."""
        spec = self.get(name)
        return spec.ratio if spec is not None else 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pools)


class ServedModelConfig(Protocol):
    """What the engine outside the model math needs of any model family's config."""

    @property
    def model_type(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def torch_dtype(self) -> str: ...
    @property
    def kv_layout(self) -> KVLayout: ...
