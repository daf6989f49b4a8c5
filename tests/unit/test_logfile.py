"""The JSONL log file: its line format, the writer and the reader (no services)."""

from __future__ import annotations

import functools
import io
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.postmortem.logfile import (
    LogFormatError,
    decode_line,
    encode_line,
    read_log,
    write_log,
)
from tests.factories import T0, Events
from tests.recorded import two_incidents as _two_incidents

#: The recorded run (built once: the decider runs through it).
two_incidents = functools.cache(_two_incidents)

ENVELOPE_KEYS = [
    "event_id", "job_id", "type", "v", "source", "incarnation", "seq", "generation",
    "emitted_at", "payload",
]  # fmt: skip


def _file(events: list[StoredEvent]) -> bytes:
    out = io.BytesIO()
    assert write_log(out, events) == len(events)
    return out.getvalue()


def test_a_line_is_the_envelope_plus_position_and_recorded_at():
    ev = Events()
    event = ev.cp("job.state_changed", {"from": "PENDING", "to": "RUNNING", "reason": "go"})
    stored = StoredEvent(42, T0 + timedelta(seconds=1.5), event)
    line = encode_line(stored)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    obj = json.loads(line)
    assert list(obj) == ["position", "recorded_at", *ENVELOPE_KEYS]
    assert obj["position"] == 42
    assert obj["recorded_at"] == "2026-01-01T00:00:01.500000Z"
    # The envelope as published: the schema's own JSON (aliases included: "from").
    envelope = {k: obj[k] for k in ENVELOPE_KEYS}
    assert envelope == json.loads(event.model_dump_json())
    assert obj["payload"]["from"] == "PENDING"


def test_recorded_times_are_written_in_utc():
    event = Events().heartbeat("m0")
    plus2 = timezone(timedelta(hours=2))
    stored = StoredEvent(1, datetime(2026, 1, 1, 2, 0, 0, 7, tzinfo=plus2), event)
    obj = json.loads(encode_line(stored))
    assert obj["recorded_at"] == "2026-01-01T00:00:00.000007Z"
    assert decode_line(encode_line(stored)).recorded_at == stored.recorded_at


def test_a_recorded_run_round_trips_exactly():
    log = two_incidents()
    data = _file(log)
    assert data.count(b"\n") == len(log)
    back = list(read_log(io.BytesIO(data)))
    assert back == log  # positions, recorded times and events (ids, payloads) alike
    assert fold(None, back) == fold(None, log)


def test_keys_in_any_order_read_the_same():
    log = two_incidents()[:40]
    lines = []
    for stored in log:
        obj = json.loads(encode_line(stored))
        lines.append(json.dumps(dict(reversed(list(obj.items())))).encode() + b"\n")
    assert list(read_log(lines)) == log
    assert [decode_line(line) for line in lines] == log


def test_blank_lines_are_skipped_and_progress_counts_every_byte():
    log = two_incidents()[:10000]
    data = _file(log[:3]) + b"\n  \n" + _file(log[3:])
    seen = []
    assert list(read_log(io.BytesIO(data), progress=seen.append)) == log
    assert sum(seen) == len(data)


def _bad(data: bytes, source: str = "log.jsonl") -> LogFormatError:
    with pytest.raises(LogFormatError) as info:
        list(read_log(io.BytesIO(data), source=source))
    return info.value


def _lines(n: int = 3) -> list[bytes]:
    return [encode_line(s) for s in two_incidents()[:n]]


def test_a_bad_line_is_named_with_its_number_and_what_is_wrong():
    lines = _lines()
    lines[1] = b'{"position":2,"recorded_at":"2026-01-01T00:00:00Z", nope\n'
    error = _bad(b"".join(lines))
    assert error.line == 2 and error.source == "log.jsonl"
    assert str(error).startswith("log.jsonl:2: not JSON")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda o: o.update(type="member.bogus"), "unknown event type: 'member.bogus'"),
        (lambda o: o.update(v=7), "unknown schema version of member.joined"),
        (lambda o: o["payload"].update(pid=-1), "schema violation at payload.pid"),
        (lambda o: o.update(surprise=1), "schema violation at surprise"),
        (lambda o: o.pop("recorded_at"), "missing recorded_at"),
        (lambda o: o.pop("position"), "missing position"),
        (lambda o: o.update(position="3"), "position must be an integer >= 1"),
        (lambda o: o.update(position=0), "position must be an integer >= 1"),
        (lambda o: o.update(recorded_at="2026-01-01T00:00:00"), "has no UTC offset"),
        (lambda o: o.update(recorded_at="soon"), "is not an ISO 8601 time"),
    ],
)
def test_schema_violations_are_errors(change, message):
    lines = _lines()
    obj = json.loads(lines[2])
    change(obj)
    lines[2] = json.dumps(obj).encode() + b"\n"
    error = _bad(b"".join(lines))
    assert error.line == 3
    assert message in str(error)


def test_the_fast_path_validates_as_strictly_as_the_slow_one():
    """The writer's key order (the reader's fast path) goes through the same schemas."""
    line = _lines(1)[0]
    tampered = line.replace(b'"job_id":"job-recorded"', b'"job_id":"job recorded"')
    assert tampered.startswith(b'{"position":1,"recorded_at":')
    error = _bad(tampered)
    assert "schema violation at job_id" in str(error)
    with pytest.raises(ValueError, match="schema violation at job_id"):
        decode_line(tampered)


def test_a_file_out_of_position_order_is_refused():
    lines = _lines(3)
    error = _bad(lines[0] + lines[2] + lines[1])
    assert error.line == 3
    assert "position 2 after 3" in str(error)
    error = _bad(lines[0] + lines[0])
    assert error.line == 2 and "position 1 after 1" in str(error)


def test_an_empty_file_has_no_events():
    assert list(read_log(io.BytesIO(b""))) == []


def test_writer_and_reader_agree_on_a_file(tmp_path):
    log = two_incidents()
    path = tmp_path / "log.jsonl"
    with path.open("wb") as out:
        write_log(out, log)
    with path.open("rb") as stream:
        assert list(read_log(stream, source=str(path))) == log
    assert all(s.recorded_at.tzinfo is not None for s in log)
    assert log[0].recorded_at == datetime(2026, 1, 1, tzinfo=UTC)
