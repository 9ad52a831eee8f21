"""The streaming commands: `demo` (a few prompts through a tiny checkpoint, built once and cached)
and `generate` (one prompt, its text on stdout as it comes).

trio and the engine (torch) load inside the functions, so `cli` imports this module for free.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from dsv4serve.params import Completion, SamplingParams
from dsv4serve.protocol import FinishReason

if TYPE_CHECKING:
    from dsv4serve.api import AsyncEngine

FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)

DEMO_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Five actors pass messages:",
    "DeepSeek-V4 compresses its KV cache by",
)


def default_cache_dir() -> Path:
    """$DSV4SERVE_CACHE, else ~/.cache/dsv4serve."""
    return Path(os.environ.get("DSV4SERVE_CACHE") or Path.home() / ".cache" / "dsv4serve")


def run(
    cache: Path,
    max_tokens: int,
    temperature: float,
    knobs: Mapping[str, Any],
    model_type: str = "deepseek_v4",
) -> int:
    """The demo on the tiny checkpoint of `model_type` under `cache`; `knobs` are AsyncEngine's keyword
    arguments."""
    import trio

    from dsv4serve.api import AsyncEngine

    model_dir, built = tiny_checkpoint(cache, seed=0, model_type=model_type)
    print(f"tiny {model_type} checkpoint: {model_dir} ({'built' if built else 'cached'})", flush=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    engine = AsyncEngine(model_dir, **knobs)
    print(
        f"streaming {len(DEMO_PROMPTS)} prompts through the actor system on {knobs['device']} "
        f"(max_tokens {params.max_tokens}, temperature {params.temperature}); [prompt] + new text:",
        flush=True,
    )
    completions, seconds = trio.run(_demo, engine, params)
    print(summary(completions, seconds))
    return 0


def summary(completions: list[Completion], seconds: float) -> str:
    num_tokens = sum(len(c.token_ids) for c in completions)
    reasons = ", ".join(f"{r}={sum(c.finish_reason == r for c in completions)}" for r in FINISH_REASONS)
    return (
        f"summary: {len(completions)} requests, {num_tokens} tokens in {seconds:.2f} s, "
        f"{num_tokens / seconds:.1f} tokens/s ({reasons})"
    )


def tiny_checkpoint(cache: Path, seed: int, model_type: str = "deepseek_v4") -> tuple[Path, bool]:
    """The tiny checkpoint `cache/tiny-seed{seed}` (`cache/{model_type}-tiny-seed{seed}` for other
    families), built on first use; (path, whether it was built)."""
    from dsv4serve.models.registry import spec_for

    make_tiny = spec_for(model_type).make_tiny
    prefix = "" if model_type == "deepseek_v4" else f"{model_type}-"
    target = cache / f"{prefix}tiny-seed{seed}"
    if (target / "config.json").is_file():
        return target, False
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache))
    make_tiny(staging, seed)
    try:
        staging.rename(target)  # atomic: a complete checkpoint or none
    except OSError:  # another process won the race
        shutil.rmtree(staging)
    return target, True


def generate(model: Path, prompt: str, params: SamplingParams, knobs: Mapping[str, Any]) -> Completion:
    """The completion of `prompt`, its text printed to stdout as it comes (no newline at the end)."""
    import trio

    from dsv4serve.api import AsyncEngine

    engine = AsyncEngine(model, core_process=False, **knobs)  # one prompt: one start-up, in this process
    return trio.run(_stream_to_stdout, engine, prompt, params)


async def stream(
    engine: AsyncEngine, prompt: str, params: SamplingParams, on_text: Callable[[str], object]
) -> Completion:
    """Run one prompt on a running engine: `on_text(delta)` for each text delta, then its Completion."""
    async for event in engine.stream(prompt, params):
        if isinstance(event, Completion):
            return event
        on_text(event.text)
    raise AssertionError("a stream always ends with its Completion")


async def _stream_to_stdout(engine: AsyncEngine, prompt: str, params: SamplingParams) -> Completion:
    async with engine:
        return await stream(engine, prompt, params, partial(print, end="", flush=True))


async def _demo(engine: AsyncEngine, params: SamplingParams) -> tuple[list[Completion], float]:
    import trio

    completions: list[Completion] = []
    async with engine:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(DEMO_PROMPTS):
                nursery.start_soon(_demo_stream, engine, i, prompt, params, completions)
        seconds = trio.current_time() - start
    return completions, seconds


async def _demo_stream(
    engine: AsyncEngine, index: int, prompt: str, params: SamplingParams, out: list[Completion]
) -> None:
    def show(text: str) -> None:
        print(f"[{index}] + {text!r}", flush=True)

    completion = await stream(engine, prompt, params, show)
    out.append(completion)
    print(f"[{index}] {prompt!r} -> {completion.text!r} ({completion.finish_reason})", flush=True)
