"""Command line: `python -m dsv4serve <command> ...`.

Usage errors and bad configs print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, get_args

from dsv4serve.config import DTYPES, STATE_MODES, ConfigError, EngineConfig, ModelConfig
from dsv4serve.logs import LEVELS
from dsv4serve.logs import configure as configure_logs
from dsv4serve.memory.sizing import WEIGHT_FORMATS, SizingPlan, plan
from dsv4serve.protocol import FinishReason

if TYPE_CHECKING:  # the engine imports torch: load it only in the commands that run one
    from dsv4serve.api import AsyncEngine, Completion, SamplingParams

FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad command line; main() prints it on one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message}")


@dataclass(frozen=True, slots=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        return _fail(str(exc))
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    try:
        return COMMANDS[args.command].run(args)
    except ConfigError as exc:
        return _fail(f"dsv4serve {args.command}: error: {exc}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsv4serve", description="DeepSeek-V4 serving microkernel")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def _fail(message: str) -> int:
    print(message.replace("\n", " "), file=sys.stderr)
    return EXIT_USAGE


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive int"  # argparse names the type in its error message
_positive_float.__name__ = "positive number"


# -------------------------------------------------------------------------------------------- plan


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, metavar="FILE", help="a DeepSeek-V4 config.json")
    src.add_argument("--model", type=Path, metavar="DIR", help="a model directory holding config.json")
    p.add_argument("--hbm-gib", type=_positive_float, default=64.0, help="device memory budget (GiB)")
    p.add_argument("--page-size", type=_positive_int, default=128, help="tokens per page")
    p.add_argument("--max-running", type=_positive_int, default=64, help="most requests running at once")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="KV cache dtype")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="official", help="weight storage")
    p.add_argument("--devices", type=_positive_int, default=1, help="devices the weights are split over")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _run_plan(args: argparse.Namespace) -> int:
    model = ModelConfig.from_json_file(args.config) if args.config else ModelConfig.from_dir(args.model)
    result = plan(
        model,
        dtype=args.dtype,
        page_size=args.page_size,
        max_running=args.max_running,
        hbm_gib=args.hbm_gib,
        weight_format=args.weight_format,
        num_devices=args.devices,
    )
    print(json.dumps(result.to_dict()) if args.json else render_plan(result))
    return 0


def render_plan(p: SizingPlan) -> str:
    """The plan as a table whose every figure can be checked by hand (README, "Memory planning")."""
    e, d, di, r = p.dtype_bytes, p.head_dim, p.index_head_dim, p.hca_ratio
    n, n4, n128, w, pg = p.num_layers, p.num_c4_layers, p.num_c128_layers, p.sliding_window, p.page_size
    lines = [
        f"model: {n} layers, {n4} c4 (CSA), {n128} c128 (HCA, ratio {r}); head_dim {d}, "
        f"index_head_dim {di}, window {w}; {p.weight_params / 1e9:.1f} B params",
        f"inputs: kv {p.dtype} ({e} B), page {pg}, max running {p.max_running}, "
        f"budget {p.hbm_gib:g} GiB, weights {p.weight_format} over {p.num_devices} device(s)",
        "",
        _line("bytes per token, all layers", "formula", "bytes"),
        _line("swa (per SWA slot)", f"{n} x {d} x {e}", p.swa_bytes_per_token),
        _line("c4 kv (per raw token)", f"{n4} x {d} x {e} / 4", p.c4_bytes_per_token),
        _line("c4 indexer keys (per raw token)", f"{n4} x {di} x {e} / 4", p.c4_indexer_bytes_per_token),
        _line("c128 kv (per raw token)", f"{n128} x {d} x {e} / {r}", p.c128_bytes_per_token),
        _line("token-scaled total", "c4 + indexer + c128", p.kv_bytes_per_token),
        _line("c4 state (per state slot)", f"{n4} x (4x{d} + 4x{di}) x 4", p.c4_state_bytes_per_slot),
        _line("c128 state (per state slot)", f"{n128} x 2x{d} x 4", p.c128_state_bytes_per_slot),
        "",
        _line("per running request", "slots (formula)", "slots, bytes"),
        _line("swa", f"(ceil(({w}-1)/{pg}) + 1) x {pg}", p.swa_slots_per_request),
        _line("c4 state", f"max(2, ceil(1.8x4/{pg}) + 1) x {pg}", p.c4_state_slots_per_request),
        _line("c128 state", f"max(2, ceil(1.8x{r}/{pg}) + 1) x {pg}", p.c128_state_slots_per_request),
        _line("bytes", "slots x bytes per slot, summed", p.bytes_per_request),
        "",
        _line("memory of one device", "GiB", "bytes"),
        *(_gib(f"weights: {group}", b) for group, b in p.weight_bytes_by_group),
        _gib(f"weights ({p.weight_format}), all", p.weight_bytes),
        _gib(f"weights on this device (/{p.num_devices})", p.weight_bytes_per_device),
        _gib(f"per-request pools (x {p.max_running})", p.max_running * p.bytes_per_request),
        _gib("token-scaled pools at full_slots", p.kv_bytes),
        _gib("total", p.total_bytes),
        _gib("budget", p.budget_bytes),
        "",
        _line("pool", "", "slots"),
        *(_line(name, "", getattr(p, f"{name}_slots")) for name in POOLS),
        "",
        _verdict(p),
    ]
    return "\n".join(lines)


POOLS = ("full", "swa", "c4", "c128", "c4_state", "c128_state")


def _line(label: str, formula: str, value: float | str) -> str:
    shown = f"{value:,.0f}" if isinstance(value, int | float) else value
    return f"  {label:<34}{formula:<38}{shown:>16}"


def _gib(label: str, value: int) -> str:
    return _line(label, f"{value / (1 << 30):.2f}", value)


def _verdict(p: SizingPlan) -> str:
    if p.fits:
        return f"max_total_tokens = {p.full_slots:,} (the full pool)"
    need = p.fixed_bytes / (1 << 30)
    return (
        f"does NOT fit: weights and per-request pools alone need {need:.2f} GiB of {p.hbm_gib:g} GiB; "
        "raise --hbm-gib or --devices, or lower --max-running"
    )


# --------------------------------------------------------------------------------------- make-tiny


def _make_tiny_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, metavar="OUT", help="directory to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")


def _run_make_tiny(args: argparse.Namespace) -> int:
    from dsv4serve.models.tiny import make_tiny  # torch is heavy: import only when asked

    print(make_tiny(args.out, args.seed))
    return 0


# ------------------------------------------------------------------------------ engine flags


def _engine_arguments(p: argparse.ArgumentParser, model: bool = True) -> None:
    """The flags every engine-running command shares; defaults are EngineConfig's."""
    d = EngineConfig()
    if model:
        p.add_argument("--model", type=Path, required=True, metavar="DIR", help="model directory")
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:N or npu")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="default: float32 on cpu, else bf16")
    p.add_argument("--max-num-seqs", type=_positive_int, default=d.max_num_seqs, help="most running")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=d.max_num_batched_tokens)
    p.add_argument("--max-total-tokens", type=_positive_int, default=d.max_total_tokens, help="KV capacity")
    p.add_argument("--page-size", type=_positive_int, default=d.page_size, help="tokens per page")
    p.add_argument("--state-mode", choices=STATE_MODES, default=d.state_mode, help="compressor state layout")
    p.add_argument("--seed", type=int, default=d.seed, help="engine sampling seed")
    p.add_argument("--log-level", choices=LEVELS, default="warning", help="stderr log level")


