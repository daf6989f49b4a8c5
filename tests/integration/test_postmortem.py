"""Export -> import between real PostgreSQL databases, and the timeline command."""

from __future__ import annotations

import functools
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.core.fold import fold
from controlplane.core.timeline import timeline
from controlplane.postmortem.logfile import read_log
from controlplane.postmortem.transfer import export_log
from controlplane.store import migrate
from controlplane.store.postgres import PostgresEventStore, make_engine
from controlplane.synth import SyntheticJob
from schemas.events import EVENT_ADAPTER
from tests.conftest import with_database
from tests.recorded import JOB
from tests.recorded import two_incidents as _two_incidents

pytestmark = pytest.mark.services

two_incidents = functools.cache(_two_incidents)
SYNTH = "job-synth"


def _fresh_database(admin_url: str) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = with_database(admin_url, name)
    engine = make_engine(url, pool_size=1)
    migrate.upgrade(engine)
    engine.dispose()
    return url


@pytest.fixture
def target_url(services) -> Iterator[str]:
    """A second fresh, migrated database (the import's target)."""
    url = _fresh_database(services.database_url)
    yield url
    with psycopg.connect(services.database_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


@pytest.fixture
def source(pg_store: PostgresEventStore) -> PostgresEventStore:
    """A log as a control plane leaves it: a synthetic job ingested live (stamped now, with a
    sequence gap filled late), then the recorded two-incident run (its own times)."""
    job = SyntheticJob(SYNTH, members=4, seed=3)
    events = [
        EVENT_ADAPTER.validate_python(e, strict=False)
        for e in [*job.controlplane_events(), *job.member_events(300)]
    ]
    late = events[50]
    pg_store.append([e for e in events[:150] if e is not late])
    pg_store.append([late, *events[150:]])
    assert pg_store.seq_gaps(), "the synthetic job left a gap to fill"
    pg_store.import_events(two_incidents())
    return pg_store


def _cli(args: list[str], url: str, **kw):
    return CliRunner().invoke(app, args, env={"ELASTIC_DATABASE_URL": url}, **kw)


def _export(url: str, *args: str) -> bytes:
    result = _cli(["export", *args], url)
    assert result.exit_code == 0, result.stderr
    return result.stdout_bytes


def _import(url: str, path: Path) -> dict:
    result = _cli(["import", str(path), "--json"], url)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_export_then_import_into_a_fresh_database_gives_the_same_log(
    source, database_url, target_url, tmp_path
):
    data = _export(database_url)
    path = tmp_path / "log.jsonl"
    path.write_bytes(data)
    original = source.read()
    assert data.count(b"\n") == len(original) == source.last_position()
    assert list(read_log(io.BytesIO(data))) == original

    summary = _import(target_url, path)
    assert summary["read"] == summary["imported"] == len(original)
    assert summary["duplicates"] == 0 and summary["rejected"] == 0
    assert summary["positions_kept"] is True
    assert summary["jobs"] == [SYNTH, JOB]

    target = PostgresEventStore.from_url(target_url)
    try:
        copied = target.read()
        # Same positions, event ids, payloads and recorded times, event by event.
        assert copied == original
        assert [(s.position, s.event.event_id, s.recorded_at) for s in copied] == [
            (s.position, s.event.event_id, s.recorded_at) for s in original
        ]
        assert target.last_position() == source.last_position()
        assert target.job_ids() == source.job_ids()
        # The same views, hence the same timelines.
        for job_id in (SYNTH, JOB):
            assert fold(None, target.read(job_id=job_id)) == fold(None, source.read(job_id=job_id))
        # The sequence rules saw the same log: the same gap (filled late) was recorded.
        assert target.seq_gaps() == source.seq_gaps()
        assert target.count_dead_letters() == 0

        # Importing again stores nothing twice.
        again = _import(target_url, path)
        assert again["imported"] == 0 and again["duplicates"] == len(original)
        assert target.read() == original and target.last_position() == len(original)
    finally:
        target.close()


def test_a_job_exported_alone_keeps_its_times_and_timelines(
    source, database_url, target_url, tmp_path
):
    recorded = source.read(job_id=JOB)
    data = _export(database_url, "--job", JOB)
    lines = list(read_log(io.BytesIO(data)))
    assert lines == recorded and recorded[0].position > 1
    path = tmp_path / "job.jsonl"
    path.write_bytes(data)
    summary = _import(target_url, path)
    # Its positions cannot be kept (the log is gap-free): they are renumbered, in order.
    assert summary["imported"] == len(recorded) and summary["positions_kept"] is False
    target = PostgresEventStore.from_url(target_url)
    try:
        copied = target.read()
        assert [s.position for s in copied] == list(range(1, len(recorded) + 1))
        assert [(s.event, s.recorded_at) for s in copied] == [
            (s.event, s.recorded_at) for s in recorded
        ]
        before = fold(None, recorded)
        after = fold(None, copied)
        assert after.state == before.state and after.world == before.world
        lines_before = [timeline(i) for i in before.incidents.values()]
        lines_after = [timeline(i) for i in after.incidents.values()]
        assert [(t.phases, t.downtime_s, t.steps_lost) for t in lines_after] == [
            (t.phases, t.downtime_s, t.steps_lost) for t in lines_before
        ]
    finally:
        target.close()


def test_export_after_a_position_streams_pages_in_order(source, database_url):
    everything = source.read()
    tail = _export(database_url, "--after", "100")
    assert [s.position for s in read_log(io.BytesIO(tail))] == [
        s.position for s in everything if s.position > 100
    ]
    small_pages, big_pages = io.BytesIO(), io.BytesIO()
    export_log(source, small_pages, page=7)
    summary = export_log(source, big_pages)
    assert small_pages.getvalue() == big_pages.getvalue() == _export(database_url)
    assert summary.events == len(everything) and summary.head == everything[-1].position


def test_export_of_an_unknown_job_says_which_jobs_there_are(source, database_url):
    result = _cli(["export", "--job", "nope"], database_url)
    assert result.exit_code == 1
    assert "no event of job 'nope'" in result.stderr and JOB in result.stderr


def test_import_of_a_bad_file_names_the_line_and_keeps_earlier_batches(
    database_url, target_url, source, tmp_path
):
    lines = _export(database_url, "--job", JOB).splitlines(keepends=True)
    lines[30] = b'{"position": 31, "oops": true}\n'
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(lines))
    result = _cli(["import", str(path), "--batch", "10"], target_url)
    assert result.exit_code == 2
    assert f"{path}:31: missing recorded_at" in result.stderr
    target = PostgresEventStore.from_url(target_url)
    try:
        assert target.last_position() == 30  # three whole batches went in
    finally:
        target.close()


