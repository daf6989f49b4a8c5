"""``elasticctl simulate``: the real decider over simulated members, time and failures."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.core.replay import redecide
from controlplane.postmortem.simulate import (
    PRESETS,
    Failure,
    Model,
    Rates,
    draw,
    model_with,
    read_trace,
    simulate,
    simulate_decider,
    young_daly,
)


@pytest.mark.parametrize("strategy", ["spares", "shrink", "mixed", "restart"])
def test_without_failures_ettr_is_one_minus_the_backup_overhead(strategy):
    model = Model(step_s=2.0, backup_interval=10, backup_cost_s=0.05)
    spares = 0 if strategy == "shrink" else 2
    result = simulate(strategy, ranks=64, days=3, spares=spares, rates=Rates(), model=model)
    if strategy == "restart":  # a checkpoint every interval of training, each its cost
        cost = model.checkpoint_cost_s
        overhead = cost / (model.checkpoint_interval_s + cost)
        # Whole checkpoints only: the last partial interval has none (within one's cost).
        assert result.ettr == pytest.approx(1 - overhead, abs=cost / result.wall_s)
    else:
        assert result.ettr == pytest.approx(1 - model.backup_share(), rel=1e-12)
        assert result.breakdown["backup"] == pytest.approx(result.wall_s * model.backup_share())
    assert result.incidents == [] and sum(result.failures.values()) == 0
    assert sum(result.breakdown.values()) == pytest.approx(result.wall_s)


def test_the_same_seed_gives_the_same_result_and_another_seed_another():
    rates = PRESETS["seed512"].rates
    one = simulate("mixed", ranks=64, days=4, rates=rates, seed=3).summary()
    again = simulate("mixed", ranks=64, days=4, rates=rates, seed=3).summary()
    other = simulate("mixed", ranks=64, days=4, rates=rates, seed=4).summary()
    for summary in (one, again, other):
        summary.pop("simulated_in_s")
    assert one == again and one["incidents"] > 0
    assert other != one


def test_every_incident_is_decided_by_the_decider_and_a_replay_re_decides_it():
    """The log the simulation made is what the control plane would have recorded: a replay
    of it re-decides every decision (``core.replay.redecide``: the live decider's code on
    the same events), a crash found by its exit, a hang and a lost node by their silence."""
    failures = [Failure(3_000.0, "crash", 1), Failure(9_000.0, "hang", 2),
                Failure(20_000.0, "node", 3), Failure(30_000.0, "crash", 8)]  # fmt: skip
    result, log = simulate_decider("spares", ranks=64, spares=2, days=1, failures=failures,
                                   model=Model(), seed=1)  # fmt: skip
    made, ignored = log.take()
    assert not ignored  # every event made is believed by the fold
    batches = redecide(made)
    assert batches and all(batch.matches for batch in batches)
    view = log.v
    reasons = [next(iter(i.reasons)) for i in view.incidents.values()]
    assert "killed by signal 9" in reasons[0] and "silent" in reasons[1] and "silent" in reasons[2]
    assert [i.kind for i in result.incidents] == ["crash", "hang", "node", "crash"]
    assert all(i.mode == "replace" for i in result.incidents)
    # The node's eight members were replaced by the eight spares of a spare node.
    assert result.incidents[2].members == 8 and len(view.world) == 64
    # Detection: a crash at its exit report, a silence one timeout and a beat later.
    model = Model()
    assert result.incidents[0].phases["detection"] == pytest.approx(model.exit_report_s)
    hang = model.heartbeat_timeout_s + model.heartbeat_interval_s
    assert result.incidents[1].phases["detection"] == pytest.approx(hang)
    # The decider restored the newest backup before each fault: at most an interval lost.
    assert all(0 <= i.steps_lost <= model.backup_interval for i in result.incidents)
    assert result.spares_used == 10  # the spare node's eight and two more of the other's


def test_a_smaller_world_grows_back_after_the_repair():
    model = Model(repair_s=3_600.0)
    result, log = simulate_decider("shrink", ranks=64, spares=0, days=0.25,
                                   failures=[Failure(1_000.0, "node", 2)], model=model)  # fmt: skip
    kinds = [(i.kind, i.mode) for i in result.incidents]
    assert kinds == [("node", "shrink"), ("growth", "grow")], kinds
    assert result.final_world == 64
    assert result.breakdown["shrunk"] > 0  # an hour at 56 of 64 ranks
    assert all(batch.matches for batch in redecide(log.take()[0]))


def test_without_a_spare_the_spares_strategy_waits_for_the_repair():
    model = Model(repair_s=1_800.0)
    failures = [Failure(1_000.0, "node", 1), Failure(2_000.0, "node", 2)]
    result, _ = simulate_decider("spares", ranks=32, spares=1, days=0.1, failures=failures,
                                 model=model)  # fmt: skip
    first, second = result.incidents
    assert "waiting" not in first.phases
    # The second node waits for the first one's repair (at 2,800 s): about 800 s.
    assert second.phases["waiting"] == pytest.approx(2_800.0 - 2_000.0 - second.phases[
        "detection"] - second.phases["decision"], abs=1.0)  # fmt: skip
    assert result.final_world == 32


def test_a_sweep_finds_the_checkpoint_interval_young_and_daly_predict():
    """Checkpoint-restart under exponential crashes: the best interval of a sweep is within
    20% of sqrt(2 x cost x MTBF)."""
    model = Model(checkpoint_cost_s=30.0, restart_s=60.0, checkpoint_load_s=30.0)
    rates = Rates(crash=4.0)  # per node-day: 8 nodes, an MTBF of 45 minutes
    days = 2_000.0
    failures = draw(rates, 8, 1, days * 86_400, seed=7)
    mtbf = 86_400 / (4.0 * 8)
    optimum = young_daly(model.checkpoint_cost_s, mtbf)
    factors = [0.5 + 0.05 * k for k in range(31)]  # 0.5x to 2x
    ettr = {
        f: simulate("restart", ranks=64, days=days, spares=0, failures=failures,
                    model=model_with(model, {"checkpoint_interval_s": f * optimum})).ettr
        for f in factors
    }  # fmt: skip
    best = max(ettr, key=ettr.__getitem__)
    assert abs(best - 1) <= 0.2, (best, ettr)


def test_failures_are_drawn_per_kind_at_their_rates():
    rates = Rates(crash=1.0, hang=0.5, node=0.25, rack=2.0)
    failures = draw(rates, 100, 4, 200 * 86_400, seed=1)
    counts = {k: sum(f.kind == k for f in failures) for k in ("crash", "hang", "node", "rack")}
    expected = {"crash": 20_000, "hang": 10_000, "node": 5_000, "rack": 1_600}
    for kind, n in expected.items():
        assert abs(counts[kind] - n) < 5 * math.sqrt(n), (kind, counts)
    assert failures == sorted(failures, key=lambda f: f.at_s)
    assert all(f.target < (4 if f.kind == "rack" else 100) for f in failures)


def test_a_trace_file_is_read_and_a_bad_line_named(tmp_path):
    good = tmp_path / "trace.jsonl"
    good.write_text('{"at_s": 20, "kind": "node", "node": 3}\n\n'
                    '{"at_s": 5.5, "kind": "rack", "rack": 1}\n')  # fmt: skip
    assert read_trace(good) == [Failure(5.5, "rack", 1), Failure(20.0, "node", 3)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"at_s": 20, "kind": "node", "node": 3}\n{"at_s": 1, "kind": "meteor"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_trace(bad)


def test_model_fields_are_checked():
    assert model_with(Model(), {"step_s": "4", "backup_interval": "20"}).backup_interval == 20
    for overrides, says in [({"nope": 1}, "unknown model field"), ({"step_s": "x"}, "number"),
                            ({"step_s": 0}, "positive"), ({"backup_interval": 2.5}, "whole")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            model_with(Model(), overrides)


def test_the_command_prints_strategies_side_by_side_and_a_sweep_its_best():
    runner = CliRunner()
    shown = runner.invoke(app, ["simulate", "--ranks", "64", "--days", "2", "--preset",
                                "seed512", "--json"])  # fmt: skip
    assert shown.exit_code == 0, shown.output
    out = json.loads(shown.stdout)
    assert [r["strategy"] for r in out["runs"]] == ["spares", "mixed", "restart"]
    assert all(0 < r["ettr"] <= 1 for r in out["runs"])
    assert out["young_daly"]["mtbf_s"] == pytest.approx(86_400 / out["failures_per_day"], rel=1e-3)
    swept = runner.invoke(app, ["simulate", "--ranks", "64", "--days", "2", "--strategy",
                                "restart", "--sweep", "checkpoint_interval_s=600,1800",
                                "--json"])  # fmt: skip
    assert swept.exit_code == 0, swept.output
    found = json.loads(swept.stdout)
    assert [r["sweep"]["checkpoint_interval_s"] for r in found["runs"]] == [600.0, 1800.0]
    assert found["best"]["ettr"] == max(r["ettr"] for r in found["runs"])
    bad = runner.invoke(app, ["simulate", "--strategy", "pray"])
    assert bad.exit_code == 2 and "--strategy" in bad.output
