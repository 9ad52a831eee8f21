"""dsv4serve: an async, actor-based serving microkernel for DeepSeek-V4 and GLM-4.7-Flash.

    from dsv4serve import Engine, SamplingParams

    with Engine("path/to/model") as engine:
        [completion] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8))

The public names load lazily, so `python -m dsv4serve plan` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from dsv4serve.api import AsyncEngine, Engine
    from dsv4serve.params import Completion
    from dsv4serve.protocol import RequestError, SamplingParams, StatsEvent, TokenEvent, TopLogprob

_EXPORTS = MappingProxyType(
    {
        "AsyncEngine": "dsv4serve.api",
        "Completion": "dsv4serve.params",
        "Engine": "dsv4serve.api",
        "SamplingParams": "dsv4serve.protocol",
        "RequestError": "dsv4serve.protocol",
        "StatsEvent": "dsv4serve.protocol",
        "TokenEvent": "dsv4serve.protocol",
        "TopLogprob": "dsv4serve.protocol",
    }
)
__all__ = [
    "AsyncEngine",
    "Completion",
    "Engine",
    "RequestError",
    "SamplingParams",
    "StatsEvent",
    "TokenEvent",
    "TopLogprob",
]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dsv4serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
