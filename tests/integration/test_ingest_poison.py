"""Poison input against a real ``elasticctl serve``: every message ends stored or dead-lettered.

Issue 20: a schema-valid event PostgreSQL cannot store (a NUL in its text, a seq of 2^63) in
one batch with a malformed message made the append fail as "PostgreSQL unavailable", the
halving recursed without end and serve died; restarted, it retried the same batch forever.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings

from controlplane import bus
from controlplane.publish import Outgoing
from controlplane.settings import Settings
from controlplane.store.postgres import PostgresEventStore
from schemas.subjects import event_subject
from tests.integration.helpers import publish, wait_until
from tests.unit.test_decode import messages

pytestmark = [pytest.mark.services, pytest.mark.usefixtures("clean_stream")]

JOB = "job-poison"
_STREAM_SEQ = itertools.count(1)


def _event(type_: str, payload: dict[str, Any], *, member: str = "m0", seq: int = 1,
           generation: int = 0, incarnation: str = "inc1") -> Outgoing:  # fmt: skip
    envelope = {
        "event_id": str(uuid.uuid4()),
        "job_id": JOB,
        "type": type_,
        "v": 1,
        "source": f"n0/{member}",
        "incarnation": incarnation,
        "seq": seq,
        "generation": generation,
        "emitted_at": "2026-01-01T00:00:00+00:00",
        "payload": payload,
    }
    subject = event_subject(JOB, "n0", member, type_)
    return Outgoing(subject, json.dumps(envelope).encode(), envelope["event_id"])


def _heartbeat(member: str, seq: int, **kw: Any) -> Outgoing:
    return _event("member.heartbeat", {"step": 1, "phase": "train"}, member=member, seq=seq, **kw)


async def _ensure_stream(settings: Settings) -> None:
    nc = await nats.connect(settings.nats_url)
    try:
        await bus.ensure_stream(nc.jetstream(), settings)
    finally:
        await nc.close()


def _serve(settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "ELASTIC_NATS_URL": settings.nats_url,
        "ELASTIC_DATABASE_URL": settings.database_url,
        "ELASTIC_INGEST_ACK_WAIT_S": "5",
        "ELASTIC_RETRY_MAX_S": "0.5",
        "ELASTIC_RENDEZVOUS_PORT": "0",
        "ELASTIC_LOG_LEVEL": "WARNING",
    }
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "controlplane", "serve"], env=env, stdout=out, stderr=out
        )


def _stored_ids(store: PostgresEventStore) -> set[str]:
    return {s.event.event_id for s in store.read(job_id=JOB)}


async def test_the_poison_pair_and_seq_2_63_are_dead_lettered_and_serve_goes_on(
    settings: Settings, pg_store: PostgresEventStore, tmp_path: Path
) -> None:
    # The poison pair sits in the stream before serve starts, so the first fetch holds both
    # in one batch: a NUL-detail member.fault (an honest rank's exception text can carry one)
    # and a malformed message.
    await _ensure_stream(settings)
    nul_fault = _event(
        "member.fault", {"kind": "exception", "detail": "bad\u0000nul"}, member="m0", seq=1
    )
    malformed = Outgoing(f"elastic.evt.{JOB}.n0.member.member.heartbeat", b'{"event_id": "x", ')
    await publish(settings.nats_url, [nul_fault, malformed])

    log = tmp_path / "serve.log"
    serve = _serve(settings, log)
    try:
        await wait_until(
            lambda: pg_store.count_dead_letters() >= 2 or serve.poll() is not None,
            30,
            "two dead letters",
        )
        assert serve.poll() is None, log.read_text()

        # The next valid event, from the source that sent the poison, is stored within 1 s.
        after = _heartbeat("m0", 2)
        started = time.monotonic()
        await publish(settings.nats_url, [after])
        await wait_until(lambda: after.msg_id in _stored_ids(pg_store), 5, "the next event")
        assert time.monotonic() - started < 1.0

        # seq and generation of 2^63 in a batch formed while serve runs, with a malformed
        # message, another NUL and good events of the same sources.
        big_seq = _heartbeat("m2", 2**63)
        big_generation = _heartbeat("m3", 1, generation=2**63)
        again = [
            big_seq,
            Outgoing(f"elastic.evt.{JOB}.n0.member.member.heartbeat", b"\xff\xfe garbage"),
            _heartbeat("m4", 1),
            big_generation,
            _event("member.fault", {"kind": "other", "detail": "x\x00"}, member="m5", seq=1),
            _heartbeat("m2", 1),
            _heartbeat("m3", 2),
        ]
        await publish(settings.nats_url, again)
        good = {again[2].msg_id, again[5].msg_id, again[6].msg_id}
        started = time.monotonic()
        await wait_until(
            lambda: good <= _stored_ids(pg_store) and pg_store.count_dead_letters() >= 6,
            10,
            "the second batch",
        )
        assert time.monotonic() - started < 1.0
        assert serve.poll() is None, log.read_text()
    finally:
        serve.terminate()
        serve.wait(30)
    assert serve.returncode == 0, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text, text
    assert "PostgreSQL unavailable" not in text, text

    letters = [d.letter for d in pg_store.dead_letters()]
    reasons = [letter.reason for letter in letters]
    assert len(letters) == 6, (reasons, text)
    by_subject: dict[str, list[str]] = {}
    for letter in letters:
        by_subject.setdefault(letter.subject, []).append(letter.reason)
    # The reason names the field and why.
    assert nul_fault.subject in by_subject, (reasons, text)
    fault_reasons = by_subject[nul_fault.subject]
    assert any("payload.detail" in r and "NUL" in r for r in fault_reasons), fault_reasons
    assert any(r.startswith("not JSON") for r in by_subject[malformed.subject])
    assert any("seq" in r and "int64" in r for r in by_subject[big_seq.subject])
    assert any("generation" in r and "int64" in r for r in by_subject[big_generation.subject])
    assert all(letter.stream_seq is not None for letter in letters)
    assert all(letter.raw for letter in letters)
    stored = _stored_ids(pg_store)
    assert {after.msg_id} | good <= stored
    assert not {nul_fault.msg_id, big_seq.msg_id, big_generation.msg_id} & stored


async def test_a_seq_jumping_implausibly_far_does_not_poison_its_source(
    settings: Settings, pg_store: PostgresEventStore, tmp_path: Path
) -> None:
    """A seq far past its source's last one (beyond any client buffer) is refused; the
    source's next events are stored in order, not taken as late fills of a huge hole."""
    log = tmp_path / "serve.log"
    serve = _serve(settings, log)
    try:
        await wait_until(lambda: pg_store.last_position() >= 0, 10, "serve")  # migrated db
        await asyncio.sleep(0)
        first = _heartbeat("m0", 1)
        jump = _heartbeat("m0", 10**15)
        nexts = [_heartbeat("m0", seq) for seq in range(2, 6)]
        await publish(settings.nats_url, [first, jump])
        await wait_until(lambda: pg_store.count_dead_letters() >= 1, 30, "the jump refused")
        await publish(settings.nats_url, nexts)
        ids = {m.msg_id for m in nexts}
        await wait_until(lambda: ids <= _stored_ids(pg_store), 10, "the next events")
        assert serve.poll() is None, log.read_text()
    finally:
        serve.terminate()
        serve.wait(30)
    assert serve.returncode == 0, log.read_text()
    (letter,) = [d.letter for d in pg_store.dead_letters()]
    assert letter.event_id == jump.msg_id
    assert letter.reason.startswith("implausible seq"), letter.reason
    assert pg_store.seq_gaps() == []  # no hole of 10^15 events was recorded
    assert jump.msg_id not in _stored_ids(pg_store)


