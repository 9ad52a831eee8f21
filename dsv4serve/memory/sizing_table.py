"""`plan`'s table: a SizingPlan as text whose every figure can be checked by hand."""

from __future__ import annotations

from dsv4serve.memory.sizing import POOLS, SizingPlan


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
