"""`python -m dsv4serve plan` (and the CLI's error path), in process and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from dsv4serve import cli
from dsv4serve.models.registry import config_file

ROOT = Path(__file__).resolve().parents[1]
FLASH = config_file("deepseek-v4-flash")  # shipped in the package
ACCEPTANCE = [
    "plan",
    "--config",
    "deepseek-v4-flash",
    "--hbm-gib",
    "64",
    "--page-size",
    "128",
    "--max-running",
    "64",
]


def test_acceptance_command_as_a_subprocess_from_any_directory(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dsv4serve", *ACCEPTANCE, "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    plan = json.loads(out.stdout)
    pools = plan["pools"]
    assert (pools["c4_state"]["slots"], pools["c128_state"]["slots"]) == (16384, 24576)
    assert (pools["swa"]["slots"], pools["swa"]["bytes_per_slot"], plan["kv_bytes_per_token"]) == (
        16384,
        44032,
        6880,
    )


def test_acceptance_command_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*ACCEPTANCE, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["pools"]["c4_state"]["slots"], plan["pools"]["c128_state"]["slots"]) == (16384, 24576)
    assert plan["fits"] is False and plan["full_slots"] == 0  # 145 GiB of weights on one 64 GiB device


def test_a_config_path_works_as_its_name_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--config", "deepseek-v4-flash", "--json"]) == 0
    by_name = capsys.readouterr().out
    assert cli.main(["plan", "--config", str(FLASH), "--json"]) == 0
    assert capsys.readouterr().out == by_name


def test_table_shows_the_hand_checkable_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*ACCEPTANCE, "--devices", "8"]) == 0
    table = capsys.readouterr().out
    for expected in ("43 x 512 x 2", "44,032", "21 x 512 x 2 + 21 x 128 x 2", "26,880", "20 x 512 x 2"):
        assert expected in table
    assert "c4 / 4 + c128 / 128" in table and "6,880" in table
    assert "97,779,712" in table and "24,576" in table
    assert "max_total_tokens = 6,242,304" in table


def test_table_says_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(ACCEPTANCE) == 0
    assert "does NOT fit" in capsys.readouterr().out


def test_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(FLASH.read_text())
    assert cli.main(["plan", "--model", str(tmp_path), "--json", "--dtype", "float32", "--devices", "8"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["dtype_bytes"], plan["pools"]["swa"]["bytes_per_slot"]) == (4, 88064)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "COMMAND"),
        (["nope"], "invalid choice"),
        (["plan"], "--config"),
        (["plan", "--config", "/no/such/file.json"], "cannot read config file"),
        (["plan", "--model", "/no/such/dir"], "does not exist"),
        (["plan", "--config", str(FLASH), "--page-size", "0"], "--page-size"),
        (["plan", "--config", str(FLASH), "--page-size", "100"], "page_size"),
        (["plan", "--config", str(FLASH), "--hbm-gib", "lots"], "--hbm-gib"),
        (["plan", "--config", str(FLASH), "--dtype", "int8"], "--dtype"),
        (["plan", "--config", str(FLASH), "--model", "."], "not allowed"),
        (["make-tiny"], "OUT"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and needle in captured.err and "Traceback" not in captured.err


def test_bad_config_as_a_subprocess(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": "many"}))
    out = subprocess.run(
        [sys.executable, "-m", "dsv4serve", "plan", "--config", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "dsv4serve plan: error: num_hidden_layers: expected an integer, got 'many'"
    ]


def test_help_returns_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out


def test_make_tiny_calls_the_tiny_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[Path, int]] = []

    def make_tiny(out_dir: Path, seed: int) -> Path:
        calls.append((out_dir, seed))
        return out_dir

    fake = types.ModuleType("dsv4serve.models.deepseek_v4.tiny")
    fake.make_tiny = make_tiny  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dsv4serve.models.deepseek_v4.tiny", fake)
    assert cli.main(["make-tiny", str(tmp_path / "m"), "--seed", "7"]) == 0
    assert calls == [(tmp_path / "m", 7)]
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")


def test_error_paths_and_plan_load_neither_torch_nor_transformers() -> None:
    """What keeps `plan` and a bad command line fast (a second, not five): nothing heavy is imported."""
    code = (
        "import sys; from dsv4serve import cli\n"
        "assert cli.main(['plan', '--config', '/no/such/config.json']) == 2\n"
        "assert cli.main(['plan', '--model', '/no/such/dir']) == 2\n"
        "assert cli.main(['plan', '--config', 'glm-4.7-flash', '--json']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'trio') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    "argv", [[*ACCEPTANCE, "--json"], ACCEPTANCE, ["--help"], ["serve", "--help"], ["plan", "--config", "x"]]
)
def test_a_closed_stdout_ends_quietly(argv: list[str]) -> None:
    """`dsv4serve ... | head -c 10`: the reader goes away; no traceback, the shell's SIGPIPE status."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsv4serve", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 2, cli.EXIT_PIPE)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
