"""One request's scheduling state, and the records the scheduler core hands back to its actor."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, TypeAlias

from dsv4serve.protocol import SampledToken, SamplingParams, StepItem

# The protocol's FinishReason plus "error" (the actor answers those with FailRequest, not done).
EndReason: TypeAlias = Literal["stop", "length", "cancelled", "error"]


class RequestState(enum.Enum):
    WAITING = "waiting"  # holds no memory: never admitted, or preempted
    RUNNING = "running"  # holds memory (or is being admitted in an in-flight step): prefill or decode
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Finished:
    """A request that left the scheduler; its rid is unknown to the core from now on.

    output_token_ids: every generated id, including the EOS / stop token that ended it (then also
        `stop_token_id`); that last id belongs to the ids but not to the text.
    holds_memory: the allocator holds cache for it, so the actor must send `Free(rid)`.
    message: why, for finish_reason "error" raised by the core (empty for executor failures).
    """

    rid: str
    finish_reason: EndReason
    output_token_ids: tuple[int, ...]
    num_preemptions: int
    holds_memory: bool
    stop_token_id: int | None = None
    message: str = ""


class CancelStatus(enum.Enum):
    FINISHED = "finished"  # ended now: `CancelOutcome.finished` says what to report and free
    DEFERRED = "deferred"  # in an in-flight step: it ends when that step completes (or is refused)
    UNKNOWN = "unknown"  # no such request (never added, or already finished)


@dataclass(frozen=True, slots=True)
class CancelOutcome:
    status: CancelStatus
    finished: Finished | None = None


@dataclass(frozen=True, slots=True)
class RefuseOutcome:
    """preempted: rids to `Free(rid, "preempted")` (now WAITING, recomputed later).
    finished: requests that ended (a deferred cancel/stop, or "error": cannot fit even alone).
    tokens: the held last tokens of finished requests whose end a refused lookahead step kept waiting."""

    preempted: tuple[str, ...] = ()
    finished: tuple[Finished, ...] = ()
    tokens: tuple[SampledToken, ...] = ()


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """tokens: the sampled tokens kept, in plan order (exactly the new output ids to stream);
    the token of a request whose cancel/stop was deferred to this step is dropped.
    finished: requests that ended with this step."""

    tokens: tuple[SampledToken, ...] = ()
    finished: tuple[Finished, ...] = ()


@dataclass(slots=True, eq=False)
class Request:
    """Scheduling state. `num_computed` counts tokens whose KV is cached (advanced when a step is
    done); `inflight_step` is the oldest in-flight step that uses it, if any; `lookahead_step` a later
    one holding its lookahead decode (whose input is the token `inflight_step` samples)."""

    rid: str
    arrival: int
    prompt_len: int
    all_token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int]
    sampling: SamplingParams
    state: RequestState = RequestState.WAITING
    num_computed: int = 0
    num_preemptions: int = 0
    inflight_step: int | None = None
    lookahead_step: int | None = None
    pending_end: EndReason | None = None  # an end (cancel, stop, or found by a step) waiting for its steps
    pending_token: SampledToken | None = None  # the last token of an end found by a step, held with it
    short_of_memory: bool = False  # RUNNING and refused since it last ran: admissions wait for it
    admitted_step: int = -1  # the step that last admitted it (WAITING -> RUNNING)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.all_token_ids) - self.num_computed

    @property
    def being_admitted(self) -> bool:
        """In flight in the step that admitted it: it may hold no memory yet."""
        return self.inflight_step is not None and self.inflight_step == self.admitted_step

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.all_token_ids[self.prompt_len :])

    def queue_key(self) -> tuple[bool, int]:
        """Waiting order: preempted requests first, then by arrival."""
        return (self.num_preemptions == 0, self.arrival)

    def next_item(self, budget: int) -> StepItem:
        """The next chunk of at most `budget` uncomputed tokens; it samples iff it reaches the end."""
        assert budget > 0 and self.num_uncomputed > 0, (self.rid, budget, self.num_uncomputed)
        start = self.num_computed
        end = min(self.num_tokens, start + budget)
        sample = end == self.num_tokens
        history = tuple(self.all_token_ids) if sample and self.sampling.processes_logits else None
        return StepItem(
            rid=self.rid,
            prefix_len=start,
            token_ids=tuple(self.all_token_ids[start:end]),
            sample=sample,
            sampling=self.sampling,
            history=history,
            prompt_len=self.prompt_len if history is not None else 0,
        )

    def end_reason(self, max_model_len: int) -> EndReason | None:
        """Checked right after a token is appended: stop token first, then the two lengths."""
        if self.all_token_ids[-1] in self.stop_token_ids:
            return "stop"
        if self.num_tokens - self.prompt_len >= self.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def stop_token_id(self, reason: EndReason) -> int | None:
        """The stop token that ended a deferred "stop" (None for a stop string or a cancel)."""
        return self.pending_token.token_id if reason == "stop" and self.pending_token else None

    def finished(
        self, reason: EndReason, holds_memory: bool, stop_token_id: int | None = None, message: str = ""
    ) -> Finished:
        return Finished(
            rid=self.rid,
            finish_reason=reason,
            output_token_ids=self.output_token_ids,
            num_preemptions=self.num_preemptions,
            holds_memory=holds_memory,
            stop_token_id=stop_token_id,
            message=message,
        )
