"""The partitioned log and its retention, on real PostgreSQL: observations (step records,
interval liveness summaries) in spans of positions that the store opens as the log grows;
``retain`` drops the old spans as tables, keeping what the kept log still needs of them;
migration 0007 moves a log of the old table into the partitioned one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from alembic import command

from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.core.timeline import timeline
from controlplane.core.view import JobView
from controlplane.store import migrate
from controlplane.store.postgres import PostgresEventStore, SpanPolicy, encode_row, make_engine
from schemas.events import EVENT_ADAPTER, EnvelopeBase
from tests.factories import T0, Events
from tests.scenario import SoftScenario

pytestmark = pytest.mark.services

#: Spans as narrow as the store opens them: each a few dozen positions.
NARROW = SpanPolicy(span_s=1.0, min_rows=40, max_rows=40)


def _history() -> SoftScenario:
    """A job of four and a spare at T0 (January 2026: old to any retention here): steps,
    backups whose reports name their holders (catalogs once stored), liveness summaries every
    10 s, a crash decided on a summary and recovered by the spare, then more of the same."""
    s = SoftScenario(world_size=4, min_world=2, redundancy=1, liveness_summary_interval_s=2.0)
    s.cluster(2, 2, spares=1)
    s.decide()
    t = 1.0
    for step in range(1, 31):
        s.at(t)
        s.heartbeat_all(step=step)
        s.step(step)
        if step % 10 == 0:
            s.backup(step, named=True)
        s.decide()
        t += 1
    s.at(t)
    s.exited(s.v.world[1])
    assert s.decide(), "the crash is decided"
    s.recover()
    for step in range(s.v.last_step + 1, s.v.last_step + 25):
        t += 1
        s.at(t)
        s.heartbeat_all(step=step)
        s.step(step)
        if step % 10 == 0:
            s.backup(step, named=True)
        s.decide()
    return s


def _filler(job: str, count: int, at: datetime) -> list[StoredEvent]:
    """``count`` step records of job ``job``'s one member, recorded at ``at`` and after."""
    ev = Events(job)
    return [
        StoredEvent(0, at + timedelta(seconds=i), ev.make(
            "train.step", {"step": i + 1, "loss": 1.0, "step_seconds": 1.0, "samples": 8},
            source="f0/f0", generation=0))
        for i in range(count)
    ]  # fmt: skip


def _rows(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, args).fetchall()  # type: ignore[arg-type]


def _timelines(view: JobView) -> dict[str, Any]:
    return {i: timeline(incident) for i, incident in view.incidents.items()}


def _what_is_kept(view: JobView) -> dict[str, Any]:
    """What a fold of the log keeps whatever retention dropped: the job's state, world,
    members (who, where, which process, status, step), backups, incidents and timelines."""
    return {
        "state": view.state,
        "generation": view.generation,
        "world": list(view.world),
        "placement": view.placement,
        "last_step": view.last_step,
        "members": {
            m: (x.node, x.rack, x.role, x.incarnation, x.status, x.generation, x.step)
            for m, x in view.members.items()
        },
        "backups": view.backups,
        "last_complete_backup": view.last_complete_backup,
        "incidents": view.incidents,
        "timelines": _timelines(view),
    }


