"""Authenticated state, attacked with real processes: a holder inside the job (it has the job's
secret) serves a forged copy of the shard a replacement restores — the weights times 50, a
well-formed snapshot with a valid crc32, under a valid MAC. The replacement refuses it against
the digest the control plane recorded, reports the holder's copy, and the decider re-plans
from another holder: the incident resolves on the genuine state, and the run ends bit for bit
where a fault-free run ends."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from controlplane.core.catalog import unpacked
from controlplane.core.timeline import timeline
from controlplane.settings import Settings
from schemas.auth import COMMAND_KEY_ENV, JOB_SECRET_ENV, command_public_key, job_secret
from schemas.common import JobState
from tests.e2e.test_recovery import EXAMPLE, POLICY, ROOT, assert_matches_reference
from tests.integration.helpers import running_controlplane, wait_until

pytestmark = [pytest.mark.usefixtures("clean_stream"), pytest.mark.timeout(420)]


async def run_secure(
    settings: Settings, master: bytes, job_id: str, out: Path, faults: list[str]
) -> int | None:
    """A 4-rank job with one spare whose members have the job's secret and the command key."""
    command = [
        sys.executable, "-m", "controlplane", "run", "--nproc", "4", "--spares", "1",
        "--nodes", "4", "--racks", "2", "--job-id", job_id, "--policy", POLICY,
    ]  # fmt: skip
    for fault in faults:
        command += ["--fault", fault]
    command += [EXAMPLE, "--steps", "40", "--out", str(out)]
    env = {
        **os.environ,
        "ELASTIC_NATS_URL": settings.nats_url,
        "ELASTIC_LOG_LEVEL": "WARNING",
        JOB_SECRET_ENV: job_secret(master, job_id).hex(),
        COMMAND_KEY_ENV: command_public_key(master).hex(),
    }
    proc = subprocess.Popen(command, env=env, cwd=ROOT)
    try:
        await wait_until(lambda: proc.poll() is not None, 300, f"job {job_id} to finish")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode


async def test_a_forged_shard_with_a_valid_crc32_and_mac_is_refused_and_never_resolved_on(
    settings, pg_store, tmp_path
):
    master = os.urandom(32)
    secure = settings.model_copy(update={"secret": SecretStr(master.hex())})
    reference, out = tmp_path / "clean.pt", tmp_path / "forged.pt"
    clean, job = f"job-sec-ref-{uuid.uuid4().hex[:6]}", f"job-forged-{uuid.uuid4().hex[:6]}"
    async with running_controlplane(secure) as cp:
        assert await run_secure(secure, master, clean, reference, []) == 0
        assert cp.views[clean].state is JobState.COMPLETED
        # w1 dies at step 25; w0 (rank 0), the plan's holder of shard 1, forges what it serves.
        code = await run_secure(secure, master, job, out,
                                ["crash@25:rank=1", "tamper@serve:rank=0"])  # fmt: skip
        view = cp.views[job]
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    reports = unpacked(pg_store.read(job_id=job, types=["backup.snapshot", "backup.catalog"]))
    snapshots = [e.event.payload for e in reports]
    assert snapshots and all(p.checksum.startswith("sha256:") for p in snapshots)
    [incident] = view.incidents.values()
    first, second = incident.decisions
    assert first.plan[1] == "w0" and first.restore_step == 20, first.plan
    assert len(first.digests) == 4 and all(d.startswith("sha256:") for d in first.digests)
    # The replacement refused w0's copy and said so, naming it.
    refusals = [
        e.event.payload
        for e in pg_store.read(job_id=job, types=["member.fault"])
        if e.event.payload.kind == "restore_failed"
    ]
    assert [(p.shard, p.source) for p in refusals] == [(1, "w0")], refusals
    assert "the control plane recorded" in refusals[0].detail
    # Re-planned around the forged copy in the same incident; w0 itself stays in the world.
    assert second.plan[1] not in {"w0", "w1"} and second.restore_step == 20
    assert "w0" in second.world and second.digests == first.digests
    restored = [
        e.event.payload
        for e in pg_store.read(job_id=job, types=["restore.completed"])
        if e.event.payload.generation == second.generation and e.event.source.endswith("/s0")
    ]
    assert [p.sources.get("1") for p in restored] == [second.plan[1]]
    line = timeline(incident)
    assert line.outcome == "recovered"
    assert code == 0  # the member killed was reported and replaced; the job completed
    # Resolved on the genuine state: the run ends bit for bit where the fault-free one ends.
    assert_matches_reference(reference, out)