def test_import_into_an_unmigrated_database_is_refused(empty_database_url, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    result = _cli(["import", str(path)], empty_database_url)
    assert result.exit_code == 2
    assert "elasticctl migrate" in result.stderr


def test_timeline_command(source, database_url):
    result = _cli(["timeline", JOB, "--json"], database_url)
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["job_id"] == JOB and out["state"] == "COMPLETED"
    crash, hang = out["incidents"]
    assert crash["downtime_s"] == pytest.approx(0.8) and hang["downtime_s"] == pytest.approx(5.8)
    # Generation 2 trains from its restore step (35): w10 hangs at step 73, 3 past the backup
    # of step 70 (before issue 21 the job's step stayed at generation 1's 38, the recorded run
    # went on from 39 and the hang fell on the backup of step 75).
    assert hang["members"] == ["w10"] and hang["steps_lost"] == 3
    view = fold(None, source.read(job_id=JOB))
    incident = view.incidents[hang["incident_id"]]
    points = {p["name"]: p["position"] for p in hang["points"]}
    assert points == {
        name: mark.position for name, mark in timeline(incident).points.items() if mark
    }
    # Every point names the event behind it, by position.
    for position in points.values():
        [stored] = source.read(after=position - 1, limit=1)
        assert stored.event.job_id == JOB
    assert {p["name"]: p["seconds"] for p in hang["phases"]}["detect"] == pytest.approx(5.0)

    text = _cli(["timeline", JOB], database_url)
    assert text.exit_code == 0, text.stderr
    assert "first_step" in text.stdout and "downtime 5.800s" in text.stdout
    missing = _cli(["timeline", "nope"], database_url)
    assert missing.exit_code == 1 and "no job 'nope'" in missing.stderr


def test_goodput_command_prints_the_breakdown_of_a_recorded_two_incident_run(source, database_url):
    result = _cli(["goodput", JOB, "--json"], database_url)
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["job_id"] == JOB and out["final"] is True
    # The job's wall time: its registration (t=0) to job.completed (t=55.5), every second in
    # exactly one term.
    assert out["wall_s"] == pytest.approx(55.5)
    assert sum(out["seconds"].values()) == pytest.approx(out["wall_s"])
    assert out["ettr"] == pytest.approx(out["seconds"]["productive"] / out["wall_s"])
    crash, hang = out["incidents"]
    # The hang's window: 5 s of detection (the heartbeat timeout of 4 s and the tick), then
    # 0.5 s of ack and restore and 0.3 s to the first step: its downtime of 5.8 s.
    assert hang["phases"] == pytest.approx(
        {"detection": 5.0, "decision": 0.0, "restore": 0.5, "resume": 0.3}
    )
    assert sum(crash["phases"].values()) == pytest.approx(0.8)
    for incident in (crash, hang):
        # 3 steps lost each: the first redone is in resume, the next two took 0.2 + 0.5 s.
        assert incident["steps_lost"] == 3 and incident["recomputation_s"] == pytest.approx(0.7)
    assert out["recomputed_steps"] == 6 and out["productive_steps"] == 90
    assert [g["generation"] for g in out["generations"]] == [1, 2, 3]
    assert sum(g["wall_s"] for g in out["generations"]) == pytest.approx(out["wall_s"])

    text = _cli(["goodput", JOB], database_url)
    assert text.exit_code == 0, text.stderr
    assert "ETTR" in text.stdout and "recomputation" in text.stdout
    missing = _cli(["goodput", "nope"], database_url)
    assert missing.exit_code == 1 and "no job 'nope'" in missing.stderr


def test_a_failed_demo_run_leaves_its_event_log_beside_its_logs(
    source: PostgresEventStore, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demo or chaos run that fails keeps its logs, and the event log with them (the
    export's format: `elasticctl import` and `replay` read it); with the database gone, the
    logs are still kept, and it says why the event log is not."""
    import tempfile

    from rich.console import Console

    from controlplane.demo import EVENTS_FILE, Demo, DemoConfig, Stack

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the kept logs go
    demo = Demo(DemoConfig())
    demo.state = tmp_path / "state"
    (demo.state / "logs").mkdir(parents=True)
    (demo.state / "logs" / "serve.log").write_text("the control plane's log\n")
    said = io.StringIO()
    demo.err = Console(file=said, width=400)

    def kept() -> Path:
        line = said.getvalue().strip().splitlines()[-1]
        return Path(line.rsplit(" in ", 1)[1])

    demo.stack = Stack(nats_url="", database_url=database_url)
    demo._save_logs()
    where = kept()
    assert where.parent == tmp_path
    assert (where / "serve.log").read_text() == "the control plane's log\n"
    with (where / EVENTS_FILE).open("rb") as f:
        positions = [e.position for e in read_log(f)]
    assert positions == list(range(1, source.last_position() + 1))
    assert EVENTS_FILE in said.getvalue()

    gone = database_url.rsplit("/", 1)[0] + "/no_such_database"
    demo.stack = Stack(nats_url="", database_url=gone)
    said.truncate(0)
    said.seek(0)
    demo._save_logs()
    lines = said.getvalue()
    assert "the event log was not exported" in lines and EVENTS_FILE not in lines.splitlines()[-1]
    assert (kept() / "serve.log").exists() and not (kept() / EVENTS_FILE).exists()
