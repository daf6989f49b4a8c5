"""Turn a raw bus message into an event, or into a dead letter with a reason a person can read."""

from __future__ import annotations

import dataclasses
import logging

from pydantic import ValidationError

from controlplane.core.liveness import Beats
from controlplane.core.records import DeadLetter
from schemas.common import INT64_MAX, INT64_MIN, MAX_EVENT_BYTES
from schemas.events import (
    CONTROLPLANE_EVENT_TYPES,
    EVENT_ADAPTER,
    SCHEMA_VERSIONS,
    EnvelopeBase,
    HeartbeatMessage,
    NodeHeartbeatMessage,
)
from schemas.subjects import (
    LAUNCHER_MEMBER,
    EventSubject,
    parse_event_subject,
    parse_heartbeat_subject,
)

log = logging.getLogger(__name__)

_RAW_KEPT = MAX_EVENT_BYTES  # an oversized message is kept truncated to this
#: The longest reason kept (the store's own refusals quote the row they refused).
MAX_REASON = 1024
#: The longest subject kept (NATS allows long ones; a dead letter needs only its start).
_SUBJECT_KEPT = 1024


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
    """Validate one message published on ``subject``; never raises, whatever the bytes."""
    try:
        return _decode(subject, data, stream_seq)
    except Exception as exc:  # a bug here must not stop the ingest: the input is kept
        log.exception("decoding a message on %r failed", subject[:_SUBJECT_KEPT])
        return DeadLetter(
            reason=printable(f"undecodable: {type(exc).__name__}: {exc}"),
            raw=bytes(data[:_RAW_KEPT]),
            subject=subject,
            stream_seq=stream_seq,
        )


def _decode(subject: str, data: bytes, stream_seq: int | None) -> EnvelopeBase | DeadLetter:
    parsed = _subject(subject)
    job_id = parsed.job_id if parsed else None

    def dead(reason: str) -> DeadLetter:
        return DeadLetter(
            reason=printable(reason),
            raw=data[:_RAW_KEPT],
            subject=subject,
            stream_seq=stream_seq,
            job_id=job_id,
        )

    if len(data) > MAX_EVENT_BYTES:
        return dead(f"oversized: {len(data)} bytes, the limit is {MAX_EVENT_BYTES}")
    if parsed is None:
        return dead(
            "not an event subject: expected elastic.evt.<job>.<node>.<role>.<type>"
            " (role: member or launcher)"
        )
    try:
        event = EVENT_ADAPTER.validate_json(data)
    except ValidationError as exc:
        return dead(explain(exc))
    if event.type in CONTROLPLANE_EVENT_TYPES:
        return dead(f"forged: {event.type} is recorded only by the control plane")
    if not parsed.binds(event.source):
        return dead(
            f"forged source: envelope says {event.source!r}, subject binds {parsed.bound!r}"
        )
    if event.job_id != parsed.job_id:
        return dead(f"job mismatch: envelope says {event.job_id!r}, subject says {parsed.job_id!r}")
    if event.type != parsed.type:
        return dead(f"type mismatch: envelope says {event.type!r}, subject says {parsed.type!r}")
    if event.type == "member.joined" and event.payload.node != parsed.node:
        return dead(f"forged node: joined as {event.payload.node!r} on node {parsed.node!r}")
    return event


