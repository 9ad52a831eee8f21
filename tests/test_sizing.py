"""`plan` (models/plan.py over memory/sizing.py) for DeepSeek-V4: every Flash figure checked against
arithmetic written out by hand."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4serve.config import CPU_MAX_TOTAL_TOKENS, ConfigError, EngineConfig
from dsv4serve.executor.runner import sized_engine
from dsv4serve.memory.paged import npu_state_pool_size
from dsv4serve.memory.sizing import (
    GIB,
    activation_reserve,
    kv_tokens_for,
    pool_bytes,
    token_unit,
    window_pages,
)
from dsv4serve.models.deepseek_v4 import SPEC
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.plan import DevicePlan
from dsv4serve.models.plan import count_weights as count_schema
from dsv4serve.models.plan import plan as device_plan
from dsv4serve.models.registry import config_from_json_file, spec_for


def swa_slots_per_request(model: DeepseekV4Config, page_size: int) -> int:
    return window_pages(model.sliding_window, page_size) * page_size


OFFICIAL_FLASH_TOTAL_SIZE = 159_609_485_896  # model.safetensors.index.json of DeepSeek-V4-Flash


def load(name: str) -> DeepseekV4Config:
    """An official config, shipped in the package (`deepseek-v4-flash`, `deepseek-v4-pro`)."""
    return config_from_json_file(f"deepseek-v4-{name}")


def plan(model: DeepseekV4Config, **kwargs: Any) -> DevicePlan:
    return device_plan(SPEC, model, **kwargs)


def count_weights(
    model: DeepseekV4Config, weight_format: str
) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    return count_schema(SPEC.schema(model), weight_format)


def pool(p: DevicePlan, name: str, figure: str) -> Any:
    """A pool's figure in the plan's JSON: bytes_per_slot, slots_per_request or slots."""
    return p.to_dict()["pools"].get(name, {}).get(figure, 0)


def buffer_per_token(p: DevicePlan, pool_name: str, buffer: str, ratio: int) -> float:
    b = p.to_dict()["pools"][pool_name]["buffers"][buffer]
    return b["layers"] * b["width"] * p.dtype_bytes / ratio


@pytest.fixture(scope="module")
def flash() -> DeepseekV4Config:
    return load("flash")


def fp8(rows: int, cols: int) -> int:
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128)


def fp4(rows: int, cols: int) -> int:
    return rows * cols // 2 + rows * cols // 32


def flash_bytes_by_hand() -> tuple[int, int]:
    """(main model bytes, MTP block bytes) of the official Flash checkpoint, from its tensor list."""
    h, v, d, nh, qr, e, inter = 4096, 129280, 512, 64, 1024, 256, 2048
    hc_head = (4 * 4 * h + 4 + 1) * 4
    block = (
        2 * (24 * 4 * h + 24 + 3) * 4  # hc_attn_*, hc_ffn_* (fp32)
        + (2 * h + qr + d) * 2  # attn_norm, ffn_norm, q_norm, kv_norm
        + fp8(qr, h) + fp8(nh * d, qr) + fp8(d, h) + fp8(8 * 1024, nh * d // 8) + fp8(h, 8 * 1024)
        + nh * 4  # attn_sink
        + e * h * 2  # router weight
        + e * (2 * fp4(inter, h) + fp4(h, inter))  # routed experts
        + 2 * fp8(inter, h) + fp8(h, inter)  # shared expert
    )  # fmt: skip
    c4 = (2 * 2 * d * h * 2 + 4 * 2 * d * 4 + d * 2) + (  # compressor
        fp8(64 * 128, qr) + 64 * h * 2 + 2 * 256 * h * 2 + 4 * 256 * 4 + 128 * 2  # indexer
    )
    c128 = 2 * d * h * 2 + 128 * d * 4 + d * 2
    main = (
        2 * v * h * 2 + h * 2 + hc_head  # embed, head, norm, hc_head
        + 43 * block + 3 * v * 6 * 8 + 40 * e * 4  # tid2eid on 3 hash layers, router bias on 40
        + 21 * c4 + 20 * c128
    )  # fmt: skip
    mtp = 3 * h * 2 + 2 * fp8(h, h) + hc_head + block + e * 4
    return main, mtp


def test_flash_weights_match_the_official_checkpoint_size(flash: DeepseekV4Config) -> None:
    main, mtp = flash_bytes_by_hand()
    assert main + mtp == OFFICIAL_FLASH_TOTAL_SIZE
    params, nbytes, groups = count_weights(flash, "official")
    assert nbytes == main == 156_015_698_140 == sum(b for _, b in groups)
    assert params == 284_334_567_511
    assert dict(groups)["routed_experts"] == 43 * 256 * (2 * fp4(2048, 4096) + fp4(4096, 2048))


def test_bf16_weights(flash: DeepseekV4Config) -> None:
    params, _, groups = count_weights(flash, "bf16")
    assert params == count_weights(flash, "official")[0]
    assert dict(groups)["routed_experts"] == 43 * 256 * 3 * 2048 * 4096 * 2
    assert dict(groups)["embed_head"] == 2 * 129280 * 4096 * 2
    with pytest.raises(ConfigError, match="weight_format"):
        count_weights(flash, "int4")


def test_flash_per_token_and_per_request_figures(flash: DeepseekV4Config) -> None:
    p = plan(flash, dtype="bfloat16", page_size=128, max_running=64, hbm_gib=64)
    assert p.num_layers == 43 and (len(flash.c4_layers), len(flash.c128_layers), flash.hca_ratio) == (
        21,
        20,
        128,
    )
    assert pool(p, "swa", "bytes_per_slot") == 43 * 512 * 2 == 44032
    assert buffer_per_token(p, "c4", "c4", 4) == 21 * 512 * 2 / 4 == 5376
    assert buffer_per_token(p, "c4", "c4_index", 4) == 21 * 128 * 2 / 4 == 1344
    assert buffer_per_token(p, "c128", "c128", 128) == 20 * 512 * 2 / 128 == 160
    assert p.kv.kv_bytes_per_token == 5376 + 1344 + 160 == 6880
    assert pool(p, "c4_state", "bytes_per_slot") == 21 * (2 * 2 * 512 + 2 * 2 * 128) * 4 == 215040
    assert pool(p, "c128_state", "bytes_per_slot") == 20 * 2 * 512 * 4 == 81920
    per_request = [pool(p, name, "slots_per_request") for name in ("swa", "c4_state", "c128_state")]
    assert per_request == [256, 256, 384]
    assert p.kv.bytes_per_request == 256 * 44032 + 256 * 215040 + 384 * 81920 == 97_779_712
    assert [pool(p, name, "slots") for name in ("swa", "c4_state", "c128_state")] == [64 * 256, 16384, 24576]


def test_flash_on_one_64_gib_device_does_not_fit(flash: DeepseekV4Config) -> None:
    p = plan(flash, hbm_gib=64)
    assert p.kv.budget_bytes == 64 * GIB
    assert p.kv.fixed_bytes == 156_015_698_140 + 64 * 97_779_712
    slots = (pool(p, "full", "slots"), pool(p, "c4", "slots"), pool(p, "c128", "slots"))
    assert (p.kv.token_budget_bytes, *slots, p.kv.kv_bytes) == (0, 0, 0, 0, 0)
    assert not p.kv.fits


def test_flash_on_eight_64_gib_devices(flash: DeepseekV4Config) -> None:
    p = plan(flash, hbm_gib=64, num_devices=8)
    assert p.weight_bytes_per_device == math.ceil(156_015_698_140 / 8) == 19_501_962_268
    left = 64 * GIB - 19_501_962_268 - 64 * 97_779_712
    assert p.kv.token_budget_bytes == left == 42_959_612_900
    unit = 128 * 128  # whole pages in c4 (unit / 4) and c128 (unit / 128)
    assert left // (unit * 6880) == 381
    slots = (pool(p, "full", "slots"), pool(p, "c4", "slots"), pool(p, "c128", "slots"))
    assert slots == (381 * unit, 381 * unit // 4, 381 * unit // 128) and p.kv.full_slots == 381 * unit
    assert p.kv.kv_bytes == p.kv.full_slots * 6880
    assert p.kv.total_bytes == p.kv.fixed_bytes + p.kv.kv_bytes <= p.kv.budget_bytes
    assert p.kv.fits


def test_dtype_scales_kv_but_not_state(flash: DeepseekV4Config) -> None:
    bf16, fp32 = plan(flash, dtype="bfloat16"), plan(flash, dtype="float32")
    assert pool(fp32, "swa", "bytes_per_slot") == 2 * pool(bf16, "swa", "bytes_per_slot")
    assert fp32.kv.kv_bytes_per_token == 2 * bf16.kv.kv_bytes_per_token
    assert pool(fp32, "c4_state", "bytes_per_slot") == pool(bf16, "c4_state", "bytes_per_slot")


def test_pro_figures() -> None:
    p = plan(load("pro"), num_devices=16, hbm_gib=64)
    assert pool(p, "swa", "bytes_per_slot") == 61 * 512 * 2
    assert p.kv.kv_bytes_per_token == 30 * 512 * 2 / 4 + 30 * 128 * 2 / 4 + 31 * 512 * 2 / 128 == 9848
    assert (pool(p, "c4_state", "slots"), pool(p, "c128_state", "slots")) == (16384, 24576)


def test_small_ratio_and_no_hca_layers(flash: DeepseekV4Config) -> None:
    tiny = dataclasses.replace(flash, num_layers=4, compress_ratios=(0, 4, 8, 4), sliding_window=8)
    p = plan(tiny, page_size=16, max_running=3, hbm_gib=1, weight_format="bf16")
    assert pool(p, "swa", "slots_per_request") == (math.ceil((8 - 1) / 16) + 1) * 16
    assert pool(p, "c128_state", "slots") == npu_state_pool_size(8, 16, 3) == 2 * 3 * 16
    assert token_unit(tiny.kv_layout, 16) == 16 * 8 and p.kv.full_slots % 128 == 0
    assert buffer_per_token(p, "c128", "c128", 8) == 1 * 512 * 2 / 8
    no_hca = dataclasses.replace(flash, compress_ratios=(0, 4) * 21 + (0,))
    q = plan(no_hca, num_devices=8)
    assert no_hca.hca_ratio == 0 and "c128" not in q.to_dict()["pools"]
    assert (pool(q, "c128", "slots"), pool(q, "c128_state", "slots")) == (0, 0)
    assert pool(q, "c4", "slots") == q.kv.full_slots // 4 > 0


def test_all_swa_model_is_capped_by_max_position_embeddings(flash: DeepseekV4Config) -> None:
    swa_only = dataclasses.replace(flash, compress_ratios=(0,) * 43, max_position_embeddings=4096)
    p = plan(swa_only, max_running=2, num_devices=8)
    assert (p.kv.kv_bytes_per_token, p.kv.full_slots, pool(p, "c4_state", "slots")) == (0, 2 * 4096, 0)


def test_to_dict_is_json(flash: DeepseekV4Config) -> None:
    d = json.loads(json.dumps(plan(flash).to_dict()))
    assert (d["pools"]["c4_state"]["slots"], d["pools"]["c128_state"]["slots"]) == (16384, 24576)
    assert d["pools"]["c4"]["buffers"]["c4"] == {"layers": 21, "width": 512, "dtype": "bfloat16"}
    assert d["kv_bytes_per_token"] == 6880 and d["model_type"] == "deepseek_v4"
    assert sum(d["weight_bytes_by_group"].values()) == d["weight_bytes"]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"page_size": 96}, "page_size"),
        ({"page_size": 0}, "page_size"),
        ({"max_running": 0}, "max_running"),
        ({"hbm_gib": 0}, "hbm_gib"),
        ({"hbm_gib": float("nan")}, "hbm_gib"),
        ({"num_devices": 0}, "num_devices"),
        ({"weight_format": "gguf"}, "weight_format"),
    ],
)
def test_bad_inputs_name_the_key(flash: DeepseekV4Config, kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        plan(flash, **kwargs)  # type: ignore[arg-type]


@settings(deadline=None, max_examples=40)
@given(
    page_size=st.sampled_from([16, 64, 128, 256]),
    max_running=st.integers(1, 256),
    hbm_gib=st.floats(1, 2048),
    num_devices=st.integers(1, 16),
)
def test_plan_invariants(page_size: int, max_running: int, hbm_gib: float, num_devices: int) -> None:
    model = load("flash")
    p = plan(model, page_size=page_size, max_running=max_running, hbm_gib=hbm_gib, num_devices=num_devices)
    kv, unit = p.kv, token_unit(model.kv_layout, page_size)
    assert kv.full_slots % unit == 0
    assert pool(p, "c4", "slots") % page_size == 0 and pool(p, "c128", "slots") % page_size == 0
    assert pool(p, "swa", "slots") == max_running * swa_slots_per_request(model, page_size)
    assert pool(p, "c4_state", "slots") == npu_state_pool_size(4, page_size, max_running)
    assert pool(p, "c128_state", "slots") == npu_state_pool_size(128, page_size, max_running)
    assert kv.total_bytes <= kv.budget_bytes or not kv.fits
    capped = kv.full_slots + unit > max_running * model.max_position_embeddings
    one_more_unit = kv.fixed_bytes + kv.kv_bytes + unit * 6880
    assert capped or one_more_unit > kv.budget_bytes  # no room was left unused


# ---------------------------------------------------------------- the KV sized by device memory


@settings(deadline=None, max_examples=60)
@given(budget_gib=st.floats(0, 200), seqs=st.integers(1, 256), page=st.sampled_from([64, 128]))
def test_kv_tokens_for_is_the_most_that_fits(budget_gib: float, seqs: int, page: int) -> None:
    flash = load("flash")
    engine = EngineConfig(device="cuda", page_size=page, max_num_seqs=seqs)
    budget = int(budget_gib * GIB)
    tokens = kv_tokens_for(flash, engine, budget)
    unit = token_unit(flash.kv_layout, page)
    assert tokens % unit == 0
    if tokens:
        assert pool_bytes(flash, engine.with_(max_total_tokens=tokens)) <= budget
    more = tokens + unit
    capped = more > seqs * flash.max_position_embeddings
    assert capped or pool_bytes(flash, engine.with_(max_total_tokens=more)) > budget


def test_sized_engine_keeps_a_given_capacity_and_sizes_the_rest() -> None:
    glm = config_from_json_file("glm-4.7-flash")
    engine = EngineConfig(device="cuda", max_num_seqs=32)
    assert sized_engine(engine.with_(max_total_tokens=4096), glm, (GIB, 80 * GIB)).kv_tokens == 4096
    assert sized_engine(engine, glm, None).kv_tokens == CPU_MAX_TOTAL_TOKENS  # the host's memory
    total, weights = 140 * GIB, 60 * GIB
    sized = sized_engine(engine, glm, (total - weights, total))
    budget = int(0.9 * total) - weights - activation_reserve(glm, engine)
    assert sized.kv_tokens == kv_tokens_for(glm, engine, budget) > 0
    assert pool_bytes(glm, sized) <= budget
    # plan says the same number for a device of that size holding those weights (bf16, as loaded)
    p = device_plan(spec_for("glm4_moe_lite"), glm, max_running=32, hbm_gib=140, weight_format="bf16",
                    gpu_memory_utilization=0.9)  # fmt: skip
    again = sized_engine(engine, glm, (total - p.weight_bytes_per_device, total))
    assert p.engine_max_total_tokens == again.kv_tokens
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        sized_engine(engine, glm, (total - 125 * GIB, total))  # 126 GiB allowed, 125 in use
    # a backend's op workspace (the CUDA MXFP4 prefill's decoded experts) comes off the KV's budget
    spared = sized_engine(engine, glm, (total - weights, total), workspace=12 * GIB)
    assert spared.kv_tokens == kv_tokens_for(glm, engine, budget - 12 * GIB) < sized.kv_tokens
    with pytest.raises(ConfigError, match=r"12\.0 GiB of op workspace"):
        sized_engine(engine, glm, (total - 118 * GIB, total), workspace=12 * GIB)


def test_plan_keeps_the_cuda_engines_mxfp4_prefill_workspace() -> None:
    """Official Flash over two devices: `plan` sizes the KV as the CUDA engine does, beside one layer's
    routed experts (a device's 128) decoded to bf16 for a prefill; bf16 weights keep no such room."""
    flash = config_from_json_file("deepseek-v4-flash")
    spec = spec_for("deepseek_v4")
    p = device_plan(spec, flash, max_running=16, hbm_gib=141, weight_format="official", num_devices=2,
                    gpu_memory_utilization=0.9)  # fmt: skip
    engine = EngineConfig(device="cuda", max_num_seqs=16)
    total = int(141 * GIB)
    workspace = 3 * 2 * 128 * 2048 * 4096  # w1, w3 and w2 of 128 experts, 2048 x 4096 each, bf16
    sized = sized_engine(engine, flash, (total - p.weight_bytes_per_device, total), workspace)
    assert p.engine_max_total_tokens == sized.kv_tokens > 0
    assert (
        p.engine_max_total_tokens
        < sized_engine(engine, flash, (total - p.weight_bytes_per_device, total)).kv_tokens
    )


def test_a_runner_sizes_its_pools_from_the_device_memory(tiny_model_dir: Path) -> None:
    """The tiny checkpoint on a backend whose transfers report a device with 3 MiB left for the KV."""
    from dsv4serve.backends import select
    from dsv4serve.backends.reference import PlainTransfers
    from dsv4serve.executor.runner import ModelRunner
    from dsv4serve.memory.allocator import KVAllocator
    from dsv4serve.models.registry import config_from_dir

    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=16)
    model = config_from_dir(tiny_model_dir)
    used = 50 << 20
    total = math.ceil((activation_reserve(model, engine) + used + (3 << 20)) / 0.9)

    class Device(PlainTransfers):
        def memory(self, device: Any) -> tuple[int, int]:
            return total - used, total

    runner = ModelRunner(tiny_model_dir, engine, ops=dataclasses.replace(select("cpu"), transfers=Device()))
    want = kv_tokens_for(model, engine, int(0.9 * total) - used - activation_reserve(model, engine))
    assert 0 < runner.engine.kv_tokens == want < model.max_position_embeddings * engine.max_num_seqs
    assert pool_bytes(model, runner.engine) <= 3 << 20
    usage = KVAllocator(model, runner.engine, runner.sizes).usage()
    assert usage["full"].capacity >= want  # whole pages
