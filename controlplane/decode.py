"""Turn a raw bus message into an event, or into a dead letter with a reason a person can read."""

from __future__ import annotations

from pydantic import ValidationError

from controlplane.core.records import DeadLetter
from controlplane.subjects import EventSubject, parse_event_subject
from schemas.common import MAX_EVENT_BYTES
from schemas.events import CONTROLPLANE_EVENT_TYPES, EVENT_ADAPTER, SCHEMA_VERSIONS, EnvelopeBase

_RAW_KEPT = MAX_EVENT_BYTES  # an oversized message is kept truncated to this


_SUBJECTS: dict[str, EventSubject | None] = {}
_SUBJECTS_KEPT = 65_536


def _subject(subject: str) -> EventSubject | None:
    # Subjects repeat (one per member and event type): parse each once.
    try:
        return _SUBJECTS[subject]
    except KeyError:
        if len(_SUBJECTS) >= _SUBJECTS_KEPT:
            _SUBJECTS.clear()
        parsed = _SUBJECTS[subject] = parse_event_subject(subject)
        return parsed


def decode(subject: str, data: bytes, stream_seq: int | None = None) -> EnvelopeBase | DeadLetter:
    """Validate one message published on ``subject``; never raises on bad input."""
    parsed = _subject(subject)
    job_id = parsed.job_id if parsed else None

    def dead(reason: str) -> DeadLetter:
        return DeadLetter(
            reason=reason,
            raw=data[:_RAW_KEPT],
            subject=subject,
            stream_seq=stream_seq,
            job_id=job_id,
        )

    if len(data) > MAX_EVENT_BYTES:
        return dead(f"oversized: {len(data)} bytes, the limit is {MAX_EVENT_BYTES}")
    if parsed is None:
        return dead("not an event subject: expected elastic.evt.<job>.<node>.<member>.<type>")
    try:
        event = EVENT_ADAPTER.validate_json(data)
    except ValidationError as exc:
        return dead(explain(exc))
    if event.type in CONTROLPLANE_EVENT_TYPES:
        return dead(f"forged: {event.type} is recorded only by the control plane")
    if event.source != parsed.source:
        return dead(
            f"forged source: envelope says {event.source!r}, subject binds {parsed.source!r}"
        )
    if event.job_id != parsed.job_id:
        return dead(f"job mismatch: envelope says {event.job_id!r}, subject says {parsed.job_id!r}")
    if event.type != parsed.type:
        return dead(f"type mismatch: envelope says {event.type!r}, subject says {parsed.type!r}")
    if event.type == "member.joined" and event.payload.node != parsed.node:
        return dead(f"forged node: joined as {event.payload.node!r} on node {parsed.node!r}")
    return event


def explain(exc: ValidationError) -> str:
    """The first thing wrong with an envelope, in words (a dead letter's reason)."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    kind = first["type"]
    loc = first["loc"]
    if kind == "json_invalid":
        return f"not JSON: {first['msg']}"
    if kind in {"json_type", "model_type", "model_attributes_type", "dict_type"} and not loc:
        return "not a JSON object"
    if kind == "union_tag_invalid":
        return f"unknown event type: {first.get('ctx', {}).get('tag')!r}"
    if kind == "union_tag_not_found":
        return "missing event type"
    if len(loc) == 2 and loc[1] == "v" and kind == "literal_error":
        known = sorted(SCHEMA_VERSIONS.get(str(loc[0]), ()))
        return f"unknown schema version of {loc[0]}: this build reads {known}"
    where = ".".join(str(p) for p in loc[1:]) or "envelope"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"schema violation at {where}: {first['msg']}{more}"
