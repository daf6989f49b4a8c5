"""Hosts partitioned (network namespaces, ``controlplane/netns.py``). First a host cut from the control
plane but not from its peers, the classic split brain: its member keeps training with its
peers, unheard; the control plane finds it silent and replaces it with a spare on another
host, restoring the backup its peers reported (the log never heard the isolated member's
reports: its shard comes from where the placement sent it); the survivors leave the old group,
so the isolated member trains no further step; when the link comes back, it learns of the
newer generation (from its launcher, which fences it, or itself) and leaves, what it sent
meanwhile is recorded and not believed, and the job completes without a step of it after the
decision. Then a host cut from its peers but not from the control plane: every side's
collective times out (the policy's ``collective_timeout_s``), the members on each side probe
the others' hosts and name the ones that do not answer; the two on one side agree, so the
isolated host's member is left out and the spare takes its place (docs/design.md,
"Partitions between hosts").

Four hosts, a rank each on three of them and a spare on the fourth; the control plane (NATS,
``elasticctl serve``) in a namespace of its own; PostgreSQL the tests' (its socket a file).
They need root and ``ip netns`` (skipped otherwise).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from controlplane import netns
from controlplane.core.fold import fold, fold_noting
from controlplane.core.view import DiscountReason, MemberStatus
from controlplane.devstack import nats_server_binary
from controlplane.store.postgres import PostgresEventStore
from schemas.common import JobState
from tests.e2e.hosts import job_view, last_step, made, stop, wait

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
JOB = "partitioned"
NATS_URL = f"nats://{netns.SERVICE}:4222"
#: Why the fold may not believe what an isolated member sent.
STALE = {
    DiscountReason.STALE_REPORT,
    DiscountReason.REPORTER_NOT_IN_WORLD,
    DiscountReason.STALE_GENERATION,
    DiscountReason.STALE_INCARNATION,
}
#: How long a collective waits for its peers (the policy's): a host cut from its peers is
#: found once it passes.
COLLECTIVE_TIMEOUT_S = 10.0
#: The isolated host, and its rank's member.
CUT = 2
ISOLATED = f"h{CUT}-w0"


@pytest.fixture
def hosts() -> Iterator[netns.Hosts]:
    yield from made(4)


def _heard(store: PostgresEventStore, member: str) -> bool:
    for stored in store.read(job_id=JOB, types=["liveness.summary"]):
        summary = stored.event.payload  # type: ignore[attr-defined]
        for part in (summary.columns, summary.regular):
            if part is not None and member in part.members:
                return True
    return False


def _complete_before(store: PostgresEventStore, position: int) -> int | None:
    """The newest backup complete in the log before ``position``."""
    events = [e for e in store.read(job_id=JOB) if e.position < position]
    view = fold(None, events)
    return view.last_complete_backup


@dataclass
class Job:
    """The running processes: NATS and ``serve`` (``procs``), a launcher a host."""

    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    launchers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def tails(self) -> list[str]:
        return [(self.logs / f"h{i}.log").read_text()[-1500:] for i in range(len(self.launchers))]


@contextmanager
def running_job(tmp_path: Path, hosts: netns.Hosts, database_url: str) -> Iterator[Job]:
    """NATS and ``serve`` in the control namespace, a launcher a host: a rank on each host
    but the last, a spare there; collectives and peer stores over the peers' network, NATS and
    the rendezvous over each host's own link. Everything stopped at the end."""
    job = Job(tmp_path / "logs")
    job.logs.mkdir()
    logs = job.logs
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "NATS_"))}
    try:
        with (logs / "nats.log").open("wb") as out:
            job.procs.append(hosts.popen(hosts.control, [
                nats_server_binary(), "-js", "-sd", str(tmp_path / "js"), "-a", "0.0.0.0",
                "-p", "4222",
            ], base, out))  # fmt: skip
        wait(lambda: "Server is ready" in (logs / "nats.log").read_text(), 30, "NATS")
        control_env = {
            **base, "ELASTIC_NATS_URL": NATS_URL, "ELASTIC_DATABASE_URL": database_url,
            "ELASTIC_RENDEZVOUS_HOST": netns.SERVICE, "ELASTIC_RENDEZVOUS_PORT": "29400",
            "ELASTIC_INGEST_FETCH_TIMEOUT_S": "0.2", "ELASTIC_COMMAND_RETRY_S": "1",
            "ELASTIC_LOG_LEVEL": "INFO",
        }  # fmt: skip
        with (logs / "serve.log").open("wb") as out:
            job.procs.append(hosts.popen(hosts.control, [sys.executable, "-m", "controlplane",
                                         "serve"], control_env, out, cwd=ROOT))  # fmt: skip
        wait(lambda: "ingesting from" in (logs / "serve.log").read_text(), 60, "serve")
        for i, host in enumerate(hosts.hosts):
            env = {
                **base, "ELASTIC_NATS_URL": NATS_URL, "ELASTIC_LOG_LEVEL": "INFO",
                "ELASTIC_ADVERTISE": hosts.peer_address(i), "GLOO_SOCKET_IFNAME": "peer",
            }  # fmt: skip
            spare = i == len(hosts.hosts) - 1
            argv = [
                sys.executable, "-m", "rank_runtime.launcher_cli", "--job-id", JOB,
                "--node", f"h{i}", "--rack", f"r{i}", "--nproc", "0" if spare else "1",
                "--spares", "1" if spare else "0",
                "--policy",
                "world_size=3,min_world=2,backup_interval=5,liveness_summary_interval_s=2,"
                f"collective_timeout_s={COLLECTIVE_TIMEOUT_S:g}",
                "examples/train.py", "--steps", "3000",
            ]  # fmt: skip
            with (logs / f"h{i}.log").open("wb") as out:
                job.launchers.append(hosts.popen(host, argv, env, out, cwd=ROOT))
        job.procs += job.launchers
        yield job
    finally:
        stop(job.procs)