def decode_heartbeats(subject: str, data: bytes) -> Beats | str:
    """Validate one heartbeat message published on ``subject``: a member's own
    (``elastic.hb.<job>.<node>.member``, ``member.heartbeat``) or its node's
    (``elastic.hb.<job>.<node>.launcher``, ``node.heartbeat``: the launcher relays its
    members'). The beats it carries, or why it is refused. Bound to its subject like an event
    (the job, the source); a node's message speaks only for members of that node (the taker
    checks each joined there). Never raises, whatever the bytes."""
    try:
        if len(data) > MAX_EVENT_BYTES:
            return f"oversized: {len(data)} bytes, the limit is {MAX_EVENT_BYTES}"
        parsed = parse_heartbeat_subject(subject)
        if parsed is None:
            return (
                "not a heartbeat subject: expected elastic.hb.<job>.<node>.<role>"
                " (role: member or launcher)"
            )
        message: HeartbeatMessage | NodeHeartbeatMessage
        try:
            if parsed.role == LAUNCHER_MEMBER:
                message = NodeHeartbeatMessage.model_validate_json(data)
            else:
                message = HeartbeatMessage.model_validate_json(data)
        except ValidationError as exc:
            return _explain_heartbeat(exc)
        if not parsed.binds(message.source):
            return f"forged source: message says {message.source!r}, subject binds {parsed.bound!r}"
        if message.job_id != parsed.job_id:
            return f"job mismatch: message says {message.job_id!r}, subject says {parsed.job_id!r}"
        job, node = parsed.job_id, parsed.node
        if isinstance(message, HeartbeatMessage):
            p = message.payload
            compute, since, ready = p.compute_seconds, p.since_step_seconds, p.ready_seconds
            member = message.source.partition("/")[2]
            return Beats(job, node, [member], [message.incarnation], [message.generation],
                         [p.step], [p.phase], [round(p.step_seconds * 1000)], [0],
                         None if compute is None else [round(compute * 1000)],
                         None if since is None else [round(since * 1000)],
                         None if ready is None else [round(ready * 1000)])  # fmt: skip
        m = message
        if LAUNCHER_MEMBER in m.members:
            return "forged: a launcher relays its members' heartbeats, not its own"
        return Beats(job, node, m.members, m.incarnation, m.generation, m.step, m.phase,
                     m.step_ms, m.age_ms, m.compute_ms, m.since_step_ms,
                     m.ready_ms)  # fmt: skip
    except Exception as exc:  # a bug here must not stop the listener
        log.exception("decoding a heartbeat on %r failed", subject[:_SUBJECT_KEPT])
        return printable(f"undecodable: {type(exc).__name__}: {exc}")


def _explain_heartbeat(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"not JSON: {first['msg']}"
    where = ".".join(str(p) for p in first["loc"]) or "message"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return printable(f"schema violation at {where}: {first['msg']}{more}")


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
    msg = first["msg"]
    bound = first.get("ctx", {})
    if (kind == "less_than_equal" and bound.get("le") == INT64_MAX) or (
        kind == "greater_than_equal" and bound.get("ge") == INT64_MIN
    ):
        msg += " (outside int64, what PostgreSQL's bigint holds)"
    elif kind == "string_unicode":
        msg = "not valid Unicode (a lone surrogate): PostgreSQL text cannot hold it"
    return f"schema violation at {where}: {msg}{more}"


def printable(text: str, limit: int = MAX_REASON) -> str:
    """``text`` as PostgreSQL's ``text`` can hold it: NUL and lone surrogates escaped,
    cut to ``limit`` characters."""
    text = text[:limit]
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _int64_or_none(value: int | None) -> int | None:
    return value if value is None or INT64_MIN <= value <= INT64_MAX else None


def storable(letter: DeadLetter) -> DeadLetter:
    """The dead letter with every text column storable (``printable``) and its stream
    sequence within ``bigint`` (None otherwise); ``raw`` stays the bytes received."""
    subject = printable(letter.subject, _SUBJECT_KEPT)
    reason = printable(letter.reason)
    job_id = None if letter.job_id is None else printable(letter.job_id, 256)
    event_id = None if letter.event_id is None else printable(letter.event_id, 64)
    stream_seq = _int64_or_none(letter.stream_seq)
    raw = letter.raw if isinstance(letter.raw, bytes) else bytes(letter.raw)
    if (subject, reason, job_id, event_id, stream_seq, raw) == (
        letter.subject, letter.reason, letter.job_id, letter.event_id, letter.stream_seq,
        letter.raw,
    ):  # fmt: skip
        return letter
    return dataclasses.replace(
        letter,
        subject=subject,
        reason=reason,
        job_id=job_id,
        event_id=event_id,
        stream_seq=stream_seq,
        raw=raw,
    )
