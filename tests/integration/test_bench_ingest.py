"""``elasticctl bench ingest`` on a small load: every event stored once, the figures printed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from controlplane.bench.ingest import _cpu_seconds, run_ingest_bench

pytestmark = pytest.mark.services


def test_bench_ingest_stores_every_event_once_and_times_each_process(monkeypatch):
    monkeypatch.delenv("ELASTIC_NATS_URL", raising=False)  # embedded servers, timed too
    monkeypatch.delenv("ELASTIC_DATABASE_URL", raising=False)
    # Enough events that the publisher's ~1.5 us each add up to more than one clock tick
    # (10 ms) of CPU: with 3,000 it sometimes measured 0.
    out = run_ingest_bench(events=20_000, members=8, progress=False)
    assert out["events"] == 20_000 and out["fold_members"] == 8
    assert out["lost"] == out["duplicated"] == out["publish_refused"] == 0
    assert out["events_per_s"] > 0 and out["fold_events_per_s"] > 0
    assert 0 < out["publish_s"] <= out["commit_s"]
    # Every process's CPU is counted, PostgreSQL's backends included.
    cpu = out["cpu_us_per_event"]
    assert set(cpu) == {"controlplane", "publisher", "nats", "postgres"}
    assert all(v > 0 for v in cpu.values()), cpu


def test_the_cpu_of_a_process_s_ended_children_counts_for_postgres_only():
    me = {"postgres": os.getpid(), "publisher": os.getpid()}
    before = _cpu_seconds(me)
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)  # ended and reaped
    after = _cpu_seconds(me)
    assert after["postgres"] - before["postgres"] >= 0.25  # a backend that ended meanwhile
    assert after["publisher"] - before["publisher"] < 0.25