def test_a_host_cut_from_the_control_plane_is_fenced_and_the_job_goes_on(
    tmp_path: Path, hosts: netns.Hosts, settings, pg_store: PostgresEventStore
) -> None:
    with running_job(tmp_path, hosts, settings.database_url) as job:
        launchers = job.launchers
        wait(lambda: last_step(pg_store, JOB) >= 30, 120, "the job to train")
        # Heard by the control plane before the cut (an interval summary names it).
        wait(lambda: _heard(pg_store, ISOLATED), 30, f"{ISOLATED} heard")
        isolated = psutil.Process(launchers[CUT].pid)
        (member,) = isolated.children()

        # The cut: h2 reaches its peers, not NATS nor the rendezvous.
        hosts.cut_from_control(CUT)
        cut_at = pg_store.last_position()

        def decided() -> bool:
            view = job_view(pg_store, JOB)
            return view is not None and ISOLATED not in view.world and view.generation > 1

        wait(decided, 60, f"a generation without {ISOLATED}")
        view = job_view(pg_store, JOB)
        assert view is not None
        (incident,) = view.incidents.values()
        decision = incident.decisions[-1]
        assert ISOLATED in incident.members and "h3-s0" in decision.world, incident
        fenced_at = decision.position
        print(f"cut at #{cut_at}; decided at #{decision.position}: restore step"
              f" {decision.restore_step} (the log's newest complete backup then:"
              f" {_complete_before(pg_store, decision.position)})")  # fmt: skip
        # The new world trains on; the isolated member still runs, unheard and stuck.
        wait(lambda: last_step(pg_store, JOB) > decision.restore_step + 10, 60, "training on")
        assert member.is_running() and member.status() != psutil.STATUS_ZOMBIE
        assert launchers[CUT].poll() is None

        # The link comes back: what the isolated host sent arrives late; its launcher hears
        # of the newer generation and fences its member.
        hosts.cut_from_control(CUT, cut=False)
        wait(lambda: not member.is_running() or member.status() == psutil.STATUS_ZOMBIE,
              60, "the isolated member fenced")  # fmt: skip
        for proc in launchers:
            proc.wait(180)
        assert [p.returncode for p in launchers] == [0, 0, 0, 0], job.tails()

    view = job_view(pg_store, JOB)
    assert view is not None and view.state is JobState.COMPLETED, view and view.state
    assert view.members[ISOLATED].status is not MemberStatus.ACTIVE
    # Its exit, reported by its launcher after the decision: fenced by the generation that
    # left it out, or its own once it heard of that generation itself (out of the old
    # group's collectives by then: the survivors left it).
    exits = [e for e in pg_store.read(job_id=JOB, types=["member.exited"])
             if e.event.payload.member == ISOLATED]  # type: ignore[attr-defined]  # fmt: skip
    assert exits and exits[-1].position > fenced_at, exits
    assert "goes on without" in (job.logs / f"h{CUT}.log").read_text(), job.tails()
    # What it sent after the cut was recorded. The fold believed of it only what the new
    # generation's timeline holds: a report of a backup at or below the restore step (the
    # world it trained in took that step, and a copy of it may be restored); the rest it
    # discounted as stale. No step of it after the decision counted.
    source = f"h{CUT}/{ISOLATED}"
    log = pg_store.read(job_id=JOB)
    _, ignored = fold_noting(None, log)  # every event not believed (the view keeps 100)
    late = [e for e in log if e.position > cut_at and e.event.source == source]
    assert late, "nothing the isolated member sent was recorded"
    assert {d.reason for d in view.discounts if d.source == source} <= STALE, view.discounts
    for e in late:
        if e.position not in ignored:
            assert e.event.type == "backup.snapshot", (e.position, e.event.type)
            assert e.event.payload.step <= decision.restore_step, (e.position, decision)  # type: ignore[attr-defined]
    steps_after = [e for e in pg_store.read(job_id=JOB, types=["train.step"], after=fenced_at)
                   if e.event.source.endswith(f"/{ISOLATED}")]  # fmt: skip
    assert not steps_after, steps_after


