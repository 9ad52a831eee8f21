"""A made-up third family (tests/toy_family.py), registered through one spec, served end to end: its
greedy tokens through `Engine.generate` (a paged pool of 4-token pages, chunked prefills, batches under
a tight KV budget) equal its own math recomputed over the whole sequence without a cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsv4serve import Engine, SamplingParams, cli
from dsv4serve.models import registry
from tests.toy_family import MODEL_TYPE, ToySpec, read_config, reference_logits


@pytest.fixture
def toy() -> Iterator[None]:
    registry.register(ToySpec())
    yield
    registry.SPECS.pop(MODEL_TYPE)


def greedy(model_dir: Path, prompt: list[int], new: int) -> list[int]:
    cfg, weights = read_config(model_dir), load_file(str(model_dir / "model.safetensors"))
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(reference_logits(cfg, weights, ids).argmax()))
    return ids[len(prompt) :]


def test_a_toy_family_is_served_end_to_end(toy: None, tmp_path: Path) -> None:
    model_dir = ToySpec().make_tiny(tmp_path / "toy", seed=3)
    prompts = [[0, *range(100 + i, 100 + 7 * i + 5)] for i in range(4)]  # 5 to 26 tokens
    want = [greedy(model_dir, p, 6) for p in prompts]
    knobs = {"page_size": 4, "max_num_seqs": 3, "max_num_batched_tokens": 16, "max_total_tokens": 64}
    with Engine(model_dir, **knobs) as engine:
        got = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
        assert [list(c.token_ids) for c in got] == want
        assert engine.stats().num_steps > 4 * 2  # chunked prefills of 16 tokens, 64 tokens of KV for 4 x 32
        assert all(used == 0 for used, _ in engine.pool_usage().values())
        assert set(engine.pool_usage()) == {"tokens"}  # the pool its layout named


def test_plan_and_make_tiny_reach_the_toy_family(
    toy: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = ToySpec().make_tiny(tmp_path / "toy")
    assert cli.main(["plan", "--model", str(model_dir), "--hbm-gib", "1"]) == 0
    table = capsys.readouterr().out
    assert "toy_lm: 2 layers" in table and "tokens (raw)" in table and "2 x 32 x 2" in table
    assert cli.main(["make-tiny", str(tmp_path / "again"), "--model", MODEL_TYPE]) == 0
    assert torch.equal(
        load_file(str(tmp_path / "again" / "model.safetensors"))["head.weight"],
        load_file(str(model_dir / "model.safetensors"))["head.weight"],
    )
