"""structlog setup: JSON lines on stderr, configured once by the entry point.

Actors bind `actor=`, per-request lines `rid=`, per-step lines `step=`; nothing here holds state
beyond structlog's own configuration.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")
_configured = {"level": "warning"}  # what `configure` was last given (an engine-core process copies it)


def configure(level: str = "info", stream: TextIO | None = None) -> None:
    """Render every structlog line as one JSON object on `stream` (default: sys.stderr), written whole:
    the object and its newline in one write (print's two writes let the lines of the processes that
    share a stderr pipe, fronts, cores and ranks, run into each other). A pipe keeps writes of up to
    PIPE_BUF (4 KiB on Linux) whole; a longer line (a traceback) may still interleave."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level: {level!r} is not one of {LEVELS}")
    _configured["level"] = level.lower()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.WriteLoggerFactory(file=stream if stream is not None else sys.stderr),
        cache_logger_on_first_use=False,
    )


def configure_default() -> None:
    """For embedders who configured nothing: warnings and errors as JSON on stderr, never stdout."""
    if not structlog.is_configured():
        configure("warning")


def current_level() -> str:
    return _configured["level"]
