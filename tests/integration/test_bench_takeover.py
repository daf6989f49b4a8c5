"""``elasticctl bench takeover`` on a small job: the standby decides from the snapshot its
predecessor recorded, and every figure is measured."""

from __future__ import annotations

import pytest

from controlplane.bench.takeover import history_rows_per_day, run_takeover_bench

pytestmark = pytest.mark.services


def test_bench_takeover_starts_the_standby_from_a_snapshot_and_times_its_decision():
    # 864 s of history: a step a second between liveness summaries, in chunks of 120 s.
    out = run_takeover_bench(ranks=16, days=0.01, history_rows=5000, api_wait_s=60,
                             progress=False)  # fmt: skip
    assert out["history_rows"] == 5000 and out["log_rows"] > 5000
    assert out["history_end_position"] == 5000
    # The standby started from the leader's snapshot of the running job, past the history.
    assert out["standby_started_from"].startswith("the view snapshot at position")
    position = int(out["standby_started_from"].rsplit(" ", 1)[1])
    assert position > out["history_end_position"]
    assert out["standby_tail_events"] is not None and out["standby_startup_s"] is not None
    # Its decision on the crash came, and it was committed after the kill.
    assert 0 < out["takeover_decision_s"] <= out["takeover_command_s"] < 60
    assert out["api_first_answer_s"] is not None and 0 < out["api_first_answer_s"] < 60
    # The history's loss curve, a step a second: from the chunks, not from a fold of the log.
    assert out["api_history_loss_points"] == 864
    assert out["log_bytes"] > 0


def test_a_day_of_a_large_job_is_mostly_its_ranks_recoveries():
    # Steps, catalogs (16 a backup), summaries, and 8 incidents of 3 events per rank.
    assert history_rows_per_day(16_384) == 86_400 + 8_640 * 16 + 8_640 + 8 * 3 * 16_384
    assert history_rows_per_day(1) == 86_400 + 8_640 + 8_640 + 24