def test_a_host_cut_from_its_peers_is_left_out_and_the_job_goes_on(
    tmp_path: Path, hosts: netns.Hosts, settings, pg_store: PostgresEventStore
) -> None:
    """h2 reaches the control plane, not its peers: the collectives stop on every side. The
    survivors, waiting in them, probe their peers' hosts (the collective watchdog) and name
    h2's member while they still wait; the control plane leaves it out and puts the spare in
    its place, and the decision itself releases the survivors from the collective (not its
    timeout); the isolated member, told the job goes on without it, leaves; what it reported
    of the broken world is recorded and not believed, and no step of it counts after the
    decision."""
    with running_job(tmp_path, hosts, settings.database_url) as job:
        wait(lambda: last_step(pg_store, JOB) >= 30, 120, "the job to train")
        hosts.cut_from_peers(CUT)
        cut = time.monotonic()

        def decided() -> bool:
            view = job_view(pg_store, JOB)
            return view is not None and view.generation > 1

        wait(decided, 120, "a decision")
        view = job_view(pg_store, JOB)
        assert view is not None
        (incident,) = view.incidents.values()
        decision = incident.decisions[-1]
        assert ISOLATED not in decision.world and "h3-s0" in decision.world, (incident, job.tails())
        print(f"decided {time.monotonic() - cut:.1f} s after the cut: {incident.reasons}")
        # Found by the watchdog's reports, made while the survivors waited in the collective.
        assert any("s in step" in r and "collectives" in r for r in incident.reasons), incident
        for proc in job.launchers:
            proc.wait(180)
        assert [p.returncode for p in job.launchers] == [0, 0, 0, 0], job.tails()
        # The decision released the survivors blocked in the step (``Elastic._on_command``).
        for survivor in (0, 1):
            log_text = (job.logs / f"h{survivor}.log").read_text()
            assert "decided during a step of generation 1" in log_text, job.tails()
    view = job_view(pg_store, JOB)
    assert view is not None and view.state is JobState.COMPLETED, view and view.state
    assert view.members[ISOLATED].status is not MemberStatus.ACTIVE
    source = f"h{CUT}/{ISOLATED}"
    assert {d.reason for d in view.discounts if d.source == source} <= STALE
    steps_after = [e for e in pg_store.read(job_id=JOB, types=["train.step"],
                                            after=decision.position)
                   if e.event.source == source]  # fmt: skip
    assert not steps_after, steps_after
