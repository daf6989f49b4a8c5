"""``elasticctl bench decide`` on a small world: every fault is timed, to the commit."""

from __future__ import annotations

import pytest

from controlplane.bench.decide import run_decide_bench

pytestmark = pytest.mark.services


def test_bench_decide_times_every_fault():
    out = run_decide_bench(members=16, faults=2, progress=False)
    assert out["members"] == 16 and out["faults"] == 2 and out["decisions"] == 2
    assert out["measured_to"] == "commit"  # the embedded PostgreSQL records commit times
    crash, hang = out["legs_ms"]
    assert len(crash) == 3 and len(hang) == 2  # a crash's exit ingest is timed too
    assert all(0 < x < 10_000 for x in out["latencies_ms"] + out["command_latencies_ms"])
    assert out["p50_ms"] <= out["p99_ms"] <= out["max_ms"]
    assert out["backup_caught_up_s"] >= 0 and out["heartbeats_per_s"] > 0
    assert out["sequence_gaps"] == 0  # each member's events reach the stream in seq order
