"""Generations are fences, with real processes (issue 21, "Must show"): a rank SIGSTOPped at
step 25 is found by its heartbeats and replaced by the spare; the launcher runs with
``--no-fence``, so nothing kills it, and the test resumes it (SIGCONT) right after the
decision, as if the launcher's fencing kill had not landed yet. The resumed rank's late
heartbeats of the abandoned generation are refused, its late events (when it sends any) reach
the log as discounts, and neither changes a decision: the job completes, only the hung rank
was ever found failed, and the run ends where a fault-free run of the same seed ends.
"""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any

import pytest

from controlplane.core.catalog import unpacked
from controlplane.core.timeline import timeline
from schemas.common import JobState
from tests.e2e.test_recovery import assert_matches_reference, ensure_reference, launch
from tests.integration.helpers import running_controlplane, wait_until

pytestmark = [pytest.mark.usefixtures("clean_stream"), pytest.mark.timeout(300)]

#: Rank 0: it stores a step record every step (the others only their first of each
#: generation), so the record of its step 25, still in its buffer when it stopped, goes out
#: late when it resumes.
HUNG = "w0"
#: Late events of an abandoned generation the fold must discount (not merely ignore).
STALE_TYPES = frozenset(
    {"member.heartbeat", "train.step", "member.fault", "backup.snapshot", "backup.replicated"}
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):  # type: ignore[no-untyped-def]
    return tmp_path_factory.mktemp("reference") / "clean.pt"


def _decided(cp: Any, job: str) -> bool:
    view = cp.views.get(job)
    return view is not None and any(i.decisions for i in view.incidents.values())


async def test_a_hung_rank_resumed_after_its_replacement_changes_nothing(
    settings, pg_store, tmp_path, reference
):
    out = tmp_path / "stale.pt"
    job = f"job-stale-{uuid.uuid4().hex[:6]}"
    async with running_controlplane(settings) as cp:
        await ensure_reference(settings, cp, reference)
        proc = launch(settings, job, out, ["hang@25:rank=0"], options=("--no-fence",))
        try:
            await wait_until(lambda: _decided(cp, job), 120, f"{HUNG}'s replacement")
            view = cp.views[job]
            [incident] = view.incidents.values()
            decision = incident.decisions[0]
            pid = view.launched[HUNG].pid
            os.kill(pid, signal.SIGCONT)  # resumed before any fence: none comes
            await wait_until(lambda: proc.poll() is not None, 240, f"job {job} to finish")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        code = proc.returncode
        view = cp.views[job]
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    # Found by its heartbeats and replaced by the spare; no one else was ever found failed.
    detected = [s.event.payload for s in pg_store.read(job_id=job, types=["fault.detected"])]
    assert [(d.members, d.reason) for d in detected] == [([HUNG], "heartbeat_timeout")]
    [incident] = view.incidents.values()
    assert [d.generation for d in incident.decisions] == [decision.generation]  # no cascade
    assert decision.mode == "replace" and "s0" in decision.world and HUNG not in decision.world
    assert timeline(incident).outcome == "recovered"
    # The resumed rank saw it was left out and left (status 1), but it was replaced and the
    # job completed: the launcher exits 0.
    assert code == 0
    # Its late events of generation 1, recorded after generation 2 was decided.
    log = list(unpacked(pg_store.read(job_id=job)))  # backup reports as their members sent them
    late = [
        s
        for s in log
        if s.position > decision.position
        and s.event.source.endswith(f"/{HUNG}")
        and s.event.generation < decision.generation
    ]
    kinds = sorted({s.event.type for s in late})
    print(f"late events of {HUNG}: {len(late)} ({', '.join(kinds)})")
    # Its heartbeat thread resumed too: heartbeats are soft state (never stored), and the
    # control plane refused them, a member left out of the world beating in its old one:
    # the late evidence every run has. Late events in the log depend on the order things
    # happen in once it resumes: its step record goes out late when it was still queued as
    # the process stopped (the publisher may have sent it just before), and its collective's
    # failure is reported when it failed before the decision reached it (one that hears of
    # generation 2 first sends nothing more of generation 1, and leaves).
    assert "member.heartbeat" not in kinds
    assert cp.heartbeats is not None
    assert cp.heartbeats.stats.refused.get("stale_generation", 0) >= 1, cp.heartbeats.stats
    # Marked stale: its late heartbeats and steps, and its reports and backups when it sends
    # any (it depends on where the resumed process finds out), are discounts: what it says of
    # an abandoned world is no evidence. Whatever else it sent is printed.
    discounts = {d.position: d.reason for d in view.discounts}
    counted = [s for s in late if s.event.type in STALE_TYPES]
    print(
        "their discounts:",
        {s.position: (s.event.type, discounts.get(s.position)) for s in late},
        "counts:",
        view.discount_counts,
    )
    assert all(s.position in discounts for s in counted), {
        s.position: s.event.type for s in counted if s.position not in discounts
    }
    assert view.members[HUNG].status.value in ("failed", "exited")
    assert_matches_reference(reference, out)
