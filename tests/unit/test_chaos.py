"""``elasticctl chaos``'s plan and settings (the run itself: tests/e2e/test_chaos.py)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from controlplane import netns
from controlplane.chaos import (
    ALL_KINDS,
    KINDS,
    LOSING,
    TAIL_S,
    WARMUP_S,
    Chaos,
    ChaosConfig,
    Fault,
    default_kinds,
    plan,
)


def test_a_plan_is_the_seeds_and_takes_every_kind_as_often():
    first = plan(30, 25, KINDS, seed=3)
    assert first == plan(30, 25, KINDS, seed=3)
    assert [p.kind for p in first] != [p.kind for p in plan(30, 25, KINDS, seed=4)]
    # Rounds: each len(KINDS) faults hold every kind once.
    for start in range(0, len(first) - len(KINDS) + 1, len(KINDS)):
        assert sorted(p.kind for p in first[start : start + len(KINDS)]) == sorted(KINDS)
    counts = Counter(p.kind for p in first)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_a_plan_spaces_faults_at_the_rate_within_the_window():
    faults = plan(30, 25, KINDS, seed=0)
    assert len(faults) >= 60  # the 30-minute soak's floor
    dues = [p.due_s for p in faults]
    assert dues == sorted(dues)
    assert dues[0] == WARMUP_S
    assert dues[-1] <= WARMUP_S + 30 * 60 - TAIL_S
    gaps = [b - a for a, b in itertools.pairwise(dues)]
    assert min(gaps) >= 25 / 2 - 1e-9 and max(gaps) <= 25 * 1.5 + 1e-9
    assert abs(sum(gaps) / len(gaps) - 25) < 2
    assert [p.index for p in faults] == list(range(len(faults)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kinds": ("crash", "flood")}, "not flood"),
        ({"kinds": ()}, "--kinds"),
        ({"nproc": 1}, "--nproc"),
        ({"spares": 0}, "--spares"),
        ({"every_s": 1.0}, "--every"),
        ({"minutes": 0.0}, "--minutes"),
    ],
)
def test_settings_that_cannot_make_a_run_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ChaosConfig(**change).validate()


def test_without_losing_kinds_no_spare_is_needed():
    ChaosConfig(spares=0, kinds=("nats", "postgres", "slow")).validate()


def test_the_stack_follows_the_kinds():
    full = ChaosConfig(minutes=2).demo_config()
    assert full.nats_cluster == 3 and full.standby
    assert full.crash_at == full.hang_at == full.nan_at == 0
    assert full.steps == ChaosConfig(minutes=2).steps() == round((WARMUP_S + 120) / 0.1)
    light = ChaosConfig(minutes=2, kinds=("crash", "hang")).demo_config()
    assert light.nats_cluster == 1 and not light.standby


def test_partitions_need_network_namespaces_and_put_the_services_where_hosts_reach_them(
    monkeypatch,
):
    """Cutting a host's links needs namespaces: refused with the reason where they cannot be
    made, and left out of the default mix; with them, the services listen on the control
    namespace's address."""
    monkeypatch.setattr(netns, "available", lambda: "network namespaces need root")
    with pytest.raises(ValueError, match=r"cut-control, cut-peers cut hosts' links: .* root"):
        ChaosConfig(kinds=("crash", "cut-control")).validate()
    assert default_kinds() == KINDS
    assert ChaosConfig(kinds=KINDS).demo_config().host == "127.0.0.1"
    monkeypatch.setattr(netns, "available", lambda: None)
    assert default_kinds() == ALL_KINDS
    config = ChaosConfig(kinds=("cut-peers",))
    config.validate()
    assert config.partitions and config.demo_config().host == netns.SERVICE
    assert all(k in LOSING for k in ("cut-control", "cut-peers"))


def test_credentials_cover_every_pod_the_run_may_start():
    config = ChaosConfig(minutes=5, every_s=10, nproc=3, spares=2)
    chaos = Chaos(config)
    losing = sum(1 for p in config.plan() if p.kind in LOSING)
    nodes = chaos._nodes()
    pods = nodes[chaos.job_id]
    assert pods[:3] == ["p0", "p1", "p2"]
    assert pods[3:] == [f"s{i}" for i in range(2 + losing)]
    assert nodes[f"{chaos.job_id}-ref"] == ["node0"]


def test_a_fault_never_injected_says_so():
    [first, *_] = plan(1, 10, KINDS, seed=0)
    report = Fault(first).report()
    assert report["outcome"] == "not injected"
    assert report["at_s"] is None and report["waited_s"] is None and report["downtime_s"] is None


def test_the_human_report_names_every_fault_and_why_a_run_was_cut_short():
    from rich.console import Console

    from controlplane.chaos import render_chaos

    [first, second, *_] = plan(1, 10, KINDS, seed=0)
    done = Fault(second, at_s=31.0, target="p1-w0", outcome="recovered")
    summary = {
        "job_id": "chaos-x",
        "faults": [Fault(first).report(), done.report()],
        "aborted": "the control plane (serve) exited (status 1)",
        "totals": {"handled": 1, "injected": 1, "recovered": 1, "tolerated": 0, "failed": 0},
        "log": {"missing": 0, "duplicated": 0, "events": 10},
        "job_state": "RUNNING",
        "completed_step": None,
        "steps": 800,
        "final_loss": None,
        "reference_loss": 0.01,
        "loss_rel_diff": None,
        "ettr": None,
    }
    console = Console(record=True, width=200)
    render_chaos(summary, console)
    text = console.export_text()
    assert "not injected" in text and "p1-w0" in text and "recovered" in text
    assert "aborted: the control plane (serve) exited" in text
    assert "1/1 faults handled" in text


def test_the_leading_control_plane_is_read_from_what_each_logged_last(tmp_path):
    from typing import Any, cast

    from controlplane.demo import Child, leads

    def child(*lines: str) -> Child:
        log = tmp_path / f"serve{len(lines)}-{abs(hash(lines))}.log"
        log.write_text("".join(f"2026-12-07 INFO {line}\n" for line in lines))
        return Child("serve", cast(Any, None), log)

    assert not leads(child("another control plane holds the ingest lock; standing by"))
    assert leads(child("took over the ingest lock", "ingesting from nats://a into PostgreSQL"))
    # A PostgreSQL restart ended its lock: it stands by, though it led before.
    assert not leads(
        child(
            "ingesting from nats://a into PostgreSQL; deciding",
            "lost the ingest lock; stopping ingest until it is ours again",
            "another control plane holds the ingest lock; standing by",
        )
    )
    # ... and leads again once it took the lock back.
    assert leads(
        child(
            "ingesting from nats://a",
            "lost the ingest lock; stopping ingest until it is ours again",
            "took over the ingest lock",
            "ingesting from nats://a",
        )
    )
    assert not leads(Child("gone", cast(Any, None), tmp_path / "missing.log"))
