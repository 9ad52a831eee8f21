"""Command line: `python -m dsv4serve <command> ...`.

Usage errors and bad configs print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from dsv4serve.config import DTYPES, ConfigError, ModelConfig
from dsv4serve.memory.sizing import WEIGHT_FORMATS, SizingPlan, plan

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
        _line("swa", f"(ceil({w}/{pg}) + 1) x {pg}", p.swa_slots_per_request),
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


# ---------------------------------------------------------------------------------------- commands
# One entry per subcommand. Still to come (each adds `_<name>_arguments` / `_run_<name>` above and an
# entry here): "serve" (--stdio), "generate", "demo", "bench".

COMMANDS: Mapping[str, Command] = MappingProxyType(
    {
        "plan": Command("print the memory plan of a DeepSeek-V4 model", _plan_arguments, _run_plan),
        "make-tiny": Command(
            "write a tiny random DeepSeek-V4 checkpoint", _make_tiny_arguments, _run_make_tiny
        ),
    }
)
