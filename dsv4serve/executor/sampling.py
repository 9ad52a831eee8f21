"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen-token and top logprobs.

Randomness is counter-based: the uniform draw for (seed, position, token) is a hash of the three,
so a request's samples depend only on its own seed and positions, never on the batch it shares, on
preemption, or on the device. Sampling uses the exponential race (argmax p / E, E ~ Exp(1)), which
draws exactly from p, with fixed shapes and no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
TOP_K_OFF = 2**31 - 1  # any larger top_k keeps the whole vocabulary too (and must not wrap to 32 bits)


def top_k_of(k: int) -> int:
    """A request's top_k as the sampler's int: a top_k at or above the vocabulary size means "off"."""
    return min(k, TOP_K_OFF)


@dataclass(frozen=True)
class SamplingBatch:
    """Per sampled row (S,): temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: torch.Tensor  # (S,) fp32
    top_p: torch.Tensor  # (S,) fp32
    top_k: torch.Tensor  # (S,) int64
    seed: torch.Tensor  # (S,) int64
    position: torch.Tensor  # (S,) int64 position of the token being sampled
    all_greedy: bool = False  # host-known: skip the random draw
    needs_filter: bool = True  # host-known: some row uses top-k or top-p
    want_logprobs: bool = True  # host-known: some row asked for logprobs (else skip the logsumexp)
    num_top: int = 0  # host-known: top logprobs per row to report (0: no sort of the vocabulary)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int64 tensors (all products stay below 2**63)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """(S, V) uniforms in (0, 1) determined by (seed, position, token id) alone."""
    token = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    key = _hash32(_hash32(seed) ^ position)  # (S,)
    bits = _hash32(key[:, None] ^ _hash32(token + 0x9E3779B)[None, :])  # (S, V)
    # in float32 the top 2**-25 of (0, 1) rounds to 1.0, whose -log is 0: a zero-probability token
    # would race 0 / 0 = NaN and win the argmax; the largest float32 below 1 keeps it at 0
    return (bits.double() + 0.5).div(2.0**32).float().clamp(max=1.0 - 2.0**-24)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p (nucleus) sets with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= before > top_p[:, None]  # the first token is always kept
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def argmax_rows(x: torch.Tensor, chunks: int = 128) -> torch.Tensor:
    """Row argmax (the first maximum), in two passes for wide rows: a GPU reduces one row per block,
    and one block over a 129k vocabulary is slow. x: (S, V) -> (S,) int64."""
    S, V = x.shape
    if V % chunks or 32 * chunks > V:
        return x.argmax(dim=-1)
    values, index = x.view(S, chunks, V // chunks).max(dim=-1)  # (S, chunks): first max of each chunk
    best = values.argmax(dim=-1)  # the first chunk holding the row's maximum
    return best * (V // chunks) + index.gather(1, best[:, None]).squeeze(1)


def sample(
    logits: torch.Tensor, params: SamplingBatch, chosen_from: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (S, V) -> (token ids (S,), logprobs of those tokens under the model's distribution (S,)).

    `chosen_from`: the logits after processing (penalties, bias), which tokens are drawn from; the
    logprobs stay the model's. Without `want_logprobs` the logprobs are zeros: no full-vocabulary
    logsumexp is run.
    """
    logits = logits.float()
    model_logits, logits = logits, (logits if chosen_from is None else chosen_from.float())

    def logprob(tokens: torch.Tensor) -> torch.Tensor:
        if not params.want_logprobs:
            return torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        return model_logits.gather(1, tokens[:, None]).squeeze(1) - log_normalizer(model_logits)

    greedy = argmax_rows(logits)
    if params.all_greedy:
        return greedy, logprob(greedy)
    scaled = logits / params.temperature.clamp(min=1e-6)[:, None]
    if params.needs_filter:
        scaled = _filter(scaled, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    race = probs / -torch.log(uniform(params.seed, params.position, logits.shape[-1]))
    tokens = torch.where(params.temperature > 0, argmax_rows(race), greedy)
    return tokens, logprob(tokens)


def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """log Z of each fp32 row (S, V) -> (S,): a logprob is logit - log Z (no (S, V) log_softmax)."""
    return torch.logsumexp(logits, dim=-1)


def top_logprobs(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (S, V) -> the n most likely token ids of each row and their logprobs, (S, n) each.

    The logprobs are `sample`'s (logit - log Z, bit for bit), most likely first; exact ties go to the
    lowest id (a stable sort: `topk`'s choice among equal values is unspecified).
    """
    logits = logits.float()
    values, ids = logits.sort(dim=-1, descending=True, stable=True)  # (S, V)
    return ids[:, :n], values[:, :n] - log_normalizer(logits)[:, None]
