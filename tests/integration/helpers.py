"""Shared pieces of the service-level tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats

from controlplane.app import ControlPlane
from controlplane.publish import Outgoing, publish_all
from controlplane.settings import Settings
from controlplane.synth import SyntheticJob


def valid_messages(job: SyntheticJob, count: int) -> list[Outgoing]:
    out = []
    for envelope in job.member_events(count):
        subject, data = SyntheticJob.message(envelope)
        out.append(Outgoing(subject, data, envelope["event_id"]))
    return out


def invalid_messages(job_id: str, count: int, rng: random.Random) -> list[tuple[Outgoing, str]]:
    """``count`` bad inputs of six kinds, each with the reason prefix the ingest must record."""
    good = {
        "job_id": job_id,
        "type": "member.heartbeat",
        "v": 1,
        "source": "nx/mx",
        "incarnation": "i1",
        "generation": 0,
        "emitted_at": "2026-01-01T00:00:00+00:00",
        "payload": {"step": 1, "phase": "train"},
    }
    subject = f"elastic.evt.{job_id}.nx.member.member.heartbeat"
    kinds: list[Callable[[dict[str, Any]], tuple[str, bytes, str]]] = [
        lambda e: (subject, b"{not json", "not JSON"),
        lambda e: (subject.replace("heartbeat", "bogus"), json.dumps({**e, "type": "member.bogus"}).encode(), "unknown event type"),
        lambda e: (subject, json.dumps({**e, "v": 9}).encode(), "unknown schema version"),
        lambda e: (subject, json.dumps({**e, "payload": {"step": -1, "phase": "train"}}).encode(), "schema violation"),
        lambda e: (subject, json.dumps({**e, "payload": {"step": 1, "phase": "train", "pad": "x" * 70_000}}).encode(), "oversized"),
        lambda e: (subject, json.dumps({**e, "source": "ny/mx"}).encode(), "forged source"),
    ]  # fmt: skip
    out = []
    for i in range(count):
        envelope = {
            **good,
            "event_id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            "seq": i + 1,
        }
        subj, data, reason = kinds[i % len(kinds)](envelope)
        out.append((Outgoing(subj, data), reason))
    return out


async def publish(url: str, messages: list[Outgoing], **kw: Any) -> None:
    servers = url.split(",")  # a cluster's nodes, as ELASTIC_NATS_URL lists them
    nc = await nats.connect(servers=servers, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        await publish_all(nc.jetstream(), messages, **kw)
    finally:
        await nc.close()


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


def terminate(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """Stop a launched process as an operator would (SIGTERM), killing it after ``timeout``."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.asynccontextmanager
async def running_controlplane(
    settings: Settings, *, ingesting: bool = True
) -> AsyncIterator[ControlPlane]:
    """A control plane in this process; with ``ingesting``, wait until it holds the lock."""
    stop = asyncio.Event()
    cp = ControlPlane(settings)
    task = asyncio.create_task(cp.run(stop))
    try:
        if ingesting:
            await wait_until(
                lambda: cp.ingest is not None or task.done(), 30, "the ingest to start"
            )
        if task.done():
            task.result()
        yield cp
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def assert_sequences_whole(store: Any, job_id: str) -> None:
    """Every member's events of ``job_id`` are in the log once each, with no seq missing
    from 1 to its last (``postmortem.audit``): nothing a member sent was lost or stored
    twice."""
    from controlplane.postmortem.audit import audit

    found = audit(store.read(job_id=job_id))
    assert found.whole and found.events > 0, found