def test_spans_open_as_the_log_grows_and_an_observation_s_id_stays_unique(
    database_url: str,
) -> None:
    store = PostgresEventStore.from_url(database_url, spans=NARROW)
    try:
        # The migrated log has one span ahead, [1, 1001): the log reaches its end.
        assert [(s.lo, s.hi) for s in store.spans()] == [(1, 1001)]
        steps = _filler("job1", 1000, datetime.now(UTC))
        store.import_events(steps)
        ev = Events("job1")
        first = ev.make("train.step", {"step": 1, "loss": 1.0, "step_seconds": 1.0,
                                       "samples": 8}, source="n0/m0")  # fmt: skip
        result = store.append([first])
        assert [s.position for s in result.stored] == [1001]
        assert [(s.lo, s.hi) for s in store.spans()] == [(1, 1001), (1001, 1041)]
        for _ in range(45):  # into the span after
            store.append([ev.make("train.step", {"step": 2, "loss": 1.0, "step_seconds": 1.0,
                                                 "samples": 8}, source="n0/m0")])  # fmt: skip
        assert [(s.lo, s.hi) for s in store.spans()][-1] == (1041, 1081)
        # Each row is in the span of its position, and its class says where.
        where = _rows(database_url, "SELECT tableoid::regclass::text, min(position),"
                      " max(position) FROM events GROUP BY 1 ORDER BY 2")  # fmt: skip
        assert where == [("events_expiring_1", 1, 1000), ("events_expiring_1001", 1001, 1040),
                         ("events_expiring_1041", 1041, 1046)]  # fmt: skip
        # The same id under a new seq, a span later: a duplicate, not a second row.
        again = ev.make("train.step", {"step": 3, "loss": 1.0, "step_seconds": 1.0,
                                       "samples": 8}, source="n0/m0", event_id=first.event_id)  # fmt: skip
        result = store.append([again])
        assert result.stored == [] and result.duplicates == 1
        assert store.last_position() == 1046
        # Ahead of the ingest (``elasticctl retention``): the next span once the log is past
        # the middle of the last.
        assert store.open_spans() == []
        step = {"step": 4, "loss": 1.0, "step_seconds": 1.0, "samples": 8}
        store.append([ev.make("train.step", step, source="n0/m0") for _ in range(15)])
        assert store.last_position() == 1061
        assert store.open_spans() == [(1081, 1121)]
        assert [(s.lo, s.hi) for s in store.spans()][-2:] == [(1041, 1081), (1081, 1121)]
    finally:
        store.close()


def test_retention_drops_old_spans_keeps_what_the_log_needs_and_the_fold_agrees(
    database_url: str,
) -> None:
    store = PostgresEventStore.from_url(database_url, spans=SpanPolicy(min_rows=60, max_rows=60))
    try:
        old = datetime(2026, 1, 1, tzinfo=UTC) - timedelta(days=60)
        store.import_events(_filler("filler", 1000, old))  # span [1, 1001), all old
        s = _history()
        store.import_events(s.log)  # one batch: each backup's reports become a catalog
        log = store.read(job_id=s.job_id)
        assert any(e.event.type == "backup.catalog" and e.event.v == 2 for e in log)
        summaries = [e for e in log if e.event.type == "liveness.summary"]
        assert {e.event.payload.reason for e in summaries} == {"interval", "decision"}
        before = fold(None, log)
        assert before.incidents and all(i.outcome == "recovered" for i in before.incidents.values())
        # Recent rows of another job move the log past the history's spans.
        store.import_events(_filler("live", 100, datetime.now(UTC) - timedelta(minutes=5)))
        kept_before = _rows(database_url, "SELECT position, event_id FROM events_kept"
                            " WHERE job_id = %s ORDER BY position", s.job_id)  # fmt: skip
        spans = store.spans()
        cutoff = datetime.now(UTC) - timedelta(days=30)
        old_spans = [x for x in spans if x.newest_at is not None and x.newest_at < cutoff]
        assert len(old_spans) >= 3

        dry = store.retain(cutoff, dry_run=True)
        assert [x.name for x in dry.dropped] == [x.name for x in old_spans]
        assert dry.pinned > 0 and store.spans() == spans  # nothing changed

        done = store.retain(cutoff)
        assert [x.name for x in done.dropped] == [x.name for x in dry.dropped]
        assert done.pinned == dry.pinned
        tables = {r[0] for r in _rows(database_url, "SELECT relname FROM pg_class"
                                      " WHERE relname LIKE 'events_expiring_%%'")}  # fmt: skip
        assert not tables & {x.name for x in done.dropped}
        assert [x.name for x in store.spans()] == [x.name for x in done.kept]

        after_log = store.read(job_id=s.job_id)
        # Every kept event is still there, at its position; observations moved to it too.
        kept_after = _rows(database_url, "SELECT position, event_id FROM events_kept"
                           " WHERE job_id = %s ORDER BY position", s.job_id)  # fmt: skip
        assert set(kept_before) < set(kept_after)
        types = {e.event.type for e in after_log}
        assert {"backup.catalog", "fault.detected", "reallocation.issued", "incident.resolved",
                "generation.started", "command.acked"} <= types  # fmt: skip
        reasons = [e.event.payload.reason for e in after_log if e.event.type == "liveness.summary"]
        assert reasons.count("decision") == sum(
            1 for e in summaries if e.event.payload.reason == "decision"
        )
        assert (
            0
            < reasons.count("interval")
            < sum(1 for e in summaries if e.event.payload.reason == "interval")
        )
        steps_before = [e for e in log if e.event.type == "train.step"]
        steps_after = [e for e in after_log if e.event.type == "train.step"]
        assert 0 < len(steps_after) < len(steps_before)
        # Each process's first and last step of each generation stayed (a span keeps its own
        # first and last: the first of every generation is among them).
        for generation in {e.event.generation for e in steps_before}:
            of = [e for e in steps_before if e.event.generation == generation]
            firsts = {}
            for e in of:
                firsts.setdefault(e.event.source, e.position)
            kept_positions = {e.position for e in steps_after}
            assert set(firsts.values()) <= kept_positions

        # The fold of what is left: the same job, world, members, backups, incidents and
        # timelines (the first step that resolved the incident included).
        after = fold(None, after_log)
        assert _what_is_kept(after) == _what_is_kept(before)
        assert after.events < before.events  # what was dropped is not folded

        # Run again: nothing more is due.
        again = store.retain(cutoff)
        assert again.dropped == [] and again.pinned == 0
    finally:
        store.close()