async def test_a_subject_with_a_nul_is_dead_lettered_and_ingest_goes_on(
    settings: Settings, pg_store: PostgresEventStore, tmp_path: Path
) -> None:
    """NATS takes any byte but whitespace in a subject (JetStream stores it): one with a NUL
    is dead-lettered with the NUL escaped, and the ingest goes on. (A subject that is not
    UTF-8 no member can publish: its credential names literal subjects only, and the server
    refuses the rest; tests/integration/test_bus_identity.py.)"""
    from controlplane.bench.fuzz import publish_raw

    # The stream exists before anything is published, however long serve takes to start
    # (what reaches no stream is never acknowledged).
    await _ensure_stream(settings)
    log = tmp_path / "serve.log"
    serve = _serve(settings, log)
    try:
        await wait_until(lambda: pg_store.last_position() >= 0, 10, "serve")
        await asyncio.sleep(1.0)  # subscribed
        good = _heartbeat("m0", 1)
        later = _heartbeat("m0", 2)
        acks = await publish_raw(
            settings.nats_url,
            [
                (f"elastic.evt.{JOB}.n0.member\x00.member.heartbeat".encode(), b"{}"),
                (f"elastic.evt.{JOB}.n0.member.member.\x00".encode(), b"{}"),
                (good.subject.encode(), good.data),
            ],
        )
        assert all(seq is not None for seq in acks.values()) and len(acks) == 3
        await publish(settings.nats_url, [later])
        ids = {good.msg_id, later.msg_id}
        await wait_until(lambda: ids <= _stored_ids(pg_store), 10, "the valid events")
        await wait_until(lambda: pg_store.count_dead_letters() >= 2, 10, "two dead letters")
        assert serve.poll() is None, log.read_text()
    finally:
        serve.terminate()
        serve.wait(30)
    assert serve.returncode == 0, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()
    subjects = sorted(d.letter.subject for d in pg_store.dead_letters())
    assert subjects == [
        f"elastic.evt.{JOB}.n0.member.member.\\x00",
        f"elastic.evt.{JOB}.n0.member\\x00.member.heartbeat",
    ]


@hypothesis_settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(message=messages())
def test_fuzz_decode_encode_append_into_postgres(
    pg_store: PostgresEventStore, message: tuple[str, bytes]
) -> None:
    """The fuzz property against the real PostgreSQL: whatever decode makes of a mutated
    message, event or dead letter, PostgreSQL stores it (never a refusal)."""
    from controlplane.bench.fuzz import check_one

    subject, data = message
    check_one(subject, data, pg_store, next(_STREAM_SEQ))


async def test_a_refused_append_is_bad_input_and_leaves_every_connection_usable(
    pg_store: PostgresEventStore,
) -> None:
    """Refused (never "unavailable"), and the next append on the same pool or appender works:
    no connection is left in pipeline mode with results it still waits for."""
    from controlplane.errors import StoreRefused
    from tests.factories import Events

    ev = Events()
    fault = ev.make("member.fault", {"kind": "exception", "detail": "x"})
    bad = fault.model_copy(update={"generation": 2**63})  # past the schema, as a gap in it would
    for _ in range(3):
        with pytest.raises(StoreRefused, match="out of range for type bigint"):
            pg_store.append([bad])
        assert pg_store.append([ev.heartbeat("m0")]).stored
    appender = pg_store.appender()
    try:
        for _ in range(3):
            with pytest.raises(StoreRefused):
                await appender.append([bad], [])
            assert (await appender.append([ev.heartbeat("m0")], [])).stored
    finally:
        await appender.close()