ENGINE_FLAGS = (
    "device",
    "dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_total_tokens",
    "page_size",
    "state_mode",
    "seed",
)


def _engine_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as keyword arguments of EngineConfig, Engine and AsyncEngine."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS}


def _load_model_config(model_dir: Path) -> None:
    ModelConfig.from_dir(model_dir)  # a bad model directory is a one-line usage error, before any work


# ------------------------------------------------------------------------------------------- serve


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stdio", action="store_true", required=True, help="JSON lines on stdin / stdout")
    _engine_arguments(p)
    p.set_defaults(log_level="info")


def _run_serve(args: argparse.Namespace) -> int:
    from dsv4serve import stdio  # torch is heavy: import only when asked
    from dsv4serve.api import system_options

    _load_model_config(args.model)
    options = system_options(args.model, EngineConfig(**_engine_knobs(args)))
    configure_logs(args.log_level, stream=sys.stderr)
    return stdio.run(options)


# ---------------------------------------------------------------------------------------- generate


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text (BOS is prepended)")
    p.add_argument("--max-tokens", type=_positive_int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)")
    _engine_arguments(p)


def _run_generate(args: argparse.Namespace) -> int:
    import trio

    from dsv4serve.api import AsyncEngine, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            stop=args.stop,
        )
    except ValueError as exc:
        return _fail(f"dsv4serve generate: error: {exc}")
    _load_model_config(args.model)
    configure_logs(args.log_level, stream=sys.stderr)
    engine = AsyncEngine(args.model, **_engine_knobs(args))
    completion = trio.run(_stream_to_stdout, engine, args.prompt, params)
    print(file=sys.stdout, flush=True)
    print(f"finish_reason: {completion.finish_reason}", file=sys.stderr)
    return 0