def test_an_interrupted_retention_is_finished_and_the_command_reports_it(
    database_url: str,
) -> None:
    store = PostgresEventStore.from_url(database_url, spans=NARROW)
    try:
        old = datetime.now(UTC) - timedelta(days=90)
        store.import_events(_filler("old", 1100, old))  # spans [1, 1001), [1001, 1041), ...
        store.import_events(_filler("live", 100, datetime.now(UTC)))
        # A retention stopped between the detach and the drop left this table behind.
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("ALTER TABLE events_expiring DETACH PARTITION events_expiring_1001")
        env = {**os.environ, "ELASTIC_DATABASE_URL": database_url}
        cli = [sys.executable, "-m", "controlplane", "retention", "--json"]
        dry = json.loads(subprocess.run([*cli, "--dry-run"], env=env, capture_output=True,
                                        text=True, timeout=120, check=True).stdout)  # fmt: skip
        assert dry["dry_run"] and dry["retention_days"] == 30
        assert dry["dropped"][0]["name"] == "events_expiring_1"
        assert _rows(database_url, "SELECT count(*) FROM events_expiring_1001") == [(40,)]
        done = json.loads(subprocess.run(cli, env=env, capture_output=True, text=True,
                                         timeout=120, check=True).stdout)  # fmt: skip
        assert [d["name"] for d in done["dropped"]] == [d["name"] for d in dry["dropped"]]
        assert done["dropped_rows"] == sum(d["rows"] for d in dry["dropped"]) > 1000
        # Its first and last step of each span dropped through retention (1 and 1041..1080;
        # span 1001, already detached, went whole).
        assert done["pinned_rows"] == 4
        left = _rows(database_url, "SELECT relname FROM pg_class"
                     " WHERE relname ~ '^events_expiring_[0-9]+$' ORDER BY oid")  # fmt: skip
        assert ("events_expiring_1001",) not in left
        # The recent steps are all there; the old job keeps its pinned steps, and its steps
        # in the span it shares with the live job (1081..1100).
        assert _rows(database_url, "SELECT job_id, count(*) FROM events GROUP BY 1 ORDER BY 1") \
            == [("live", 100), ("old", 4 + 20)]  # fmt: skip
        # 0 days: nothing is dropped.
        none = json.loads(subprocess.run([*cli, "--days", "0"], env=env, capture_output=True,
                                         text=True, timeout=120, check=True).stdout)  # fmt: skip
        assert none["dropped"] == [] and none["older_than"] is None
        refused = subprocess.run([*cli, "--days", "-1"], env=env, capture_output=True,
                                 text=True, timeout=120)  # fmt: skip
        assert refused.returncode == 2 and "greater than or equal to 0" in refused.stderr
    finally:
        store.close()


def test_storage_reports_each_job_and_each_partition(database_url: str) -> None:
    store = PostgresEventStore.from_url(database_url)
    try:
        s = _history()
        store.import_events(s.log)
        found = store.storage()
    finally:
        store.close()
    [job] = found.jobs
    assert job.job_id == s.job_id and 0 < job.expiring_bytes < job.row_bytes
    names = [p.name for p in found.partitions]
    assert names[0] == "events_kept" and "events_expiring_1" in names
    assert found.events_total_bytes == sum(p.total_bytes for p in found.partitions) > 0
    assert job.by_type["backup.catalog"][1] > 0 and found.share_bytes(job) > 0


