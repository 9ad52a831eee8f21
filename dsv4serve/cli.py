"""Command line: `python -m dsv4serve <command> ...`.

Usage errors, bad configs, devices, checkpoints and requests print one line to stderr and exit with
status 2; Ctrl-C outside a serving loop exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

# demo loads trio and the engine (torch) only in the commands that run one
from dsv4serve import demo
from dsv4serve.config import DTYPES, QUANTIZE_FORMATS, ConfigError, EngineConfig
from dsv4serve.demo import tiny_checkpoint as tiny_checkpoint  # re-exported: `cli.tiny_checkpoint`
from dsv4serve.logs import LEVELS
from dsv4serve.logs import configure as configure_logs
from dsv4serve.logs import configure_default as configure_default_logs
from dsv4serve.models.plan import WEIGHT_FORMATS
from dsv4serve.models.registry import model_types, official_configs
from dsv4serve.params import SamplingParams
from dsv4serve.protocol import RequestError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
EXIT_PIPE = 141  # 128 + SIGPIPE, as shells report a writer whose reader went away


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
    """Run one command; a reader that closes stdout early (`| head`) ends it quietly."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is seen while it can still be handled
        return code
    except (BrokenPipeError, BaseExceptionGroup) as exc:
        if not _only(exc, BrokenPipeError):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return EXIT_PIPE