async def _stream_to_stdout(engine: AsyncEngine, prompt: str, params: SamplingParams) -> Completion:
    from dsv4serve.api import Completion

    async with engine:
        async for event in engine.stream(prompt, params):
            if isinstance(event, Completion):
                return event
            print(event.text, end="", flush=True)
    raise AssertionError("a stream always ends with its Completion")


# -------------------------------------------------------------------------------------------- demo

DEMO_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Five actors pass messages:",
    "DeepSeek-V4 compresses its KV cache by",
)


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="default: $DSV4SERVE_CACHE or ~/.cache/dsv4serve"
    )
    p.add_argument("--max-tokens", type=_positive_int, default=16, help="tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    _engine_arguments(p, model=False)
    p.set_defaults(max_total_tokens=4096)


def _run_demo(args: argparse.Namespace) -> int:
    import trio

    from dsv4serve.api import AsyncEngine, SamplingParams

    cache = args.cache_dir or Path(os.environ.get("DSV4SERVE_CACHE") or Path.home() / ".cache" / "dsv4serve")
    configure_logs(args.log_level, stream=sys.stderr)
    model_dir, built = tiny_checkpoint(cache, seed=0)
    print(f"tiny DeepSeek-V4 checkpoint: {model_dir} ({'built' if built else 'cached'})", flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    engine = AsyncEngine(model_dir, **_engine_knobs(args))
    print(
        f"streaming {len(DEMO_PROMPTS)} prompts through the actor system on {args.device} "
        f"(max_tokens {params.max_tokens}, temperature {params.temperature}); [prompt] + new text:",
        flush=True,
    )
    completions, seconds = trio.run(_demo, engine, params)
    num_tokens = sum(len(c.token_ids) for c in completions)
    reasons = ", ".join(f"{r}={sum(c.finish_reason == r for c in completions)}" for r in FINISH_REASONS)
    print(
        f"summary: {len(completions)} requests, {num_tokens} tokens in {seconds:.2f} s, "
        f"{num_tokens / seconds:.1f} tokens/s ({reasons})"
    )
    return 0


def tiny_checkpoint(cache: Path, seed: int) -> tuple[Path, bool]:
    """The tiny checkpoint `cache/tiny-seed{seed}`, built on first use; (path, whether it was built)."""
    from dsv4serve.models.tiny import make_tiny

    target = cache / f"tiny-seed{seed}"
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
    from dsv4serve.api import Completion

    async for event in engine.stream(prompt, params):
        if isinstance(event, Completion):
            out.append(event)
            print(f"[{index}] {prompt!r} -> {event.text!r} ({event.finish_reason})", flush=True)
        else:
            print(f"[{index}] + {event.text!r}", flush=True)


# ---------------------------------------------------------------------------------------- commands
# One entry per subcommand. Still to come (it adds `_<name>_arguments` / `_run_<name>` above and an
# entry here): "bench".

COMMANDS: Mapping[str, Command] = MappingProxyType(
    {
        "plan": Command("print the memory plan of a DeepSeek-V4 model", _plan_arguments, _run_plan),
        "make-tiny": Command(
            "write a tiny random DeepSeek-V4 checkpoint", _make_tiny_arguments, _run_make_tiny
        ),
        "serve": Command("serve JSON-lines requests on stdin (--stdio)", _serve_arguments, _run_serve),
        "generate": Command("print the completion of one prompt", _generate_arguments, _run_generate),
        "demo": Command("stream a few prompts through a tiny checkpoint", _demo_arguments, _run_demo),
    }
)
