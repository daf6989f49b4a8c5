"""``elasticctl bench scale`` on a small world: every figure is measured, none is missing."""

from __future__ import annotations

import pytest

from controlplane.bench.scale import run_scale_bench

pytestmark = pytest.mark.services


def test_bench_scale_measures_detection_decisions_storage_and_cpu():
    out = run_scale_bench(
        ranks=32, seconds=12, steady_seconds=11, faults=2, heartbeat_interval_s=0.2,
        hang_timeout_s=1.0, backup_interval=5, progress=False,
    )  # fmt: skip
    assert out["ranks"] == 32 and out["faults"] == 2 and out["decided"] == 2
    assert out["measured_to"] == "commit"  # the embedded PostgreSQL records commit times
    # A hang is found no sooner than its timeout after its last heartbeat, and it is found.
    assert out["hang_detect_p50_s"] is not None and 1.0 <= out["hang_detect_p50_s"] < 10
    assert len(out["crash_decide_ms"]) == 1 and len(out["hang_decide_ms"]) == 1
    assert all(0 < x < 10_000 for x in out["crash_decide_ms"] + out["hang_decide_ms"])
    assert out["decide_p50_ms"] <= out["decide_p99_ms"]
    # The fault-free window held steps, a backup and a summary: the log grew, by those types;
    # each fault added its decision and generation on top.
    assert out["db_payload_bytes_per_fault"] > 0
    # Measured over whole backup intervals (2 of 5 s), split by relation: the growth of the
    # partitions of the log (kept events, the spans of observations) and the other tables.
    # Tables grow by whole 8 KB pages: 32 ranks' rows may fill no new one in 10 s.
    assert out["steady_backups"] == 2 and 9 < out["steady_seconds"] < 12
    by_relation = out["db_bytes_per_rank_day_by_relation"]
    assert out["db_bytes_per_rank_day"] >= 0
    assert abs(sum(by_relation.values()) - out["db_bytes_per_rank_day"]) <= len(by_relation)
    assert out["command_bytes_max"] > 0
    # Each backup's reports reach the log packed, a catalog per run (core.catalog).
    assert {"train.step", "backup.catalog", "liveness.summary"} <= set(
        out["db_bytes_per_rank_day_by_type"]
    )
    assert 0 < out["controlplane_cpu_cores"] < 4
    assert out["heartbeats_per_s"] > 100  # 32 members and 2 spares, 5 a second each
    # Each node's launcher relays its members' heartbeats: 6 messages an interval, not 34.
    assert out["heartbeats"] == "node"
    assert 0 < out["heartbeat_messages_per_s"] * 4 < out["heartbeats_per_s"]
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["refused"] == 0
    assert out["false_detections"] == 0 and out["false_detections_by_reason"] == {}
