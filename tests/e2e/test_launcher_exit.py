"""``elasticctl run``'s exit status is the job's outcome, with real processes, NATS, PostgreSQL
and the control plane: ranks that crashed and were replaced do not fail a job that completed;
a job that stopped fails its launcher."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controlplane.settings import Settings
from schemas.common import JobState
from tests.integration.helpers import running_controlplane, wait_until

pytestmark = [pytest.mark.usefixtures("clean_stream"), pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/train.py"


def elasticctl() -> list[str]:
    """The ``elasticctl`` of this environment (``python -m controlplane`` without one)."""
    script = Path(sys.executable).with_name("elasticctl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "controlplane"]


async def run(
    settings: Settings, args: list[str], out: Path, timeout: float = 150
) -> tuple[int, Any]:
    """Run ``elasticctl ARGS`` to its end (its stdout, and its members', into ``out``): its
    status and the summary it prints last."""
    env = {**os.environ, "ELASTIC_NATS_URL": settings.nats_url, "ELASTIC_LOG_LEVEL": "WARNING"}
    with out.open("wb") as stdout:
        proc = subprocess.Popen([*elasticctl(), *args], env=env, cwd=ROOT, stdout=stdout)
    try:
        await wait_until(lambda: proc.poll() is not None, timeout, "the launcher to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = out.read_text().strip().splitlines()  # noqa: ASYNC240 (once, at the end)
    return proc.returncode, json.loads(lines[-1])


async def test_ranks_that_crashed_and_were_replaced_do_not_fail_a_completed_job(settings, tmp_path):
    async with running_controlplane(settings) as cp:
        code, summary = await run(
            settings,
            ["run", "--nproc", "4", "--spares", "2", "--nodes", "4", "--racks", "2",
             "--fault", "crash@20:rank=0", "--fault", "crash@20:rank=3",
             EXAMPLE, "--steps", "30"],
            tmp_path / "stdout",
        )  # fmt: skip
        await wait_until(lambda: summary["job_id"] in cp.views, 10, "the job's view")
        view = cp.views[summary["job_id"]]
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    assert code == 0, summary
    # Both crashed ranks were reported (SIGKILL of themselves) and replaced by the spares.
    assert summary["exits"]["w0"] == -9 and summary["exits"]["w3"] == -9, summary
    assert sorted(summary["replaced"]) == ["w0", "w3"], summary
    assert all(summary["exits"][m] == 0 for m in ("w1", "w2", "s0", "s1")), summary
    assert summary["exit_code"] == 0


async def test_a_job_that_stops_fails_its_launcher(settings, tmp_path):
    """Two ranks, no spare, min_world 2: the crash of one leaves a world the job may not
    shrink to, so the job stops (the survivor leaves on the Stop)."""
    async with running_controlplane(settings) as cp:
        code, summary = await run(
            settings,
            ["run", "--nproc", "2", "--policy", "min_world=2", "--fault", "crash@3:rank=1",
             EXAMPLE, "--steps", "30"],
            tmp_path / "stdout",
        )  # fmt: skip
        await wait_until(lambda: summary["job_id"] in cp.views, 10, "the job's view")
        view = cp.views[summary["job_id"]]
    assert view.state is JobState.STOPPED, [(h.to_state, h.reason) for h in view.history]
    assert code == 1, summary
    assert summary["outcome"] == "stopped" and summary["replaced"] == [], summary


async def test_a_launcher_of_spares_only_gives_the_spare_that_replaces_a_crashed_rank(
    settings, tmp_path
):
    """Two launchers of one job, as two pods: one runs the workers, the other only a spare
    (``--nproc 0 --spares 1``, the job's world_size in its policy); a worker's crash is
    repaired by the other pod's spare, the job completes and both launchers exit 0."""
    job = f"job-pods-{os.getpid()}"
    policy = "world_size=2,redundancy=1"
    common = ["--job-id", job, "--policy", policy]
    async with running_controlplane(settings) as cp:
        # The spare pod first, joined before the workers start: the crash must find it (on a
        # slow machine the workers reached step 12 before the spare had joined).
        spare = asyncio.ensure_future(
            run(settings, ["run", "--nproc", "0", "--spares", "1", "--node", "pod-b", "--rack",
                           "rack1", *common, EXAMPLE, "--steps", "30"], tmp_path / "b")
        )  # fmt: skip
        await wait_until(
            lambda: (job in cp.views and "pod-b-s0" in cp.views[job].members) or spare.done(),
            120, "the spare pod's member to join",
        )  # fmt: skip
        results = await asyncio.gather(
            run(settings, ["run", "--nproc", "2", "--node", "pod-a", "--rack", "rack0", *common,
                           "--fault", "crash@12:rank=1", EXAMPLE, "--steps", "30"],
                tmp_path / "a"),
            spare,
        )  # fmt: skip
        await wait_until(lambda: job in cp.views, 10, "the job's view")
        view = cp.views[job]
    (code_a, a), (code_b, b) = results
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    assert "pod-b-s0" in view.world, view.world
    assert a["exits"]["pod-a-w1"] == -9 and a["replaced"] == ["pod-a-w1"], a
    assert code_a == code_b == 0, (a, b)
    assert b["exits"] == {"pod-b-s0": 0}, b


def test_a_launcher_of_spares_only_must_be_told_the_world_size():
    from rank_runtime.launcher_cli import launch_policy

    with pytest.raises(ValueError, match="world_size in --policy"):
        launch_policy("redundancy=1", 0)
    assert launch_policy("world_size=16", 0).world_size == 16
    proc = subprocess.run([*elasticctl(), "run", "--nproc", "0", EXAMPLE], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "both 0" in proc.stderr, proc.stderr
