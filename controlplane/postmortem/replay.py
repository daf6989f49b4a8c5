"""Replay a log file with no server: fold it into a job's view up to a point, or re-decide
it under another policy (the pure part is ``controlplane.core.replay.counterfactual``)."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView

#: Events folded at a time: the fold copies a view's top-level containers once per call.
FOLD_CHUNK = 4096


class ReplayError(ValueError):
    """A replay that cannot be done as asked (no such job, several jobs, a bad --until)."""


Until = int | datetime


def parse_until(text: str) -> Until:
    """``--until``: a position (an integer), or a time (ISO 8601; UTC when it has no offset)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ReplayError(
            f"--until {text!r}: expected a position (an integer) or an ISO 8601 time,"
            " e.g. 2026-01-01T12:00:05Z"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def parse_overrides(text: str) -> dict[str, object]:
    """``a=1,b=2.5,c={"x":1}`` -> {"a": 1, "b": 2.5, "c": {"x": 1}}: values are JSON where
    they parse as JSON, else strings; commas inside braces or brackets do not split."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in parts)):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ReplayError(f"--policy entry {part!r}: expected key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    if not out:
        raise ReplayError("--policy: expected key=value[,key=value...]")
    return out


@contextmanager
def relaxed_gc() -> Iterator[None]:
    """Collect less often while replaying: a replay allocates many short-lived objects and a
    default-threshold collector costs about a third of it (``bench replay``)."""
    before = gc.get_threshold()
    gc.set_threshold(50_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _one_job(events: Iterable[StoredEvent], job_id: str | None) -> Iterator[StoredEvent]:
    """The events of ``job_id``, or of the only job of the log (an error at the first event
    of a second job)."""
    if job_id is not None:
        for stored in events:
            if stored.event.job_id == job_id:
                yield stored
        return
    first: str | None = None
    for stored in events:
        job = stored.event.job_id
        if first is None:
            first = job
        elif job != first:
            raise ReplayError(
                f"the log holds several jobs ({first}, {job}, ...): choose one with --job"
            )
        yield stored


@dataclass(slots=True)
class Replayed:
    """A job's view folded from a log up to a point."""

    job_id: str
    view: JobView
    #: Events of the job folded (those after the point are not).
    events: int
    #: True when the log went on after the point (``--until``).
    stopped: bool = False


def replay_log(
    events: Iterable[StoredEvent],
    *,
    job_id: str | None = None,
    until: Until | None = None,
    chunk: int = FOLD_CHUNK,
) -> Replayed:
    """Fold one job's events (``job_id``, or the log's only job) up to position or time
    ``until`` inclusive (None: all of them): the view the control plane had then."""
    view: JobView | None = None
    pending: list[StoredEvent] = []
    count = 0
    stopped = False
    for stored in _one_job(events, job_id):
        if until is not None and (
            stored.position > until if isinstance(until, int) else stored.recorded_at > until
        ):
            stopped = True
            break
        pending.append(stored)
        if len(pending) >= chunk:
            view = fold(view, pending)
            count += len(pending)
            pending = []
    if pending:
        view = fold(view, pending)
        count += len(pending)
    if view is None:
        what = f"job {job_id!r}" if job_id is not None else "any job"
        where = f" up to {_until_text(until)}" if until is not None else ""
        raise ReplayError(f"the log holds no event of {what}{where}")
    return Replayed(view.job_id, view, count, stopped)


def job_events(events: Iterable[StoredEvent], job_id: str | None = None) -> list[StoredEvent]:
    """Every event of one job (``job_id``, or the log's only job), for a counterfactual."""
    out = list(_one_job(events, job_id))
    if not out:
        what = f"job {job_id!r}" if job_id is not None else "any job"
        raise ReplayError(f"the log holds no event of {what}")
    return out


def _until_text(until: Until) -> str:
    return f"position {until}" if isinstance(until, int) else until.isoformat()


__all__ = [
    "ReplayError",
    "Replayed",
    "job_events",
    "parse_overrides",
    "parse_until",
    "relaxed_gc",
    "replay_log",
]
