"""``elasticctl bench mttr``'s summary: per-phase medians and the restore's rate (no jobs run)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from controlplane.bench import BenchError
from controlplane.bench.mttr import (
    EXAMPLES_RUN,
    _restore_rate,
    _summary,
    restored,
    run_mttr_bench,
    schedule,
)
from controlplane.core.timeline import PHASES


def incident(downtime: float, phases: dict[str, float | None], **extra: Any) -> dict[str, Any]:
    return {"members": ["w1"], "downtime_s": downtime, "steps_lost": 5, "phases": phases, **extra}


def phases(detect: float, ack: float, restore: float, resume: float | None) -> dict[str, Any]:
    return {"detect": detect, "decide": 0.0, "ack": ack, "restore": restore, "resume": resume}


def test_the_summary_has_the_median_of_every_phase():
    incidents = [
        incident(0.10, phases(0.002, 0.010, 0.030, 0.058)),
        incident(0.08, phases(0.004, 0.020, 0.020, 0.036)),
        incident(0.12, phases(0.003, 0.030, 0.040, 0.047)),
    ]
    summary = _summary(incidents, schedule(3, 10))
    assert summary["mttr_median_s"] == 0.10
    assert list(summary["phases_median_s"]) == list(PHASES)
    assert summary["phases_median_s"] == {
        "detect": 0.003, "decide": 0.0, "ack": 0.020, "restore": 0.030, "resume": 0.047,
    }  # fmt: skip
    assert "restore_gbps" not in summary  # no restore.completed payloads were given


def test_a_phase_no_incident_reached_has_no_median_and_the_others_skip_the_gaps():
    incidents = [
        incident(0.10, phases(0.002, 0.010, 0.030, None)),
        incident(0.08, phases(0.004, 0.020, 0.020, 0.040)),
    ]
    medians = _summary(incidents, schedule(2, 10))["phases_median_s"]
    assert medians["resume"] == 0.040
    only_gaps = [incident(0.1, phases(0.002, 0.010, 0.030, None))]
    assert _summary(only_gaps, schedule(1, 10))["phases_median_s"]["resume"] is None


def test_the_summary_refuses_a_fault_that_left_no_incident():
    with pytest.raises(BenchError, match="2 faults injected, 1 incidents"):
        _summary([incident(0.1, phases(0.0, 0.0, 0.0, 0.0))], schedule(2, 10))


def payload(generation: int, nbytes: int, seconds: float) -> dict[str, Any]:
    return {"generation": generation, "step": 20, "bytes": nbytes, "seconds": seconds}


def test_the_restore_rate_is_all_bytes_over_the_longest_member_of_the_decided_world():
    decision = SimpleNamespace(generation=3)
    fake = SimpleNamespace(decisions=[SimpleNamespace(generation=2), decision])
    restores = [
        payload(2, 10**9, 0.001),  # an earlier, overtaken decision: not this restore
        payload(3, 300_000_000, 0.5),
        payload(3, 300_000_000, 0.25),
        payload(3, 400_000_000, 0.4),
    ]
    nbytes, gbps = _restore_rate(fake, restores)
    assert nbytes == 10**9
    assert gbps == pytest.approx(2.0)
    assert _restore_rate(SimpleNamespace(decisions=[]), restores) == (None, None)
    nothing = SimpleNamespace(decisions=[SimpleNamespace(generation=9)])
    assert _restore_rate(nothing, restores) == (0, None)


def test_the_summary_reports_the_median_restore_rate_and_bytes():
    incidents = [
        incident(0.5, phases(0.0, 0.0, 0.3, 0.2), restore_bytes=10**9, restore_gbps=1.0),
        incident(0.6, phases(0.0, 0.0, 0.3, 0.2), restore_bytes=10**9, restore_gbps=3.0),
        incident(0.7, phases(0.0, 0.0, 0.3, 0.2), restore_bytes=2 * 10**9, restore_gbps=2.0),
    ]
    summary = _summary(incidents, schedule(3, 2))
    assert summary["restore_gbps"] == 2.0
    assert summary["restore_bytes"] == 10**9


def test_restored_picks_the_restore_completed_payloads():
    def stored(type_: str, body: dict[str, Any]) -> Any:
        model = SimpleNamespace(model_dump=lambda mode: body)
        return SimpleNamespace(event=SimpleNamespace(type=type_, payload=model))

    events = [
        stored("train.step", {"step": 3}),
        stored("restore.completed", payload(2, 5, 0.1)),
        stored("command.acked", {}),
    ]
    assert restored(events) == [payload(2, 5, 0.1)]


def test_the_examples_and_their_defaults():
    assert EXAMPLES_RUN["mlp"].script == "train.py"
    transformer = EXAMPLES_RUN["transformer"]
    assert transformer.script == "transformer.py"
    args = list(transformer.args)
    flags = {a for a in args if a.startswith("--")}
    value = {a: args[i + 1] for i, a in enumerate(args[:-1]) if not args[i + 1].startswith("--")}
    rows, dim = int(value["--ngram-rows"]), int(value["--dim"])
    # The row-sharded trigram embedding alone: parameters plus AdamW's two moments, fp32, over
    # the ranks; the output head stays over the bytes (no --vocab).
    assert 3 * 4 * rows * dim >= 10**9
    assert "--vocab" not in flags and "--fused-adamw" in flags
    assert "redundancy=1" in transformer.policy
    last, _rank = schedule(transformer.faults, transformer.backup_interval)[-1]
    assert last + 2 * transformer.backup_interval <= 100  # a cheap step: under a minute


def test_an_unknown_example_or_security_mode_is_refused_before_anything_runs():
    with pytest.raises(BenchError, match="example is one of mlp, transformer"):
        run_mttr_bench(example="resnet")
    with pytest.raises(BenchError, match="security is one of"):
        run_mttr_bench(security="maybe")


def test_trace_marks_go_nowhere_unless_asked(tmp_path, monkeypatch):
    from rank_runtime import trace

    monkeypatch.delenv(trace.TRACE_DIR_ENV, raising=False)
    with trace.span("build", generation=2):
        pass
    trace.mark("load", 1.0, 0.5, generation=2)
    monkeypatch.setenv(trace.TRACE_DIR_ENV, str(tmp_path / "marks"))
    monkeypatch.setenv("ELASTIC_MEMBER", "w9")
    with trace.span("build") as fields:
        fields["generation"] = 4
    trace.close()
    (written,) = (tmp_path / "marks").glob("w9-*.jsonl")
    (line,) = written.read_text().splitlines()
    record = json.loads(line)
    assert record["what"] == "build" and record["generation"] == 4 and record["seconds"] >= 0


def test_the_trace_summary_takes_the_spare_and_the_survivor_ready_last(tmp_path, monkeypatch):
    """Per incident: the member that waited as a spare, and of the others in the new world
    the one whose state was loaded last; each part's seconds and its end after the fault."""
    from controlplane.bench.mttr import _trace_medians, trace_summary
    from rank_runtime import trace

    monkeypatch.setenv(trace.TRACE_DIR_ENV, str(tmp_path))
    fault = 1000.0

    def marks(member: str, *items: tuple[str, int | None, float, float]) -> None:
        monkeypatch.setenv("ELASTIC_MEMBER", member)
        for what, generation, start, seconds in items:
            trace.mark(what, fault + start, seconds, generation=generation)

    marks("s0", ("start.wait", 2, -30.0, 30.02), ("build", 2, 0.05, 0.1), ("load", 2, 0.5, 0.05),
          ("first_step", 2, 0.56, 0.25))  # fmt: skip
    marks("w1", ("recover.gc", None, -0.05, 0.01), ("load", 2, 0.2, 0.1),
          ("first_step", 2, 0.3, 0.51))  # fmt: skip
    marks("w2", ("recover.gc", None, -0.05, 0.02), ("load", 2, 0.2, 0.2),
          ("first_step", 2, 0.4, 0.41), ("load", 3, 50.0, 0.3))  # fmt: skip
    marks("w3", ("recover.gc", None, -0.05, 0.01))  # left out of generation 2
    trace.close()
    incidents = [{"generation": 2, "fault_at": fault, "first_step_at": fault + 0.82},
                 {"downtime_s": 1.0}]  # fmt: skip
    (summary,) = trace_summary(tmp_path, incidents)
    assert summary["generation"] == 2
    spare, survivor = summary["spare"], summary["survivor"]
    assert spare["load"] == pytest.approx(0.05) and spare["first_step_at"] == pytest.approx(0.81)
    assert spare["start.wait_at"] == pytest.approx(0.02)
    assert survivor["load"] == pytest.approx(0.2) and survivor["ready_at"] == pytest.approx(0.4)
    assert survivor["recover.gc"] == pytest.approx(0.02)  # w2's, ready last
    medians = _trace_medians([summary, summary])
    assert medians["spare"]["load"] == pytest.approx(0.05)
