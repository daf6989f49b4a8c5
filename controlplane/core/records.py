"""What the log holds: an event with the position and time the store gave it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from schemas.events import EnvelopeBase


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event as committed to the log."""

    position: int
    recorded_at: datetime
    event: EnvelopeBase


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Input that could not become an event, kept with the reason."""

    reason: str
    raw: bytes
    subject: str = ""
    #: JetStream stream sequence, the idempotency key of a dead letter; None outside NATS.
    stream_seq: int | None = None
    job_id: str | None = None
    #: Set when a well-formed event was refused (e.g. by the sequence rules); a second key.
    event_id: str | None = None
