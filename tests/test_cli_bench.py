"""`python -m dsv4serve bench`: one JSON object with the measured step times; `device_idle`, the
profile analysis of where the device waits in a timed step."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsv4serve.bench import TIMED, device_idle, stack_options
from dsv4serve.cli import main


def test_bench_prints_one_json_object(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench",
        "--model",
        str(tiny_model_dir),
        "--requests",
        "3",
        "--prompt-len",
        "9",
        "--decode-steps",
        "2",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3 and out["prompt_len"] == 9 and out["dtype"] == "float32"
    assert out["prefill_ms"] > 0 and out["decode_step_ms"] > 0 and len(out["tokens"]) == 3


def test_bench_on_a_missing_model_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--model", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_a_corrupt_checkpoint_is_one_line_not_a_traceback(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes()[:1000] if f.suffix == ".safetensors" else f.read_bytes())
    assert main(["bench", "--model", str(bad), "--requests", "1", "--prompt-len", "4"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_overlapped_decode_gives_the_synchronous_tokens(tiny_model_dir: Path) -> None:
    """The benchmark's overlapped decode (each step's input the previous step's token, taken on the
    device, launched before that step is waited for) continues exactly as step-by-step decoding does."""
    from dsv4serve.bench import CoreDriver
    from dsv4serve.config import EngineConfig
    from dsv4serve.executor.runner import ModelRunner

    engine = EngineConfig(device="cpu", page_size=16, max_num_seqs=2, max_num_batched_tokens=64)
    runner = ModelRunner(tiny_model_dir, engine)
    tokens = []
    for overlapped in (False, True):
        core = CoreDriver(runner)
        prompts = {"a": [0, *range(100, 120)], "b": [0, *range(200, 207)]}
        core.prefill(prompts, 64)
        seen = []
        for _ in range(5):
            if overlapped:
                core.decode_overlapped(list(prompts), 2)
            else:
                core.decode(list(prompts), 2)
            seen.append(dict(core.last))
        core.free(list(prompts))
        tokens.append(seen)
    assert tokens[0] == tokens[1] and len({s["a"] for s in tokens[0]}) > 1


def _event(
    kind: str, name: str, start: float, end: float, self_us: float = 0.0, stack: tuple[str, ...] = ()
) -> SimpleNamespace:
    """The fields of a torch profiler FunctionEvent that `device_idle` reads."""
    return SimpleNamespace(
        device_type=SimpleNamespace(name=kind),
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        self_cpu_time_total=self_us,
        stack=list(stack),
    )


def test_device_idle_finds_the_timed_steps_lead_in_and_gaps() -> None:
    events = [
        _event("CUDA", "plan_kernel", 0, 3),  # before the timed range: not the step's
        _event("CPU", "plan", 0, 4, 4),
        _event("CPU", TIMED, 5, 100),
        _event("CUDA", TIMED, 10, 80),  # the range's device-side annotation: not an op
        _event("CPU", "prepare", 6, 9, 3),
        _event("CPU", "forward", 5, 90, 2),
        _event("CPU", "aten::item", 40, 55, 15),
        _event(
            "CPU", "aten::mm", 54, 56, 1, ("torch/nn/functional.py(1): linear", "dsv4serve/moe/x.py(7): f")
        ),
        _event("CUDA", "Memcpy HtoD (Pinned -> Device)", 10, 12),
        _event("CUDA", "k1", 14, 20),
        _event("CUDA", "k2", 20, 40),
        _event("CUDA", "k3", 56, 60),
        _event("CUDA", "k4", 58, 70),  # overlaps k3: no gap between them
        _event("CUDA", "k5", 75, 80),
        _event("CUDA", "later_kernel", 120, 130),  # after the range: not the step's
    ]
    idle = device_idle(events)
    assert idle["lead_in_us"] == 5 and idle["lead_in_compute_us"] == 9
    assert idle["lead_in_host_us"] == {"prepare": 3}
    assert idle["span_us"] == 70 and idle["idle_us"] == 2 + 16 + 5 and idle["gaps"] == 3
    first = idle["longest"][0]
    assert first == {
        "us": 16,
        "after": "k2",
        "before": "k3",
        "host": ["aten::item", "forward"],
        "launched_from": ["dsv4serve/moe/x.py(7): f"],  # the last host op with a stack begun by then
    }
    assert [g["after"] for g in idle["longest"][1:]] == ["k4", "Memcpy HtoD (Pinned -> Device)"]


def test_device_idle_says_what_is_missing() -> None:
    assert "error" in device_idle([_event("CUDA", "k", 0, 1)])
    assert "error" in device_idle([_event("CPU", TIMED, 5, 10), _event("CUDA", "k", 20, 30)])


def test_stack_options_record_python_frames() -> None:
    """A profile with `stack_options` carries each op's Python frames (what `launched_from` reads)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], **stack_options()) as prof:
        torch.ones(4, 4).mm(torch.ones(4, 4))
    stacks = [e.stack for e in prof.events() if e.name == "aten::mm"]
    assert stacks and any("test_cli_bench.py" in frame for frame in stacks[0]), stacks