def _only(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether `exc` is a `kind`, or a group (from trio) of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(e, kind) for e in exc.exceptions)
    return isinstance(exc, kind)


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        return _fail(str(exc))
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    configure_default_logs()  # stdout carries a command's output only (bench's JSON): logs to stderr
    try:
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:  # Ctrl-C outside a signal-handling loop (e.g. while torch imports)
        print(f"dsv4serve {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (Exception, BaseExceptionGroup) as exc:  # re-raised unless it is a user error
        user_error = _user_error(exc)
        if user_error is None or _only(exc, BrokenPipeError):
            raise
        print(f"dsv4serve {args.command}: error: {user_error}".replace("\n", " "), file=sys.stderr)
        return EXIT_USAGE


def _user_error(exc: BaseException) -> BaseException | None:
    """A bad model directory, config, device, checkpoint, tokenizer or request (a prompt too long for
    the context), possibly inside exception groups from trio: reported as one line. Anything
    else is a bug and keeps its traceback."""
    from dsv4serve.actors.tokenizer_core import TokenizerError
    from dsv4serve.models.spec import CheckpointError

    if isinstance(exc, BaseExceptionGroup):  # from trio; several prompts may fail alike (demo)
        parts = [_user_error(e) for e in exc.exceptions]
        return parts[0] if all(p is not None for p in parts) else None
    user: tuple[type[Exception], ...] = (ConfigError, CheckpointError, TokenizerError, RequestError)
    user += (FileNotFoundError, NotImplementedError)
    return exc if isinstance(exc, user) else None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsv4serve", description="A serving microkernel for DeepSeek-V4 and GLM-4.7-Flash")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        parser_of = sub.add_parser(
            name, help=command.help, description=command.help, formatter_class=_DefaultsFormatter
        )
        command.add_arguments(parser_of)
    return parser


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every option's default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS) or "%(default)" in text:
            return text  # flags, and options whose default the help text explains
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)".strip()
        return text


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
    src.add_argument(
        "--config",
        metavar="NAME|FILE",
        help=f"an official config ({', '.join(official_configs())}) or a config.json",
    )
    src.add_argument("--model", type=Path, metavar="DIR", help="a model directory holding config.json")
    p.add_argument("--hbm-gib", type=_positive_float, default=64.0, help="device memory budget (GiB)")
    p.add_argument("--page-size", type=_positive_int, default=128, help="tokens per page")
    p.add_argument("--max-running", type=_positive_int, default=64, help="most requests running at once")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="KV cache dtype")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="official", help="weight storage")
    p.add_argument("--devices", type=_positive_int, default=1, help="devices the weights are split over")
    p.add_argument(
        "--layout",
        choices=("even", "tp", "dp"),
        default="even",
        help="even: every byte split; tp / dp: as tensor / data-parallel ranks (expert-parallel) load them",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_positive_float,
        default=None,
        help="size the KV as `serve` does: this share of --hbm-gib less the step's activation reserve",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=2048,
        help="the step's token budget (as serve's)",
    )
    p.add_argument(
        "--indexer-quant",
        choices=("int8",),
        default=None,
        help="DeepSeek-V4's index keys in int8 (as serve's): the c4 pool's bytes per slot",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _run_plan(args: argparse.Namespace) -> int:
    from dsv4serve.models.plan import plan, render
    from dsv4serve.models.registry import config_from_dir, config_from_json_file, spec_for, with_index_quant

    model = config_from_json_file(args.config) if args.config else config_from_dir(args.model)
    model = with_index_quant(model, args.indexer_quant)
    result = plan(
        spec_for(model.model_type),
        model,
        dtype=args.dtype,
        page_size=args.page_size,
        max_running=args.max_running,
        hbm_gib=args.hbm_gib,
        weight_format=args.weight_format,
        num_devices=args.devices,
        layout=args.layout,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    print(json.dumps(result.to_dict()) if args.json else render(result))
    return 0


# --------------------------------------------------------------------------------------- make-tiny


def _make_tiny_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, metavar="OUT", help="directory to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--model", choices=model_types(), default="deepseek_v4", help="the model family")
    p.add_argument(
        "--quant",
        choices=("w8a8",),
        default=None,
        help="write an Ascend msModelSlim W8A8_DYNAMIC int8 checkpoint instead of a float one",
    )


def _run_make_tiny(args: argparse.Namespace) -> int:
    from dsv4serve.models.registry import spec_for  # torch is heavy: import only when asked

    if args.model != "deepseek_v4" and args.quant:
        return _fail(f"dsv4serve make-tiny: error: --quant is for deepseek_v4 only, not {args.model}")
    quant = {"quant": args.quant} if args.quant else {}  # the float call stays make_tiny(out, seed)
    print(spec_for(args.model).make_tiny(args.out, args.seed, **quant))
    return 0


# ---------------------------------------------------------------------------------------- quantize


def _quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=Path, metavar="IN", help="a float, official (FP8/MXFP4) or int8 checkpoint")
    p.add_argument("out", type=Path, metavar="OUT", help="new directory for the int8 checkpoint")
    p.add_argument("--format", required=True, choices=QUANTIZE_FORMATS, help="the int8 checkpoint layout")
    p.add_argument("--max-shard-mib", type=_positive_float, default=4096.0, help="largest shard (MiB)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="float tensors (default: torch_dtype)")


def _run_quantize(args: argparse.Namespace) -> int:
    from dsv4serve.models.quantize import quantize_checkpoint  # torch is heavy: import only when asked

    _load_model_config(args.src)
    shard = max(1, int(args.max_shard_mib * 2**20))
    print(quantize_checkpoint(args.src, args.out, args.format, max_shard_bytes=shard, dtype=args.dtype))
    return 0


# ------------------------------------------------------------------------------ engine flags


def _engine_arguments(p: argparse.ArgumentParser, model: bool = True) -> None:
    """A flag per EngineConfig field (its help text, choices and default); bad values are EngineConfig's
    to refuse, with a ConfigError naming the field."""
    if model:
        p.add_argument("--model", type=Path, required=True, metavar="DIR", help="model directory")
    for f in fields(EngineConfig):
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        if f.type == "bool":
            on = bool(f.default)
            p.add_argument(
                f"--no-{flag[2:]}" if on else flag,
                dest=f.name,
                action="store_false" if on else "store_true",
                help=f"{'do not ' if on else ''}{meta['help']}",
            )
            continue
        kind = {"int": int, "float": float}.get(str(f.type).removesuffix(" | None"), str)
        p.add_argument(flag, type=kind, choices=meta["choices"], default=f.default, help=meta["help"])
    p.add_argument("--log-level", choices=LEVELS, default="warning", help="stderr log level")


def _engine_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as keyword arguments of EngineConfig, Engine and AsyncEngine."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)}


def _load_model_config(model_dir: Path) -> None:
    from dsv4serve.models.registry import config_from_dir

    config_from_dir(model_dir)  # a bad model directory is a one-line usage error, before any work


# ------------------------------------------------------------------------------------------- serve


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    door = p.add_mutually_exclusive_group()
    door.add_argument("--stdio", action="store_true", help="JSON lines on stdin / stdout (default transport)")
    door.add_argument("--http", action="store_true", help="an OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="--http: the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="--http: the port (0 = any free one)")
    p.add_argument("--served-model-name", default=None, help="--http: the model name (the directory's name)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("DSV4SERVE_API_KEY"),
        help="--http: every /v1/* request needs `Authorization: Bearer <key>` (default: $DSV4SERVE_API_KEY)",
    )
    p.add_argument("--ssl-certfile", default=None, help="--http: serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", default=None, help="--http: the certificate's private key (PEM)")
    p.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        metavar="N",
        help="--http: a stream's tokens per chunk after its first (fewer writes under many streams)",
    )
    p.add_argument(
        "--api-server-count",
        type=_positive_int,
        default=None,
        metavar="N",
        help="--http: front processes (HTTP, tokenizer, detokenizer) sharing the port, for many streams "
        f"(default: on an accelerator of one host, a front per {CORES_PER_FRONT} CPU cores up to "
        f"{AUTO_FRONTS_MAX}; else 1)",
    )
    p.add_argument(
        "--drain-grace-s",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="--stdio: after SIGTERM / SIGINT, how long accepted requests may take to finish",
    )
    p.add_argument(
        "--single-process",
        action="store_true",
        help="run the engine core in this process (default: a process of its own, fed over a socket)",
    )
    _engine_arguments(p)
    p.set_defaults(log_level="info")


