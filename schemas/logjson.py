"""Structured logs (``ELASTIC_LOG_FORMAT=json``): each record one JSON object on one line.

Shared by the control plane and the rank runtime (standard library only). A record carries
``time`` (UTC, ISO 8601), ``level``, ``logger`` and ``message``, and ``job``, ``member`` and
``incident`` when it concerns one: from the record's ``extra=`` (``log.info(..., extra=about(
job=...))``) or, for every record logged within it, from ``concerning(...)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, TextIO

#: `text` (the default) or `json`: each log record one JSON object on a line (time, level,
#: logger, message, and the job, member and incident the record concerns).
LOG_FORMAT_ENV = "ELASTIC_LOG_FORMAT"
#: The fields a record may carry about what it concerns, in the order written.
CONTEXT_FIELDS = ("job", "member", "incident")
#: The formats ``ELASTIC_LOG_FORMAT`` takes.
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_context: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "elastic_log_context", default=()
)


def about(job: object = None, member: object = None, incident: object = None) -> dict[str, Any]:
    """``extra=`` for a record that concerns a job (a member, an incident); Nones left out."""
    given = {"job": job, "member": member, "incident": incident}
    return {k: str(v) for k, v in given.items() if v is not None}


@contextlib.contextmanager
def concerning(
    job: object = None, member: object = None, incident: object = None
) -> Iterator[None]:
    """Every record logged within (in this task or thread) concerns these."""
    token = _context.set(tuple({**dict(_context.get()), **about(job, member, incident)}.items()))
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    """One JSON object a record: time, level, logger, message, [job, member, incident],
    [exception]."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = dict(_context.get())
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None) or context.get(name)
            if value is not None:
                out[name] = str(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def env_format() -> str:
    """The format ``ELASTIC_LOG_FORMAT`` asks for (``text`` when unset or not a format)."""
    fmt = os.environ.get(LOG_FORMAT_ENV, "text").strip().lower()
    return fmt if fmt in FORMATS else "text"


def configure(
    level: str | int = "INFO", fmt: str = "text", *, stream: TextIO | None = None,
    text_format: str = TEXT_FORMAT,
) -> None:  # fmt: skip
    """Configure the root logger once (like ``logging.basicConfig``): text or JSON lines."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(FORMATS)}")
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(text_format))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
