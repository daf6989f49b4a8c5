"""A forged exit against a real training job (issue 20): a member of the right node, not its
launcher, says a healthy rank exited. The control plane discounts it, no rank is fenced, and
the job trains to the end without an incident."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime

import nats
import pytest

from controlplane.core.view import DiscountReason
from schemas.common import JobState
from schemas.subjects import event_subject
from tests.integration.helpers import running_controlplane, wait_until

pytestmark = [pytest.mark.usefixtures("clean_stream"), pytest.mark.timeout(300)]

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train.py")
POLICY = (
    "backup_interval=10,redundancy=2,heartbeat_interval_s=0.2,"
    'heartbeat_timeout_s={"init":30,"train":3,"waiting":10,"backup":10,"restore":10}'
)


async def test_an_exit_forged_by_a_member_of_the_same_node_fences_no_one(settings, pg_store):
    job_id = f"job-forge-{uuid.uuid4().hex[:6]}"
    # 4 workers on 4 pretend nodes, the spare s0 on node0 beside w0.
    command = [
        sys.executable, "-m", "controlplane", "run", "--nproc", "4", "--spares", "1",
        "--nodes", "4", "--racks", "2", "--job-id", job_id, "--policy", POLICY,
        EXAMPLE, "--steps", "300",
    ]  # fmt: skip
    env = {**os.environ, "ELASTIC_NATS_URL": settings.nats_url, "ELASTIC_LOG_LEVEL": "WARNING"}
    async with running_controlplane(settings) as cp:
        proc = subprocess.Popen(command, env=env)
        try:
            await wait_until(
                lambda: job_id in cp.views and cp.views[job_id].last_step >= 1,
                120,
                "the job to train",
            )
            # s0's own subject and source (a member of w0's node, as its node's credential
            # allows): "w0 was killed".
            envelope = {
                "event_id": str(uuid.uuid4()), "job_id": job_id, "type": "member.exited",
                "v": 1, "source": "node0/s0", "incarnation": "forger", "seq": 1,
                "generation": 0, "emitted_at": datetime.now(UTC).isoformat(),
                "payload": {"member": "w0", "signal": 9},
            }  # fmt: skip
            nc = await nats.connect(settings.nats_url)
            try:
                await nc.jetstream().publish(
                    event_subject(job_id, "node0", "s0", "member.exited"),
                    json.dumps(envelope).encode(),
                    headers={"Nats-Msg-Id": envelope["event_id"]},
                )
            finally:
                await nc.close()
            await wait_until(lambda: proc.poll() is not None, 240, "the job to finish")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        view = cp.views[job_id]
    assert proc.returncode == 0  # no member was killed (a fenced w0 would be)
    assert view.state is JobState.COMPLETED and view.incidents == {}
    assert view.world == ("w0", "w1", "w2", "w3")
    [discount] = view.discounts
    assert (discount.type, discount.source, discount.reason) == (
        "member.exited",
        "node0/s0",
        DiscountReason.EXIT_NOT_FROM_LAUNCHER,
    )
    # Stored while the job trained, before it completed.
    [completed] = pg_store.read(job_id=job_id, types=["job.completed"])
    assert discount.position < completed.position
    exits = pg_store.read(job_id=job_id, types=["member.exited"])
    assert {s.event.payload.member: s.event.source for s in exits if s.event.source != "node0/s0"} == {
        "w0": "node0/launcher", "w1": "node1/launcher", "w2": "node2/launcher",
        "w3": "node3/launcher", "s0": "node0/launcher",
    }  # fmt: skip
