"""Re-decide a recorded log: does the decider, given what the members said, decide the same?

The service decides on the job's view folded up to the log's last position, at a time it
records as the decisions' ``emitted_at``, and appends them as one batch behind that position
(optimistic concurrency makes sure nothing came in between). So for each recorded batch of
decisions, the view folded from every earlier event of the job, and ``decide`` at the batch's
``emitted_at``, must give the same events, ids included. Pure: the log is an argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.core.decide import Context, Decided, decide
from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView
from schemas.common import CONTROLPLANE_SOURCE


@dataclass(frozen=True, slots=True)
class Redecided:
    """One recorded batch of decisions and what the decider decides in its place."""

    recorded: tuple[StoredEvent, ...]
    redecided: tuple[Decided, ...]

    @property
    def matches(self) -> bool:
        return _comparable_recorded(self.recorded) == _comparable_decided(self.redecided)


def decision_batches(log: Sequence[StoredEvent]) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of the control plane's batches in one job's log:
    consecutive decisions of one decider run with one ``emitted_at``."""
    out = []
    i = 0
    while i < len(log):
        first = log[i].event
        if first.source != CONTROLPLANE_SOURCE:
            i += 1
            continue
        j = i + 1
        while j < len(log):
            e = log[j].event
            if (
                e.source != CONTROLPLANE_SOURCE
                or e.emitted_at != first.emitted_at
                or e.incarnation != first.incarnation
            ):
                break
            j += 1
        out.append((i, j))
        i = j
    return out


def redecide(log: Sequence[StoredEvent], context: Context | None = None) -> list[Redecided]:
    """Re-run the decider before every recorded batch of one job's log (in position order).

    ``context`` defaults to the one each batch was decided with: the rendezvous base is an
    input like the clock (it changes with the leader), read from the batch's
    ``generation.started`` when it has one.
    """
    out: list[Redecided] = []
    view: JobView | None = None
    current = context if context is not None else Context()
    done = 0
    for start, end in decision_batches(log):
        if start > done:
            view = fold(view, log[done:start])
        batch = tuple(log[start:end])
        if context is None:
            current = _recorded_context(batch) or current
        now = batch[0].event.emitted_at
        decided = decide(view, now, current) if view is not None else []
        out.append(Redecided(batch, tuple(decided)))
        view = fold(view, batch)  # go on from what was recorded
        done = end
    return out


def _recorded_context(batch: Sequence[StoredEvent]) -> Context | None:
    for stored in batch:
        event = stored.event
        if event.type == "generation.started":
            payload = event.payload
            suffix = f"/{event.job_id}/{payload.generation}"
            if payload.rendezvous.endswith(suffix):
                return Context(rendezvous=payload.rendezvous[: -len(suffix)])
            return Context()
    return None


def _comparable_recorded(batch: Sequence[StoredEvent]) -> list[tuple[str, str, Any]]:
    return [
        (s.event.event_id, s.event.type, s.event.payload.model_dump(mode="json")) for s in batch
    ]


def _comparable_decided(batch: Sequence[Decided]) -> list[tuple[str, str, Any]]:
    return [(d.event_id, d.type, d.payload.model_dump(mode="json")) for d in batch]
