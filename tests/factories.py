"""Builders of valid events for tests."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.core.records import StoredEvent
from schemas.events import EVENT_ADAPTER, EnvelopeBase

T0 = datetime(2026, 1, 1, tzinfo=UTC)

MEMBER_JOINED = {
    "node": "n0",
    "rack": "r0",
    "host": "h0",
    "pid": 1,
    "role": "worker",
    "device": "cpu",
    "backup_endpoint": "h0:7000",
}


class Events:
    """Makes envelopes with per-source seqs, like well-behaved producers."""

    def __init__(self, job_id: str = "job1", incarnation: str = "inc1") -> None:
        self.job_id = job_id
        self.incarnation = incarnation
        self._seq: dict[tuple[str, str], itertools.count[int]] = {}

    def make(
        self,
        type_: str,
        payload: dict[str, Any],
        *,
        source: str = "n0/m0",
        seq: int | None = None,
        incarnation: str | None = None,
        event_id: str | None = None,
        generation: int = 0,
        job_id: str | None = None,
        at: datetime = T0,
    ) -> EnvelopeBase:
        inc = incarnation or self.incarnation
        if seq is None:
            seq = next(self._seq.setdefault((source, inc), itertools.count(1)))
        return EVENT_ADAPTER.validate_python(
            {
                "event_id": event_id or str(uuid.uuid4()),
                "job_id": job_id or self.job_id,
                "type": type_,
                "v": 1,
                "source": source,
                "incarnation": inc,
                "seq": seq,
                "generation": generation,
                "emitted_at": at,
                "payload": payload,
            },
            strict=False,
        )

    def joined(self, member: str, node: str = "n0", rack: str = "r0", **kw: Any) -> EnvelopeBase:
        payload = {**MEMBER_JOINED, "node": node, "rack": rack, "host": f"h-{node}"}
        payload.update(kw.pop("payload", {}))
        return self.make("member.joined", payload, source=f"{node}/{member}", **kw)

    def heartbeat(
        self, member: str, node: str = "n0", step: int = 0, phase: str = "train", **kw: Any
    ) -> EnvelopeBase:
        return self.make(
            "member.heartbeat", {"step": step, "phase": phase}, source=f"{node}/{member}", **kw
        )

    def cp(self, type_: str, payload: dict[str, Any], **kw: Any) -> EnvelopeBase:
        return self.make(type_, payload, source="controlplane", **kw)


def recorded(
    events: list[EnvelopeBase], *, start: int = 1, every_s: float = 1.0
) -> list[StoredEvent]:
    """Give events consecutive positions and recorded times ``every_s`` apart."""
    return [
        StoredEvent(start + i, T0 + timedelta(seconds=every_s * (start + i)), e)
        for i, e in enumerate(events)
    ]
