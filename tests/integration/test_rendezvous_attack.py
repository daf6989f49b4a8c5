"""Attacks on the rendezvous store of a live generation, hosted by a real control plane.

Security on (``ELASTIC_SECRET``): two members join, the control plane starts generation 1 and
names its rendezvous; the honest ranks meet there with the job's secret. A torch TCPStore
client, a raw socket, a client without the secret and one with another job's secret can
neither read, set nor pre-set that generation's keys (nor the next one's), and the
generation's barrier does not pass early.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from pydantic import SecretStr

from controlplane.settings import Settings
from rank_runtime.client import EventClient
from rank_runtime.identity import Identity
from rank_runtime.rendezvous import RendezvousAuthError, RendezvousStore
from schemas.auth import command_public_key, job_secret
from schemas.commands import Start
from schemas.common import Role
from schemas.rendezvous import parse_endpoint
from tests.integration.helpers import running_controlplane

pytestmark = pytest.mark.usefixtures("clean_stream")

MASTER = bytes(range(7, 39))
SHORT = timedelta(seconds=3)


def _member(job_id: str, nats_url: str, member: str) -> EventClient:
    ident = Identity(job_id=job_id, node=f"node-{member}", rack="rack-a", member=member,
                     role=Role.WORKER, nats_url=nats_url, host="host-a")  # fmt: skip
    return EventClient(ident, command_key=command_public_key(MASTER).hex()).start()


def _joined(member: str) -> dict[str, object]:
    return {"node": f"node-{member}", "rack": "rack-a", "host": "host-a", "pid": os.getpid(),
            "role": "worker", "device": "cpu", "policy": {"world_size": 2, "min_world": 2}}  # fmt: skip


def _attacks(endpoint: str, job_id: str) -> list[str]:
    """Every way in an attacker without the job's secret tries; what got through."""
    where = parse_endpoint(endpoint)
    got_through = []
    # torch's own client, as one would use against a TCPStore.
    try:
        client = dist.TCPStore(  # type: ignore[attr-defined]
            where.host, where.port, is_master=False, timeout=SHORT
        )
        prefixed = dist.PrefixStore(where.prefix, client)  # type: ignore[attr-defined]
        prefixed.set("arrived/1", "attacker")
        got_through.append("tcpstore set")
        prefixed.get("arrived/0")
        got_through.append("tcpstore get")
    except Exception:  # refused: the expected outcome
        pass
    # A raw socket that sends a length-prefixed blob and reads what comes back.
    with socket.create_connection((where.host, where.port), timeout=3) as sock:
        greeting = sock.recv(64)
        sock.sendall(len(b"x" * 200).to_bytes(4, "big") + b"x" * 200)
        rest = sock.recv(4096)
        if b"w0" in greeting + rest:
            got_through.append("raw read")
    # The rank runtime's own client, without the secret, with random bytes, with another
    # job's secret; for this generation and to pre-set the next one.
    for secret in (None, os.urandom(32), job_secret(MASTER, "another-job")):
        for generation in (where.generation, where.generation + 1):
            try:
                store = RendezvousStore.connect(
                    f"tcp://{where.host}:{where.port}/{job_id}/{generation}", secret, timeout=SHORT
                )
            except RendezvousAuthError:
                continue
            store.set("arrived/1", b"attacker")
            got_through.append(f"client set ({generation})")
            store.close()
    return got_through


async def test_no_client_without_the_jobs_secret_touches_a_live_generation(settings: Settings):
    secured = settings.model_copy(update={"secret": SecretStr(MASTER.hex())})
    job_id = f"job-rdzv-{uuid.uuid4().hex[:6]}"
    async with running_controlplane(secured) as cp:
        members = [_member(job_id, settings.nats_url, m) for m in ("w0", "w1")]
        try:
            for name, member in zip(("w0", "w1"), members, strict=True):
                member.publish("member.joined", _joined(name))
            start = await asyncio.to_thread(members[0].next_command, 30.0)
            assert isinstance(start, Start) and start.generation == 1
            assert cp.rendezvous is not None and start.rendezvous.startswith(
                cp.rendezvous.base or ""
            )
            secret = job_secret(MASTER, job_id)
            rank0 = await asyncio.to_thread(
                RendezvousStore.connect, start.rendezvous, secret, timeout=SHORT
            )
            rank0.set("arrived/0", b"w0")
            barrier = ["arrived/0", "arrived/1"]

            got_through = await asyncio.to_thread(_attacks, start.rendezvous, job_id)
            assert got_through == []
            # The barrier did not pass early; rank 0's key is as it set it.
            assert not rank0.check(barrier)
            assert rank0.get("arrived/0") == b"w0" and rank0.num_keys() == 1
            server = cp.rendezvous.server
            assert server.stats.refused_handshakes >= 7 and server.keys_of(job_id) == 1

            # The honest second rank arrives: the barrier passes.
            rank1 = await asyncio.to_thread(
                RendezvousStore.connect, start.rendezvous, secret, timeout=SHORT
            )
            rank1.set("arrived/1", b"w1")
            assert rank0.check(barrier) and rank0.get("arrived/1") == b"w1"
            # A generation the control plane never started is refused even with the secret.
            with pytest.raises(RendezvousAuthError, match="not started"):
                RendezvousStore.connect(
                    start.rendezvous.rsplit("/", 1)[0] + "/7", secret, timeout=SHORT
                )
            rank0.close()
            rank1.close()
        finally:
            for member in members:
                member.close()
