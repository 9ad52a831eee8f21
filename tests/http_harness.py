"""A served tiny model for the HTTP tests: `serve_http` in a background thread (its own trio run), and
a test-only logits hook that forces the model's output to a script of token ids."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trio

from dsv4serve.actors.system import SystemOptions
from dsv4serve.actors.tokenizer_core import load_tokenizer
from dsv4serve.config import EngineConfig
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.http.server import HttpOptions, HttpServer, serve_http
from dsv4serve.protocol import StepPlan

FORCE = 1e4  # added to the scripted token's logit: it wins under any sampling settings


class ForcedRunner:
    """Wraps a real runner: while `script` is set, the k-th token each request samples is `script[k]`
    (then EOS). The model still runs every step; only its logits are biased, on the device."""

    def __init__(self, runner: ModelRunner, eos: int) -> None:
        self.runner, self.eos = runner, eos
        self.script: list[int] | None = None
        self._first: dict[str, int] = {}
        self._forced: list[int | None] = []
        self._launch, self._forward = runner.launch, runner.model.forward
        runner.launch = self.launch  # type: ignore[method-assign]
        runner.model.forward = self.forward  # type: ignore[method-assign]

    def launch(self, plan: StepPlan, *args: Any, **kw: Any) -> Any:
        self._forced = []
        for item in plan.items:
            if item.sample:
                k = item.seq_len - self._first.setdefault(item.rid, item.seq_len)
                script = self.script
                self._forced.append(None if script is None else script[k] if k < len(script) else self.eos)
        return self._launch(plan, *args, **kw)

    def forward(self, *args: Any, **kw: Any) -> torch.Tensor:
        logits = self._forward(*args, **kw)
        assert not kw.get("all_logits"), "the hook biases the sampled rows only"
        for row, token in enumerate(self._forced):
            if token is not None:
                logits[row, token] += FORCE
        return logits


class ServedModel:
    """`serve_http` on 127.0.0.1 (a free port) in a thread; `close()` drains it and joins the thread."""

    def __init__(self, model_dir: Path, engine: EngineConfig, max_waiting: int = 1024, **http: Any) -> None:
        runner = ModelRunner(model_dir, engine)
        self.tok = load_tokenizer(model_dir)
        self.forced = ForcedRunner(runner, int(runner.model_cfg.eos_token_ids[0]))
        options = SystemOptions(model_dir, engine, max_waiting=max_waiting, prebuilt=(runner, self.tok))
        self._http = HttpOptions(port=0, model_name="tiny", **http)
        self._started: Future[tuple[HttpServer, trio.lowlevel.TrioToken]] = Future()
        self._thread = threading.Thread(target=trio.run, args=(self._main, options), daemon=True)
        self._thread.start()
        self.server, self.token = self._started.result(timeout=120)
        self.url = self.server.urls[0]

    async def _main(self, options: SystemOptions) -> None:
        try:
            async with trio.open_nursery() as nursery:
                server = await nursery.start(serve_http, options, self._http)
                self._started.set_result((server, trio.lowlevel.current_trio_token()))
        except BaseException as exc:
            if not self._started.done():
                self._started.set_exception(exc)
            raise

    def call(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def pool_usage(self) -> dict[str, tuple[int, int]]:
        return self.call(self.server.handle.pool_usage)

    def begin_drain(self) -> None:
        self.call(self.server.begin_drain)

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                self.begin_drain()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the server did not stop"

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))


def free(usage: dict[str, tuple[int, int]], ignore: Sequence[str] = ()) -> bool:
    return all(used == 0 for name, (used, _) in usage.items() if name not in ignore)


@dataclass
class StreamedChat:
    """What a streamed chat completion's chunks carried, piece by piece (openai client chunks)."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # tool-call names, as they came
    pieces: list[str] = field(default_factory=list)  # tool-call argument fragments
    reasons: list[Any] = field(default_factory=list)  # finish_reason per choice chunk


def collect_stream(chunks: Iterable[Any]) -> StreamedChat:
    out = StreamedChat()
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            out.reasoning.append(getattr(delta, "reasoning_content", None) or "")
            out.content.append(delta.content or "")
            for call in delta.tool_calls or []:
                if call.function and call.function.name:
                    out.names.append(call.function.name)
                if call.function and call.function.arguments:
                    out.pieces.append(call.function.arguments)
            out.reasons.append(choice.finish_reason)
    return out
