"""The job's state machine (DESIGN.md): which transitions a decision may record."""

from __future__ import annotations

from schemas.common import JobState

_S = JobState

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.PENDING: frozenset({_S.RUNNING, _S.STOPPED}),
    # RUNNING -> REALLOCATING: a planned growth at a backup boundary (no fault).
    _S.RUNNING: frozenset({_S.DEGRADED, _S.REALLOCATING, _S.COMPLETED}),
    _S.DEGRADED: frozenset({_S.RUNNING, _S.REALLOCATING, _S.STOPPED}),
    _S.REALLOCATING: frozenset({_S.RECOVERING, _S.STOPPED}),
    # A fault while recovering re-opens the decision inside the same incident (a cascade).
    _S.RECOVERING: frozenset({_S.RUNNING, _S.DEGRADED, _S.REALLOCATING, _S.STOPPED}),
    _S.COMPLETED: frozenset(),
    _S.STOPPED: frozenset(),
}

TERMINAL: frozenset[JobState] = frozenset({_S.COMPLETED, _S.STOPPED})


def can_transition(current: JobState, target: JobState) -> bool:
    """Return whether the state machine allows ``current -> target``."""
    return target in TRANSITIONS[current]
