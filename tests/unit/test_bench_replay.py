"""``elasticctl bench replay`` on small files, a synthetic job's and a generated history's (the
figures themselves are not asserted)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from controlplane.bench.history import history_rows_per_day
from controlplane.bench.replay import run_replay_bench, write_history_log, write_synthetic_log
from controlplane.cli import app
from controlplane.postmortem.logfile import read_log


def test_the_synthetic_log_is_a_valid_log_file(tmp_path):
    path = tmp_path / "log.jsonl"
    size = write_synthetic_log(path, events=700, members=8)
    assert size == path.stat().st_size > 0
    with path.open("rb") as stream:
        events = list(read_log(stream))
    assert [s.position for s in events] == list(range(1, 701))
    assert {s.event.type for s in events} >= {"member.heartbeat", "train.step", "backup.replicated"}


def test_bench_replay_reports_the_rate_it_measured():
    result = run_replay_bench(events=1500, members=8)
    assert result["events"] == 1500
    assert result["events_per_s"] > 0
    assert result["events_per_s"] == pytest.approx(1500 / result["seconds"], rel=0.01)
    assert result["state"] == "RUNNING" and result["last_step"] > 0
    assert result["read_events_per_s"] > 0 and result["fold_events_per_s"] > 0


def test_bench_replay_command_prints_one_json_object():
    done = CliRunner().invoke(
        app, ["bench", "replay", "--events", "300", "--members", "4", "--json"]
    )
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout)
    assert {"events", "events_per_s", "seconds"} <= set(out) and out["events"] == 300


def test_bench_replay_of_a_history_reports_rank_seconds(tmp_path):
    # 0.01 days of a 32-rank job, as bench api and bench takeover generate it.
    path = tmp_path / "history.jsonl"
    events, size = write_history_log(path, ranks=32, days=0.01)
    assert events == round(history_rows_per_day(32) * 0.01) and size == path.stat().st_size
    with path.open("rb") as stream:  # every line is a valid stored event, in order
        assert [s.position for s in read_log(stream)] == list(range(1, events + 1))
    result = run_replay_bench(events=0, ranks=32, days=0.01)
    assert result["events"] == events and result["state"] == "COMPLETED"
    assert result["members"] == 34  # 32 ranks and 2 spares
    assert result["rank_seconds_per_s"] == pytest.approx(32 * 864 / result["seconds"], rel=0.01)
