"""What the tests of partitioned hosts share (``test_partition``, ``test_nats_partition``):
the hosts, made or skipped, and reading a job's log while its processes run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from controlplane import netns
from controlplane.core.fold import fold
from controlplane.core.view import JobView
from controlplane.store.postgres import PostgresEventStore


def made(count: int) -> Iterator[netns.Hosts]:
    """``count`` hosts in network namespaces for a fixture to yield (skipped where they
    cannot be made), removed after."""
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    hosts = netns.Hosts(count)
    try:
        yield hosts
    finally:
        hosts.close()


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.2)


def job_view(store: PostgresEventStore, job_id: str) -> JobView | None:
    """``job_id``'s view, folded from its whole log."""
    events = store.read(job_id=job_id)
    return fold(None, events) if events else None


def last_step(store: PostgresEventStore, job_id: str) -> int:
    """The newest step any member of ``job_id`` reported."""
    steps = store.read(job_id=job_id, types=["train.step"])
    return max((e.event.payload.step for e in steps), default=0)  # type: ignore[attr-defined]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop ``procs`` (each its own process group), the last started first: SIGTERM, then
    SIGKILL after 20 s."""
    for proc in reversed(procs):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
