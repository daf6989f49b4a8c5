"""``elasticctl chaos`` end to end: one round of every fault kind against a training job, on
the run's own NATS cluster and PostgreSQL; every fault handled, the log whole, the loss the
fault-free reference's, nothing left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from controlplane import netns
from controlplane.chaos import KINDS, LOSING, PARTITION_KINDS, plan

pytestmark = pytest.mark.timeout(660)

ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).with_name("elasticctl")
ELASTICCTL = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "controlplane"]
#: One round of the seven kinds, about two and a half minutes in all.
ARGS = ["--minutes", "1.5", "--every", "12", "--seed", "0", "--kinds", ",".join(KINDS)]
#: Both partitions, one after the other (each host stays cut 20 s), about two minutes.
PARTITION_ARGS = ["--minutes", "0.9", "--every", "30", "--seed", "0",
                  "--kinds", ",".join(PARTITION_KINDS)]  # fmt: skip


def chaos(tmp_path: Path, args: list[str]) -> dict:  # type: ignore[type-arg]
    """Run ``elasticctl chaos`` with ``args``; its JSON report, once it exited 0."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("ELASTIC_NATS_URL", "ELASTIC_DATABASE_URL")
    }
    err = tmp_path / "chaos.err"
    with err.open("wb") as stderr:
        done = subprocess.run(
            [*ELASTICCTL, "chaos", *args, "--json", "--state-dir", str(tmp_path / "state")],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            cwd=ROOT,
            timeout=600,
            check=False,
        )
    progress = err.read_text()
    assert done.returncode == 0, progress[-4000:]
    return json.loads(done.stdout)


def assert_whole(summary: dict, planned: list, tmp_path: Path) -> None:  # type: ignore[type-arg]
    """Every planned fault handled, a lost member's by its own recovered incident; the job
    completed at the reference's loss, its log whole; nothing of the run left running."""
    faults = summary["faults"]
    assert [f["kind"] for f in faults] == [p.kind for p in planned]
    for fault in faults:
        assert fault["outcome"] in ("recovered", "tolerated"), fault
        if fault["kind"] in LOSING:
            # The lost member's own incident, found as its kind is found, and recovered.
            assert fault["outcome"] == "recovered", fault
            [incident] = fault["incidents"]
            assert incident["members"] == [fault["target"].split()[0]]
            expected = {"crash": "exited", "cut-peers": "reported"}.get(
                fault["kind"], "heartbeat_timeout"
            )
            assert fault["detected_by"] == [expected], fault
            assert incident["mode"] == "replace" and incident["downtime_s"] > 0
    totals = summary["totals"]
    assert totals["injected"] == totals["handled"] == len(planned)
    assert totals["spare_pods_started"] == sum(1 for p in planned if p.kind in LOSING)
    assert summary["job_state"] == "COMPLETED" and summary["completed_step"] == summary["steps"]
    assert summary["log"]["whole"] and summary["log"]["missing"] == 0
    assert summary["log"]["duplicated"] == 0
    assert summary["loss_ok"] and summary["loss_rel_diff"] <= 0.01
    assert 0 < summary["ettr"] <= 1
    assert summary["recovered"] is True
    # Nothing of the run is left: no launcher of its job, no server of its state directory.
    job = summary["job_id"]
    state = str(tmp_path / "state")
    left = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if any(job in part or state in part for part in p.info["cmdline"] or ())
    ]
    assert not left


def test_a_round_of_every_fault_kind_is_handled_and_the_job_ends_at_the_reference_loss(
    tmp_path: Path,
) -> None:
    planned = plan(1.5, 12, KINDS, seed=0)
    assert sorted(p.kind for p in planned) == sorted(KINDS)
    summary = chaos(tmp_path, ARGS)
    assert_whole(summary, planned, tmp_path)
    faults = summary["faults"]
    control = next(f for f in faults if f["kind"] == "control")
    # Another control plane took over: not the one killed.
    assert control["detail"]["takeover_s"] >= 0
    assert control["detail"]["leader"] != control["target"].removeprefix("control plane ")
    nats = next(f for f in faults if f["kind"] == "nats")
    assert nats["target"].startswith("NATS node") and "healthy_after_s" in nats["detail"]
    # The slowed worker computed about twice as long as the others, and was recorded slow.
    slow = next(f for f in faults if f["kind"] == "slow")["detail"]
    assert slow["flagged_slow"] and slow["compute_s"] > 1.5 * slow["job_compute_s"], slow


def test_a_workers_host_cut_from_the_control_plane_or_from_its_peers_is_replaced(
    tmp_path: Path,
) -> None:
    """Every pod on a host of its own (network namespaces, as root): a worker's host cut
    from the control plane is found silent, one cut from its peers is named by them; each
    is replaced by a spare on another host, fenced once joined again, and the job ends at
    the reference's loss."""
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    planned = plan(0.9, 30, PARTITION_KINDS, seed=0)
    assert sorted(p.kind for p in planned) == sorted(PARTITION_KINDS)
    summary = chaos(tmp_path, PARTITION_ARGS)
    assert_whole(summary, planned, tmp_path)
