"""The loop integration (``rank_runtime.session``) with real processes: an error of the loop's
own code is not taken for a lost peer."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from controlplane.settings import Settings
from tests.integration.helpers import running_controlplane

pytestmark = [pytest.mark.usefixtures("clean_stream"), pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "tests" / "e2e" / "jobs" / "user_error.py")


async def test_a_value_error_of_the_loop_propagates_and_starts_no_recovery(
    settings: Settings, pg_store
) -> None:
    job_id = f"job-usererr-{uuid.uuid4().hex[:6]}"
    command = [
        sys.executable, "-m", "controlplane", "run", "--nproc", "2", "--nodes", "2",
        "--racks", "1", "--job-id", job_id, "--policy", "backup_interval=2",
        # The survivor's shrink leaves w1 out; fencing would kill w1 if its interpreter were
        # still tearing down by then (a race on a loaded machine), hiding the status 1 that
        # Python gives an unhandled error. Fencing has its own tests.
        "--no-fence", JOB,
    ]  # fmt: skip
    env = {**os.environ, "ELASTIC_NATS_URL": settings.nats_url, "ELASTIC_LOG_LEVEL": "WARNING"}
    async with running_controlplane(settings):
        proc = await asyncio.create_subprocess_exec(
            *command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), 150)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await asyncio.sleep(1.0)  # the last events reach the log
    text = output.decode(errors="replace")
    # The original traceback, down to the line that raised, as Python prints it unhandled.
    assert "Traceback (most recent call last)" in text, text
    assert 'raise ValueError(f"bad batch at step {step}")' in text, text
    assert "in bad_batch" in text and "in train_step" in text, text
    assert "ValueError: bad batch at step 3" in text, text
    events = pg_store.read(job_id=job_id)
    faults = [e.event for e in events if e.event.type == "member.fault"]
    # The failing member reported no fault and asked for no recovery: its error is its own.
    assert not [f for f in faults if f.member == "w1"], faults
    exits = {e.event.payload.member: (e.event.payload.exit_code, e.event.payload.signal)
             for e in events if e.event.type == "member.exited"}  # fmt: skip
    assert exits.get("w1") == (1, None), (exits, text)