def _old_row(position: int, at: datetime, event: EnvelopeBase) -> bytes:
    return b"%d\t%s\t%s\n" % (position, at.isoformat().encode(), encode_row(event))


def test_migration_0007_moves_a_log_of_the_old_table_and_old_catalogs_still_fold(
    empty_database_url: str,
) -> None:
    engine = make_engine(empty_database_url, pool_size=1)
    config = migrate.alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0006")
    s = _history()
    # The log as revision 0006 held it, its backup reports packed in version 1's JSON lists.
    events: list[EnvelopeBase] = []
    run: list[EnvelopeBase] = []

    def flush() -> None:
        if len(run) > 1:
            events.append(_version_1(run))
        else:
            events.extend(run)
        run.clear()

    for stored in s.log:
        event = stored.event
        if event.type == "backup.snapshot":
            if run and run[0].payload.step != event.payload.step:
                flush()
            run.append(event)
            continue
        flush()
        events.append(event)
    flush()
    rows = b"".join(_old_row(i, T0 + timedelta(seconds=i), e) for i, e in enumerate(events, 1))
    with psycopg.connect(empty_database_url) as conn:
        with conn.cursor().copy(
            "COPY events (position, recorded_at, event_id, job_id, type, v, source,"
            " incarnation, seq, generation, emitted_at, payload) FROM STDIN"
        ) as copy:
            copy.write(rows)
        conn.execute("UPDATE log_head SET position = %s", (len(events),))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
    engine.dispose()
    store = PostgresEventStore.from_url(empty_database_url)
    try:
        log = store.read()
        assert [e.position for e in log] == list(range(1, len(events) + 1))
        assert [e.event.event_id for e in log] == [e.event_id for e in events]
        catalogs = [e for e in log if e.event.type == "backup.catalog"]
        assert catalogs and all(e.event.v == 1 for e in catalogs)
        classes = dict(_rows(empty_database_url, "SELECT position, expiring FROM events"))
        for e in log:
            expiring = e.event.type == "train.step" or (
                e.event.type == "liveness.summary" and e.event.payload.reason == "interval"
            )
            assert classes[e.position] is expiring, e.event.type
        assert [(x.lo, x.hi) for x in store.spans()] == [
            (1, len(events) + 1), (len(events) + 1, len(events) + 1001)
        ]  # fmt: skip
        # The log folds to the view the same log folded to before the migration, old
        # catalogs (version 1) read as the reports they packed.
        written = [StoredEvent(i, T0 + timedelta(seconds=i), e) for i, e in enumerate(events, 1)]
        assert fold(None, log) == fold(None, written)
        # The log goes on from its head.
        more = store.append([Events(s.job_id).make("train.step", {
            "step": 99, "loss": 1.0, "step_seconds": 1.0, "samples": 8},
            source="n0/w00", incarnation="new", generation=0)])  # fmt: skip
        assert [x.position for x in more.stored] == [len(events) + 1]
    finally:
        store.close()


def _version_1(run: list[EnvelopeBase]) -> EnvelopeBase:
    """Reports packed as the store packed them before version 2."""
    first = run[0]
    payload = {
        "step": first.payload.step,
        "sources": [e.source for e in run],
        "incarnations": [e.incarnation for e in run],
        "seqs": [e.seq for e in run],
        "shards": [e.payload.shard for e in run],
        "nbytes": [e.payload.nbytes for e in run],
        "checksums": [e.payload.checksum for e in run],
        "seconds": [e.payload.seconds for e in run],
        "holders": [list(e.payload.holders) for e in run],
    }
    return EVENT_ADAPTER.validate_python({
        "event_id": str(uuid.uuid5(uuid.NAMESPACE_URL, first.event_id)), "job_id": first.job_id,
        "type": "backup.catalog", "v": 1, "source": "controlplane", "incarnation": "store",
        "seq": 1, "generation": first.generation, "emitted_at": first.emitted_at,
        "payload": payload,
    })  # fmt: skip
