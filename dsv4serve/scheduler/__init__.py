"""Pure scheduling policy: request state machine, batch planning, preemption (no torch, no trio)."""

from dsv4serve.scheduler.policy import SchedulerCore
from dsv4serve.scheduler.request import (
    CancelOutcome,
    CancelStatus,
    EndReason,
    Finished,
    RefuseOutcome,
    Request,
    RequestState,
    StepOutcome,
)

__all__ = [
    "CancelOutcome",
    "CancelStatus",
    "EndReason",
    "Finished",
    "RefuseOutcome",
    "Request",
    "RequestState",
    "SchedulerCore",
    "StepOutcome",
]