# `serve --http`'s front processes when not given: one front falls behind the engine core at 64 streams
# of an accelerator (H100, run 82: a decode step 2.0x the embedded engine's; 4 fronts: 0.97x)
CORES_PER_FRONT, AUTO_FRONTS_MAX = 4, 4


def auto_fronts(args: argparse.Namespace, engine: EngineConfig) -> int:
    """`--api-server-count` unless given: several fronts where the core steps on an accelerator of one
    host (on the CPU the fronts would take its cores; over hosts each host's `ranks` must be told the
    count), as many as the host's CPU cores allow (a front per CORES_PER_FRONT, at most AUTO_FRONTS_MAX)."""
    if args.api_server_count is not None:
        return int(args.api_server_count)
    from dsv4serve.backends import computes_on_host

    if not args.http or args.single_process or computes_on_host(engine.device) or engine.nnodes > 1:
        return 1
    return max(1, min(AUTO_FRONTS_MAX, (os.cpu_count() or 1) // CORES_PER_FRONT))


def _run_serve(args: argparse.Namespace) -> int:
    engine = EngineConfig(**_engine_knobs(args))
    args.api_server_count = auto_fronts(args, engine)  # the count given, else the default's
    if args.http and args.api_server_count > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # several fronts: prometheus_client's multiprocess folder, set before anything imports it (so
        # every front's metrics go there), removed at exit
        with tempfile.TemporaryDirectory(prefix="dsv4serve-metrics-") as folder:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
            try:
                return _run_serve(args)
            finally:
                del os.environ["PROMETHEUS_MULTIPROC_DIR"]
    from dsv4serve import stdio  # torch is heavy: import only when asked
    from dsv4serve.api import system_options

    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):  # before anything loads or logs
        return _fail("dsv4serve serve: error: --ssl-certfile and --ssl-keyfile go together")
    if args.api_server_count > 1 and (not args.http or args.single_process):
        return _fail("dsv4serve serve: error: --api-server-count > 1 needs --http without --single-process")
    _load_model_config(args.model)
    options = system_options(args.model, engine, not args.single_process)
    configure_logs(args.log_level, stream=sys.stderr)
    if args.http:
        from dsv4serve.http.server import HttpOptions
        from dsv4serve.http.server import run as run_http

        http = HttpOptions(
            host=args.host,
            port=args.port,
            model_name=args.served_model_name,
            api_key=args.api_key or None,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            stream_interval=args.stream_interval,
            api_server_count=args.api_server_count,
        )
        return run_http(options, http)
    return stdio.run(options, args.drain_grace_s)


# ---------------------------------------------------------------------------------------- generate


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text (BOS is prepended)")
    p.add_argument("--max-tokens", type=_positive_int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)")
    _engine_arguments(p)


def _run_generate(args: argparse.Namespace) -> int:
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
    completion = demo.generate(args.model, args.prompt, params, _engine_knobs(args))
    print(file=sys.stdout, flush=True)
    print(f"finish_reason: {completion.finish_reason}", file=sys.stderr)
    return 0


# -------------------------------------------------------------------------------------------- demo


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="default: $DSV4SERVE_CACHE or ~/.cache/dsv4serve"
    )
    p.add_argument("--max-tokens", type=_positive_int, default=16, help="tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument(
        "--model-type", choices=model_types(), default="deepseek_v4", help="the tiny model's family"
    )
    _engine_arguments(p, model=False)
    p.set_defaults(max_total_tokens=4096)


