"""``elasticctl bench api`` on small logs: the 64-worker job's, and a generated history's (a
job of many ranks with its incidents, served from the view snapshot it comes with). The
figures themselves are not asserted; what they are measured on is."""

from __future__ import annotations

import json

import httpx
import psycopg
import pytest
from typer.testing import CliRunner

from controlplane.bench.api import first_answer, run_api_bench, start_api, stop_api
from controlplane.bench.history import history_rows_per_day, log_size, write_history
from controlplane.cli import app
from controlplane.settings import libpq_url
from schemas.api import EventPage, IncidentTimeline

pytestmark = pytest.mark.services


def _route_figures(route):
    assert route["requests"] > 0 and route["errors"] == 0
    assert 0 < route["p50_ms"] <= route["p99_ms"] <= route["max_ms"]
    assert route["per_s"] > 0 and route["api_cpu_us_per_request"] > 0
    assert route["body_bytes_mean"] > 0


def test_bench_api_over_a_history_starts_the_api_from_its_snapshot():
    # 0.01 days of a 64-rank job: 1,052 rows, one incident decided by the real decider.
    out = run_api_bench(ranks=64, days=0.01, clients=4, seconds=1.0, progress=False)
    assert out["ranks"] == 64 and out["history_rows"] == round(history_rows_per_day(64) * 0.01)
    assert out["log_rows"] == out["history_rows"] and out["log_bytes"] > 0
    assert out["incidents"] == 1
    # The API read the snapshot at the history's end: nothing was left to fold.
    assert out["api_started_from"] == out["log_rows"]
    assert 0 < out["cold_start_s"] < 60
    assert set(out["routes"]) == {"timeline", "events"}
    for route in out["routes"].values():
        _route_figures(route)
    assert out["p50_ms"] > 0 and out["p99_ms"] >= out["p50_ms"]


def test_a_generated_history_is_a_log_the_api_serves(database_url):
    """A many-rank history as the API shows it: its incidents recovered, each timeline's
    points naming events in the log, the member and type filters on its rows."""
    written = write_history(database_url, 1200, 0.01, ranks=32, incidents=2)
    assert written.rows == 1200 and written.incidents == 2
    assert log_size(database_url)[0] == written.end
    with psycopg.connect(libpq_url(database_url)) as conn:
        counts = dict(
            conn.execute(
                "SELECT type, count(*) FROM events WHERE job_id = %s GROUP BY type",
                (written.job_id,),
            ).fetchall()
        )
    # Each recovery: every rank of the new world acked, restored and resumed.
    assert counts["command.acked"] == counts["restore.completed"] == counts["train.resumed"] == 64
    assert counts["backup.catalog"] == 2 and counts["incident.resolved"] == 2
    assert counts["job.completed"] == 1 and counts["train.step"] > 300
    api, base = start_api(database_url)
    try:
        assert first_answer(base, f"/api/v1/jobs/{written.job_id}", api, 60.0) is not None
        with httpx.Client(base_url=base) as http:
            job = http.get(f"/api/v1/jobs/{written.job_id}").json()
            assert job["state"] == "COMPLETED" and job["events"] == written.rows
            incidents = http.get(f"/api/v1/jobs/{written.job_id}/incidents").json()
            assert [i["outcome"] for i in incidents] == ["recovered", "recovered"]
            for incident in incidents:
                timeline = IncidentTimeline.model_validate_json(
                    http.get(
                        f"/api/v1/jobs/{written.job_id}/incidents/{incident['incident_id']}"
                    ).content
                )
                names = [p.name for p in timeline.points]
                assert names == ["fault", "detected", "decided", "acked", "restored", "first_step"]
                acked = timeline.points[3].position
                page = EventPage.model_validate_json(
                    http.get(
                        f"/api/v1/jobs/{written.job_id}/events",
                        params={"after": acked - 1, "limit": 1},
                    ).content
                )
                assert page.events[0].type == "command.acked"
            page = EventPage.model_validate_json(
                http.get(
                    f"/api/v1/jobs/{written.job_id}/events",
                    params={"member": "m7", "limit": 1000},
                ).content
            )
            # m7's join, then its ack, restore and resume of each incident.
            assert [e.type for e in page.events][:1] == ["member.joined"]
            assert sum(e.type == "command.acked" for e in page.events) == 2
            assert all(e.source.endswith("/m7") for e in page.events)
            loss = http.get(f"/api/v1/jobs/{written.job_id}/loss").json()
            assert len(loss["points"]) > 300
    finally:
        stop_api(api)


def test_bench_api_command_prints_one_json_object():
    done = CliRunner().invoke(
        app,
        ["bench", "api", "--events", "40000", "--clients", "2", "--seconds", "1", "--json"],
    )
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout)
    assert out["events"] == 40000 and out["incidents"] >= 1 and out["catch_up_s"] >= 0
    for route in out["routes"].values():
        _route_figures(route)
