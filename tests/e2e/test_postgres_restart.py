"""PostgreSQL restarted under a training job, while a rank's crash waits to be decided: the
crash report waits in the events stream, the decision is recorded once the database is back,
the spare takes the rank's place and the job completes, with every member's events in the log
once each."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from controlplane.core.timeline import timeline
from schemas.common import JobState
from tests.conftest import requires_owned
from tests.e2e.test_recovery import run_job
from tests.integration.helpers import assert_sequences_whole, running_controlplane, wait_until

pytestmark = [pytest.mark.usefixtures("clean_stream"), pytest.mark.timeout(300)]


async def test_postgres_restarted_while_a_crash_waits_to_be_decided(
    services, settings, pg_store, tmp_path
):
    requires_owned(services.postgres, "PostgreSQL")
    job = f"job-pg-{uuid.uuid4().hex[:6]}"
    async with running_controlplane(settings) as cp:
        running = asyncio.create_task(
            run_job(settings, job, tmp_path / "out.pt", ["crash@120:rank=1"], steps=160)
        )
        await wait_until(
            lambda: (job in cp.views and cp.views[job].last_step >= 60) or running.done(),
            120, "the job to train",
        )  # fmt: skip
        assert not running.done()
        # As a crash would (no checkpoint, no goodbye to the clients).
        await asyncio.to_thread(services.postgres.stop, "immediate")
        down = cp.views[job]
        await asyncio.sleep(3.0)  # the crash at step 120 comes while the database is away
        await asyncio.to_thread(services.postgres.start)
        code = await running
        await wait_until(lambda: cp.views[job].state is JobState.COMPLETED, 30, "the log")
        view = cp.views[job]
    assert down.open_incident is None and down.last_step < 120, "stopped too late to mean much"
    assert cp.ingest is not None and cp.ingest.stats.store_retries + cp.sessions > 1
    assert code == 0
    [incident] = view.incidents.values()
    line = timeline(incident)
    assert line.outcome == "recovered" and incident.reasons[0].startswith("w1"), incident.reasons
    [decision] = incident.decisions
    assert decision.mode == "replace" and "s0" in decision.world
    assert_sequences_whole(pg_store, job)
