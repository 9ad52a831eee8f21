"""Checkpoints that transformers itself wrote load and serve token-exact.

A tiny random checkpoint of a random shape is loaded by `DeepseekV4ForCausalLM`, its weights are
perturbed there (so what the engine serves is what transformers holds), and `save_pretrained` writes
it in both of its formats: the default (its conversion mapping run backwards: official names mixed
with `model.embed_tokens.weight`, `model.hc_head.hc_fn`, `layers.L.attn.norm.weight`, ...) and
`save_original_format=False` (its native module names, experts stacked). Each directory must load
to exactly the tensors transformers holds and, through `Engine.generate` with chunked prefill and
preemptions forced, give transformers' own greedy tokens (fp32, its indexer on the engine's tie rule).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from golden_harness import reference_model
from tiny_shapes import random_shape

from dsv4serve import Engine, SamplingParams
from dsv4serve.models.deepseek_v4.names import official_weights
from dsv4serve.models.deepseek_v4.tiny import make_tiny
from dsv4serve.models.registry import config_from_dir
from dsv4serve.models.tiny import copy_tokenizer
from tests.checkpoints import load_checkpoint

SEEDS = (11, 12)  # random shapes
FORMATS = {"original": True, "native": False}  # save_pretrained(save_original_format=...)
LENGTHS = (1, 3, 9, 20, 33, 50)
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=SEEDS, ids=lambda s: f"seed={s}")
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both save formats of one perturbed random model, its prompts and transformers' greedy tokens."""
    seed = request.param
    rng = random.Random(seed)
    made = make_tiny(tmp_path_factory.mktemp(f"made-{seed}"), seed=seed, **random_shape(rng))
    model = reference_model(made)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    dirs = {}
    for fmt, original in FORMATS.items():
        out = tmp_path_factory.mktemp(f"saved-{seed}-{fmt}")
        model.save_pretrained(out, save_original_format=original)
        copy_tokenizer(out)
        dirs[fmt] = out
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]
    reference = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            mask = torch.ones_like(ids)
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=MAX_NEW,
                eos_token_id=1,
                pad_token_id=1,
            )
            reference.append(out[0, len(prompt) :].tolist())
    state = official_weights(model.state_dict().items())
    return {"dirs": dirs, "prompts": prompts, "reference": reference, "state": state}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_saved_directory_loads_what_transformers_holds(saved: dict[str, Any], fmt: str) -> None:
    model_dir = saved["dirs"][fmt]
    got = load_checkpoint(model_dir, config_from_dir(model_dir), dtype=torch.float32)
    want: dict[str, torch.Tensor] = saved["state"]
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        assert isinstance(value, torch.Tensor)
        assert torch.equal(value, want[name].to(value.dtype)), name


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_saved_directory_is_token_exact_chunked_and_preempted(saved: dict[str, Any], fmt: str) -> None:
    prompts = saved["prompts"]
    engine = {"max_num_seqs": 6, "max_num_batched_tokens": 16, "max_total_tokens": 96, "page_size": 4}
    with Engine(saved["dirs"][fmt], dtype="float32", **engine) as eng:  # type: ignore[arg-type]
        completions = eng.generate(prompts, GREEDY)
        preemptions = eng.stats().num_preemptions
        assert all(used == 0 for used, _ in eng.pool_usage().values()), eng.pool_usage()
    assert preemptions > 0, "the small KV capacity was meant to force preemptions"
    assert [list(c.token_ids) for c in completions] == saved["reference"]
