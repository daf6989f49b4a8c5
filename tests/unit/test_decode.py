"""Decoding bus messages into events or dead letters, and the subject layout."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.records import DeadLetter
from controlplane.decode import decode
from schemas.common import MAX_EVENT_BYTES
from schemas.events import CONTROLPLANE_EVENT_TYPES, EnvelopeBase, MemberHeartbeatEvent
from schemas.subjects import (
    BROADCAST,
    COMMAND_PREFIX,
    EVENT_PREFIX,
    EVENTS_WILDCARD,
    EventSubject,
    command_subject,
    command_wildcard,
    event_subject,
    parse_event_subject,
    role_of,
)

SUBJECT = "elastic.evt.job1.n0.member.member.heartbeat"


def envelope(**over: Any) -> dict[str, Any]:
    env: dict[str, Any] = {
        "event_id": str(uuid.uuid4()),
        "job_id": "job1",
        "type": "member.heartbeat",
        "v": 1,
        "source": "n0/m0",
        "incarnation": "inc1",
        "seq": 1,
        "generation": 0,
        "emitted_at": "2026-01-01T00:00:00Z",
        "payload": {"step": 3, "phase": "train"},
    }
    env.update(over)
    return env


def raw(**over: Any) -> bytes:
    return json.dumps(envelope(**over)).encode()


def dead(subject: str, data: bytes, stream_seq: int | None = 5) -> DeadLetter:
    result = decode(subject, data, stream_seq)
    assert isinstance(result, DeadLetter), result
    assert result.raw == data[:MAX_EVENT_BYTES]
    assert result.subject == subject
    assert result.stream_seq == stream_seq
    assert result.event_id is None
    return result


# --------------------------------------------------------------------------- decode


def test_valid_message_decodes():
    data = raw(seq=9)
    event = decode(SUBJECT, data, 3)
    assert isinstance(event, MemberHeartbeatEvent)
    assert event.seq == 9
    assert event.source == "n0/m0"
    assert event.payload.step == 3


def test_valid_message_decodes_without_stream_seq():
    assert isinstance(decode(SUBJECT, raw()), EnvelopeBase)


def test_type_with_dots_and_other_member():
    subject = event_subject("job-2", "node_7", "m-11", "train.step")
    data = raw(
        job_id="job-2",
        source="node_7/m-11",
        type="train.step",
        payload={"step": 1, "loss": 0.5, "step_seconds": 0.1, "samples": 4},
    )
    event = decode(subject, data)
    assert isinstance(event, EnvelopeBase)
    assert event.type == "train.step"
    assert event.member == "m-11"


@pytest.mark.parametrize("data", [b"", b"{", b"nope", b"\xff\xfe", b'{"a": 1,}', b"[" * 1000])
def test_not_json(data: bytes):
    letter = dead(SUBJECT, data)
    assert letter.reason.startswith("not JSON"), letter.reason
    assert letter.job_id == "job1"


@pytest.mark.parametrize("data", [b"[]", b"1", b"null", b'"x"', b"true", b"[{}]"])
def test_not_a_json_object(data: bytes):
    assert dead(SUBJECT, data).reason.startswith("not a JSON object")


@pytest.mark.parametrize("type_", ["member.dance", "", "MEMBER.HEARTBEAT", "member"])
def test_unknown_event_type(type_: str):
    letter = dead(SUBJECT, raw(type=type_))
    assert letter.reason.startswith("unknown event type"), letter.reason
    assert repr(type_) in letter.reason


def test_missing_event_type():
    env = envelope()
    del env["type"]
    assert dead(SUBJECT, json.dumps(env).encode()).reason.startswith("missing event type")
    assert dead(SUBJECT, b"{}").reason.startswith("missing event type")


@pytest.mark.parametrize("v", [0, 2, 99, "1"])
def test_unknown_schema_version(v: Any):
    letter = dead(SUBJECT, raw(v=v))
    assert letter.reason.startswith("unknown schema version"), letter.reason
    assert "member.heartbeat" in letter.reason
    assert "[1]" in letter.reason


@pytest.mark.parametrize(
    ("over", "where"),
    [
        ({"seq": "1"}, "seq"),
        ({"seq": 0}, "seq"),
        ({"job_id": "job.1"}, "job_id"),
        ({"event_id": "NOT-A-UUID"}, "event_id"),
        ({"emitted_at": "2026-01-01T00:00:00"}, "emitted_at"),
        ({"payload": {"step": -1, "phase": "train"}}, "payload.step"),
        ({"payload": {"step": 1, "phase": "train", "x": 1}}, "payload.x"),
        ({"extra": True}, "extra"),
    ],
)
def test_schema_violation(over: dict[str, Any], where: str):
    letter = dead(SUBJECT, raw(**over))
    assert letter.reason.startswith(f"schema violation at {where}"), letter.reason


def test_schema_violation_counts_further_errors():
    letter = dead(SUBJECT, raw(seq="1", generation="0"))
    assert letter.reason.startswith("schema violation")
    assert "(+1 more)" in letter.reason


def test_oversized_is_truncated():
    data = raw() + b" " * MAX_EVENT_BYTES
    letter = dead(SUBJECT, data)
    assert letter.reason.startswith("oversized"), letter.reason
    assert str(len(data)) in letter.reason
    assert len(letter.raw) == MAX_EVENT_BYTES
    assert letter.raw == data[:MAX_EVENT_BYTES]
    assert letter.job_id == "job1"


def test_oversized_wins_over_a_bad_subject():
    data = b"x" * (MAX_EVENT_BYTES + 1)
    letter = dead("not.a.subject", data)
    assert letter.reason.startswith("oversized")
    assert letter.job_id is None


def test_size_limit_is_inclusive():
    body = raw()
    exact = body + b" " * (MAX_EVENT_BYTES - len(body))
    assert len(exact) == MAX_EVENT_BYTES
    assert isinstance(decode(SUBJECT, exact), EnvelopeBase)
    assert dead(SUBJECT, exact + b" ").reason.startswith("oversized")


@pytest.mark.parametrize(
    "subject",
    [
        "elastic.cmd.job1.n0.member.member.heartbeat",
        "elastic.evt.job1.n0.member",
        "elastic.evt.job1..member.member.heartbeat",
        "elastic.evt.job1.n0.m0.member.heartbeat",  # a member's name is no role
        "elastic.evt",
        "",
        "other.evt.job1.n0.member.member.heartbeat",
    ],
)
def test_not_an_event_subject(subject: str):
    letter = dead(subject, raw())
    assert letter.reason.startswith("not an event subject"), letter.reason
    assert letter.job_id is None


@pytest.mark.parametrize(
    "subject",
    [
        "elastic.evt.job1.n1.member.member.heartbeat",  # another node
        "elastic.evt.job1.n0.launcher.member.heartbeat",  # the launcher's
    ],
)
def test_forged_source(subject: str):
    letter = dead(subject, raw())
    assert letter.reason.startswith("forged source"), letter.reason
    assert "'n0/m0'" in letter.reason


@pytest.mark.parametrize("source", ["controlplane", "n0/launcher", "n1/m0"])
def test_a_member_subject_binds_a_member_of_its_node(source: str):
    letter = dead(SUBJECT, raw(source=source))
    assert letter.reason.startswith("forged source"), letter.reason
    assert "'n0/<member>'" in letter.reason


def test_a_launcher_subject_binds_the_launcher_only():
    subject = "elastic.evt.job1.n0.launcher.member.heartbeat"
    assert isinstance(decode(subject, raw(source="n0/launcher")), EnvelopeBase)
    letter = dead(subject, raw(source="n0/m0"))
    assert "'n0/launcher'" in letter.reason, letter.reason


def test_job_mismatch():
    letter = dead("elastic.evt.job2.n0.member.member.heartbeat", raw())
    assert letter.reason.startswith("job mismatch"), letter.reason
    assert letter.job_id == "job2"  # the dead letter is filed under the subject's job


def test_type_mismatch():
    letter = dead("elastic.evt.job1.n0.member.train.step", raw())
    assert letter.reason.startswith("type mismatch"), letter.reason


@pytest.mark.parametrize("source", ["n0/m0", "controlplane"])
def test_member_cannot_publish_control_plane_events(source: str):
    subject = event_subject("job1", "n0", "m0", "job.registered")
    letter = dead(subject, raw(type="job.registered", source=source, payload={}))
    assert letter.reason == "forged: job.registered is recorded only by the control plane"


def test_every_control_plane_type_is_refused_from_the_bus():
    # a fully valid control-plane event, published on a matching member subject
    payloads = {
        "job.registered": {},
        "job.stopped": {"reason": "x"},
        "job.completed": {},
        "job.state_changed": {"from": "RUNNING", "to": "STOPPED", "reason": "x"},
    }
    for type_, payload in payloads.items():
        assert type_ in CONTROLPLANE_EVENT_TYPES
        letter = dead(event_subject("job1", "n0", "m0", type_), raw(type=type_, payload=payload))
        assert letter.reason.startswith(f"forged: {type_}"), letter.reason


def test_dead_letter_keeps_small_raw_whole():
    data = b'{"type": "nope"}'
    assert dead(SUBJECT, data, stream_seq=None).raw == data


def test_repeated_subjects_decode_consistently():
    for _ in range(3):
        assert isinstance(decode(SUBJECT, raw()), EnvelopeBase)
        assert isinstance(decode("bad", raw()), DeadLetter)


@settings(max_examples=300)
@given(st.binary(max_size=2000))
def test_decode_never_raises_on_random_bytes(data: bytes):
    result = decode(SUBJECT, data, 1)
    assert isinstance(result, DeadLetter | EnvelopeBase)
    if isinstance(result, DeadLetter):
        assert result.reason
        assert result.raw == data


@settings(max_examples=200)
@given(st.text(max_size=80), st.binary(max_size=200))
def test_decode_never_raises_on_random_subjects(subject: str, data: bytes):
    result = decode(subject, data)
    assert isinstance(result, DeadLetter | EnvelopeBase)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200)
@given(
    st.dictionaries(
        st.sampled_from(sorted(envelope())),
        JSON_VALUES,
        max_size=4,
    )
)
def test_decode_never_raises_on_mangled_envelopes(over: dict[str, Any]):
    data = json.dumps(envelope(**over)).encode()
    result = decode(SUBJECT, data)
    assert isinstance(result, DeadLetter | EnvelopeBase)
    if isinstance(result, DeadLetter):
        assert result.reason.split(" ")[0] in {
            "schema",
            "unknown",
            "missing",
            "forged",
            "forged:",
            "job",
            "type",
        }, result.reason


# --------------------------------------------------------------------------- subjects


@pytest.mark.parametrize(
    "type_", ["member.heartbeat", "train.step", "job.state_changed", "single", "a.b.c.d"]
)
def test_event_subject_round_trip(type_: str):
    subject = event_subject("job1", "n0", "m0", type_)
    assert subject == f"{EVENT_PREFIX}.job1.n0.member.{type_}"
    parsed = parse_event_subject(subject)
    assert parsed == EventSubject("job1", "n0", "member", type_)
    assert parsed.type == type_
    assert event_subject(*parsed) == subject
    launcher = event_subject("job1", "n0", "launcher", type_)
    assert launcher == f"{EVENT_PREFIX}.job1.n0.launcher.{type_}"
    assert parse_event_subject(launcher) == EventSubject("job1", "n0", "launcher", type_)


@pytest.mark.parametrize(
    "subject",
    [
        "elastic.cmd.job1.n0.member.member.heartbeat",  # wrong prefix
        "elastic.events.job1.n0.member.member.heartbeat",
        "evt.elastic.job1.n0.member.member.heartbeat",
        "elastic.evt.job1.n0.member",  # too few tokens
        "elastic.evt.job1.n0",
        "elastic.evt",
        "elastic",
        "",
        "elastic.evt..n0.member.member.heartbeat",  # empty tokens
        "elastic.evt.job1..member.member.heartbeat",
        "elastic.evt.job1.n0..member.heartbeat",
        "elastic.evt.job1.n0.member.",
        "elastic.evt.job1.n0.m0.member.heartbeat",  # no role
        "elastic.evt.job1.n0.Member.member.heartbeat",
        ".evt.job1.n0.member.x",
        "elastic..job1.n0.member.x",
    ],
)
def test_parse_event_subject_rejects(subject: str):
    assert parse_event_subject(subject) is None


def test_parse_keeps_trailing_tokens_in_the_type():
    # everything after the role is the type, even an empty-looking tail token
    parsed = parse_event_subject("elastic.evt.job1.n0.member.member..heartbeat")
    assert parsed is not None
    assert parsed.type == "member..heartbeat"


def test_event_subject_binds_a_source():
    parsed = parse_event_subject(SUBJECT)
    assert parsed == EventSubject("job1", "n0", "member", "member.heartbeat")
    assert parsed.binds("n0/m0") and parsed.binds("n0/m1")
    for source in ("n0/launcher", "n1/m0", "n0/", "n0", "/m0", "controlplane"):
        assert not parsed.binds(source), source
    launcher = EventSubject("job1", "n0", "launcher", "member.exited")
    assert launcher.binds("n0/launcher")
    assert not launcher.binds("n0/m0") and not launcher.binds("n1/launcher")


def test_command_subjects():
    assert command_subject("job1") == f"{COMMAND_PREFIX}.job1.{BROADCAST}"
    assert command_subject("job1") == "elastic.cmd.job1.all"
    assert command_subject("job1", "m3") == "elastic.cmd.job1.m3"
    assert command_wildcard("job1") == "elastic.cmd.job1.*"
    assert EVENTS_WILDCARD == "elastic.evt.>"
    assert parse_event_subject(command_subject("job1", "m3")) is None


@given(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,10}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,10}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,10}", fullmatch=True),
    st.from_regex(r"[a-z]+(\.[a-z_]+){0,3}", fullmatch=True),
)
def test_event_subject_round_trip_property(job: str, node: str, member: str, type_: str):
    parsed = parse_event_subject(event_subject(job, node, member, type_))
    assert parsed == EventSubject(job, node, role_of(member), type_)
    assert parsed.binds(f"{node}/{member}")


# --------------------------------------------------------------------------- fuzz (issue 20)
#
# decode -> encode -> append over valid events mutated anywhere: a NUL or a lone surrogate in
# any string (keys too), huge and negative integers, NaN and infinities, wrong types, bytes
# that are not UTF-8, truncation, random bytes, a subject that contradicts the envelope. The
# property (``check_one``): nothing raises, and whatever comes out, event or dead letter, is
# something PostgreSQL stores. ``tests/integration/test_ingest_poison.py`` runs it against a
# real PostgreSQL; ``tests/fuzz/ingest_target.py`` is the same target for atheris.

NASTY_STRINGS = ["\x00", "a\x00b", "\ud800", "\udfff", "x\udc80", "\U0001f600", "\\", '"', "",
                 "\u2028", "é" * 300, "x" * 5000]  # fmt: skip
NASTY_INTS = [2**63, 2**63 - 1, 2**63 + 1, 2**64, -(2**63) - 1, -(2**63), -1, 0, 10**30]
nasty_text = st.one_of(st.text(max_size=20), st.sampled_from(NASTY_STRINGS))
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(NASTY_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    nasty_text,
)
json_values = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(nasty_text, inner, max_size=3),
    max_leaves=6,
)


@st.composite
def messages(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid member event, mutated at one place of its envelope, its bytes or its subject."""
    from controlplane.bench.fuzz import Generator, _leaves, _set

    gen = Generator(draw(st.integers(0, 2**32)), "h", jobs=2, nodes=2, members=2)
    env, (job, node, member) = gen.envelope()
    subject = event_subject(job, node, member, env["type"])
    how = draw(st.sampled_from(["value", "key", "bytes", "subject", "none"]))
    if how == "value":
        paths = [p for p, _ in _leaves(env) if p != ("event_id",)]
        _set(env, draw(st.sampled_from(paths)), draw(json_values))
    elif how == "key":
        env["payload"][draw(nasty_text)] = draw(json_values)
    elif how == "subject":
        subject = draw(st.sampled_from([
            subject + "\x00", subject.replace(job, job + "\udcff"), "elastic.evt." + "x" * 300,
            subject.replace(".member.", f".{draw(nasty_text) or 'm'}.", 1), "elastic.evt.a.b",
        ]))  # fmt: skip
    text = json.dumps(env, allow_nan=True, ensure_ascii=draw(st.booleans()))
    data = text.encode("utf-8", "surrogatepass")
    if how == "bytes":
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["cut", "insert", "replace"]))
        junk = draw(st.binary(min_size=1, max_size=8))
        data = {"cut": data[:at], "insert": data[:at] + junk + data[at:],
                "replace": data[:at] + junk + data[at + len(junk):]}[op]  # fmt: skip
    return subject, data


@settings(max_examples=300, deadline=None)
@given(messages())
def test_fuzz_decode_encode_append_in_memory(message: tuple[str, bytes]):
    from controlplane.bench.fuzz import check_one
    from controlplane.store.memory import InMemoryEventStore

    subject, data = message
    check_one(subject, data, InMemoryEventStore())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.text(max_size=60))
def test_fuzz_random_bytes_on_any_subject(data: bytes, subject: str):
    from controlplane.bench.fuzz import check_one

    assert check_one(subject, data) == "dead" or data.startswith(b"{")