def _run_demo(args: argparse.Namespace) -> int:
    try:
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except ValueError as exc:
        return _fail(f"dsv4serve demo: error: {exc}")
    cache = args.cache_dir or demo.default_cache_dir()
    configure_logs(args.log_level, stream=sys.stderr)
    return demo.run(cache, args.max_tokens, args.temperature, _engine_knobs(args), args.model_type)


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="default: the demo's tiny checkpoint")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the tiny checkpoint is cached")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or npu")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: float32 on cpu, else bf16")
    p.add_argument("--requests", type=_positive_int, default=8, help="requests per step")
    p.add_argument("--prompt-len", type=_positive_int, default=128, help="prompt tokens per request")
    p.add_argument("--decode-steps", type=_positive_int, default=16, help="decode steps after the prefill")


def _run_bench(args: argparse.Namespace) -> int:
    from dsv4serve.bench import run_bench

    model = args.model
    if model is None:
        model, _ = demo.tiny_checkpoint(args.cache_dir or demo.default_cache_dir(), seed=0)
    _load_model_config(model)
    result = run_bench(model, args.device, args.requests, args.prompt_len, args.decode_steps, args.dtype)
    print(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------------- ranks


def _ranks_arguments(p: argparse.ArgumentParser) -> None:
    _engine_arguments(p)
    p.add_argument(
        "--api-server-count",
        type=_positive_int,
        default=1,
        help="host 0's front processes (serve's --api-server-count): each core here dials every one",
    )


def _run_ranks(args: argparse.Namespace) -> int:
    """Host node_rank's share of an engine served from host 0 (same model and flags): its tensor-parallel
    ranks, or (data parallelism over hosts) its engine cores."""
    from dsv4serve import logs
    from dsv4serve.actors.core_process import run_host_cores
    from dsv4serve.executor.ranks import run_host

    engine = EngineConfig(**_engine_knobs(args))
    if engine.node_rank == 0:
        raise ConfigError("node_rank: `ranks` runs hosts 1 .. nnodes - 1; host 0 runs `serve`")
    _load_model_config(args.model)
    logs.configure(args.log_level)
    if engine.tp_spans_hosts:
        return run_host(str(args.model), engine)
    return run_host_cores(str(args.model), engine, args.api_server_count)


# ---------------------------------------------------------------------------------------- commands
# One entry per subcommand (`_<name>_arguments` / `_run_<name>` above).

COMMANDS: Mapping[str, Command] = MappingProxyType(
    {
        "plan": Command(
            "print the memory plan of a DeepSeek-V4 or GLM-4.7-Flash model", _plan_arguments, _run_plan
        ),
        "make-tiny": Command(
            "write a tiny random DeepSeek-V4 or GLM-4.7-Flash checkpoint",
            _make_tiny_arguments,
            _run_make_tiny,
        ),
        "quantize": Command(
            "write a W8A8 int8 checkpoint of a float or official one", _quantize_arguments, _run_quantize
        ),
        "serve": Command(
            "serve JSON lines on stdin (--stdio, the default) or OpenAI HTTP (--http)",
            _serve_arguments,
            _run_serve,
        ),
        "generate": Command("print the completion of one prompt", _generate_arguments, _run_generate),
        "demo": Command("stream a few prompts through a tiny checkpoint", _demo_arguments, _run_demo),
        "bench": Command("time prefill and decode steps of the executor core", _bench_arguments, _run_bench),
        "ranks": Command(
            "run this host's ranks or engine cores of an engine served from host 0 (--node-rank 1 ..)",
            _ranks_arguments,
            _run_ranks,
        ),
    }
)
