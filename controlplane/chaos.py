"""``elasticctl chaos``: a seeded mix of rank and infrastructure faults against a training job.

It starts what ``elasticctl demo`` starts (NATS as a three-node JetStream cluster, PostgreSQL, the
control plane and a standby), then launches ``examples/train.py`` as one launcher per pretend
node (a pod): ``--nproc`` worker pods and ``--spares`` pods of a warm spare, every step
``--step-time`` long (a tiny model given steps of a realistic length). From a seed it plans a
fault every ``--every`` seconds (with jitter) for ``--minutes``, cycling through the kinds in a
shuffled order, and injects them one at a time while the job trains:

* ``crash``: a worker is killed (SIGKILL); its launcher reports the exit.
* ``hang``: a worker is stopped (SIGSTOP); only its silence tells.
* ``node``: a worker's pod is killed, launcher and member at once; nothing reports an exit.
* ``slow``: a worker is stopped for ``SLOW_DUTY`` of every ``SLOW_PERIOD_S`` for ``--slow-for``
  seconds (a throttled node): its compute takes twice as long, the whole job slows while it
  lasts; handled (``tolerated``) when the control plane recorded it as slow (``member.slow``;
  the job's ``slow_action`` is ``ignore``), else ``undetected``.
* ``cut-control``, ``cut-peers``: a worker's host is cut from the control plane (NATS, the
  rendezvous) but not from its peers, or from its peers but not from the control plane, and
  joined again ``CUT_S`` later. These need root and ``ip netns``: every pod then runs on a
  host of its own (a network namespace), the services and control planes in a control
  namespace this process enters (``controlplane/netns.py``).
* ``nats``: the NATS node leading the events stream is killed (SIGKILL) and started again
  ``NATS_DOWN_S`` later.
* ``postgres``: PostgreSQL is stopped (fast shutdown) and started again ``POSTGRES_DOWN_S``
  later.
* ``control``: the leading control plane is killed (SIGKILL); the standby takes over and a new
  standby is started.

Each rank fault is repaired as a cluster would: a new pod with a warm spare is started at once.
A fault is injected only once the one before it settled (its incident closed, or the service
back and the job stepping) with the world whole and a spare ready; the report says how long it
waited. Each fault owns the incidents opened between its injection and its settling: a rank
fault counts as recovered when the incident naming its member recovered (and any other it owns
did), an infrastructure fault as tolerated when the job kept stepping with no incident, or
recovered when the incidents it caused recovered. A fault-free reference (the same steps and
seed on one rank) gives the loss the job must end at; the log is audited for lost and duplicated
events; the goodput comes from the project's own accounting (``core/goodput.py``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from controlplane import netns
from controlplane.core.view import JobView, MemberStatus
from controlplane.demo import (
    EXAMPLE,
    TERMINAL,
    Child,
    Demo,
    DemoConfig,
    DemoError,
    Run,
    Stack,
    Watch,
    final_losses,
    finished,
    goodput_breakdown,
    incident_summary,
    leads,
)
from controlplane.postmortem.audit import audit

#: Partitions of a worker's host (network namespaces: root and ``ip netns``): cut from the
#: control plane (NATS, the rendezvous) but not from its peers, or from its peers but not
#: from the control plane; joined again ``CUT_S`` later.
PARTITION_KINDS = ("cut-control", "cut-peers")
#: Faults of a rank (a member, its node, or its host's links).
RANK_KINDS = ("crash", "hang", "node", "slow", *PARTITION_KINDS)
#: Faults of the infrastructure the job stands on.
INFRA_KINDS = ("nats", "postgres", "control")
#: The kinds every machine can run (``ALL_KINDS``: with the partitions, which need root).
KINDS = ("crash", "hang", "node", "slow", *INFRA_KINDS)
ALL_KINDS = (*KINDS, *PARTITION_KINDS)
#: Faults after which a member is gone and a spare takes its place.
LOSING = ("crash", "hang", "node", *PARTITION_KINDS)
#: How long a killed NATS node stays down, and PostgreSQL stopped.
NATS_DOWN_S = 10.0
POSTGRES_DOWN_S = 5.0
#: A ``slow`` worker is stopped this fraction of every ``SLOW_PERIOD_S``: its steps take about
#: twice as long (a throttled node), each heartbeat's compute time well above the others'.
SLOW_DUTY = 0.5
SLOW_PERIOD_S = 0.05
#: The job's ``slow_window_s``: a slow worker is recorded (``member.slow``) once its compute
#: time stayed above the job's this long, and a liveness summary (every 10 s) recorded it, so
#: within the default ``--slow-for`` (20 s). The policy's ``slow_action`` stays ``ignore``.
SLOW_WINDOW_S = 5.0
#: After a service is back (or a slowdown over), how long the job must go on stepping before
#: the fault counts as settled: what members sent meanwhile arrives (``EVENTS_SETTLE_S``) and
#: a fault it caused would have been found (the heartbeat timeout).
QUIET_S = 10.0
#: How long a host stays cut: past the heartbeat timeout (cut from the control plane) and the
#: collective timeout and a probe (cut from its peers: the fallback, should the collective
#: watchdog's probes not find it), so its member is found and replaced while it is cut.
CUT_S = 20.0
#: The job's ``collective_timeout_s`` in a run with partitions: a host cut from its peers is
#: found by the watchdog's probes while its peers wait (the policy's ``collective_probe_s``),
#: or else once their collectives fail (``docs/design.md``, "Partitions between hosts").
COLLECTIVE_TIMEOUT_S = 10.0
#: The first fault comes this long after the job's first step, and none is injected in the
#: last ``TAIL_S`` of the fault window.
WARMUP_S = 20.0
TAIL_S = 10.0


@dataclass(frozen=True, slots=True)
class Planned:
    """A fault of the seeded plan: its kind and when it is due, in seconds after the job's
    first step."""

    index: int
    kind: str
    due_s: float


def plan(minutes: float, every_s: float, kinds: tuple[str, ...], seed: int) -> list[Planned]:
    """The faults of a run: one due every ``every_s`` seconds on average, jittered by up to a
    quarter of it either way, from ``WARMUP_S`` to ``minutes`` later, the kinds taken in
    rounds, each round a seeded shuffle of ``kinds`` (so every kind comes as often, in no fixed
    order)."""
    rng = random.Random(seed)
    end = WARMUP_S + minutes * 60.0 - TAIL_S
    out: list[Planned] = []
    rounds: list[str] = []
    due = WARMUP_S
    while due <= end:
        if not rounds:
            rounds = list(kinds)
            rng.shuffle(rounds)
        out.append(Planned(len(out), rounds.pop(0), round(due, 3)))
        due = WARMUP_S + len(out) * every_s + rng.uniform(-every_s / 4, every_s / 4)
    return out


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """What ``elasticctl chaos`` runs."""

    minutes: float = 5.0
    every_s: float = 25.0
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    nproc: int = 4
    spares: int = 2
    #: Each step's forward pass lasts this long at least (``examples/train.py --step-time``).
    step_time_s: float = 0.1
    backup_interval: int = 10
    heartbeat_timeout_s: float = 3.0
    slow_for_s: float = 20.0
    #: A fault not settled this long after its injection failed.
    settle_timeout_s: float = 90.0
    loss_tolerance: float = 0.01
    start_timeout_s: float = 60.0
    state_dir: Path | None = None
    as_json: bool = False
    live: bool | None = False
    script: Path = EXAMPLE

    def steps(self) -> int:
        """The job's steps: about as many as fill the fault window at the nominal step time
        (each step takes longer than ``step_time_s``; the job then runs on past the last fault
        to its end)."""
        return max(2, round((WARMUP_S + self.minutes * 60.0) / self.step_time_s))

    def validate(self) -> None:
        """Raise ``ValueError`` on settings that cannot make a run."""
        unknown = sorted(set(self.kinds) - set(ALL_KINDS))
        if unknown or not self.kinds:
            raise ValueError(
                f"--kinds takes a comma-separated choice of {', '.join(ALL_KINDS)}"
                + (f" (not {', '.join(unknown)})" if unknown else "")
            )
        if self.partitions:
            why = netns.available()
            if why is not None:
                raise ValueError(f"{', '.join(PARTITION_KINDS)} cut hosts' links: {why}")
        if self.minutes <= 0 or self.every_s < 5:
            raise ValueError("--minutes must be > 0 and --every at least 5 seconds")
        if self.nproc < 2:
            raise ValueError("--nproc must be at least 2: a rank fault leaves a world to recover")
        if self.spares < 1 and any(k in LOSING for k in self.kinds):
            raise ValueError("--spares must be at least 1: each lost rank is taken by a spare")
        if self.step_time_s < 0:
            raise ValueError("--step-time must be >= 0")

    @property
    def partitions(self) -> bool:
        """Whether the run cuts hosts' links: then every pod runs on a host of its own."""
        return any(k in PARTITION_KINDS for k in self.kinds)

    def demo_config(self) -> DemoConfig:
        """The stack and job settings ``elasticctl demo`` takes (no faults of its own)."""
        return DemoConfig(
            steps=self.steps(),
            backup_interval=self.backup_interval,
            nproc=self.nproc,
            spares=self.spares,
            crash_at=0,
            hang_at=0,
            seed=self.seed,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            start_timeout_s=self.start_timeout_s,
            # The job's steps at twice the nominal step time, and every fault's longest wait.
            train_timeout_s=2 * self.steps() * max(self.step_time_s, 0.02)
            + self.settle_timeout_s * len(self.plan())
            + 120.0,
            reference=True,
            loss_tolerance=self.loss_tolerance,
            state_dir=self.state_dir,
            as_json=self.as_json,
            live=self.live,
            script=self.script,
            nats_cluster=3 if "nats" in self.kinds else 1,
            standby="control" in self.kinds,
            # The services on the control namespace's address, which every host reaches.
            host=netns.SERVICE if self.partitions else "127.0.0.1",
        )

    def plan(self) -> list[Planned]:
        return plan(self.minutes, self.every_s, self.kinds, self.seed)


@dataclass(slots=True)
class Fault:
    """A fault being injected, and what became of it."""

    planned: Planned
    #: Seconds after the job's first step it was injected (None: not injected).
    at_s: float | None = None
    injected: float = 0.0
    #: The log position the job's view had reached at the injection.
    position: int = 0
    step: int = 0
    #: What was hit, in words, and the member a rank fault hit.
    target: str = ""
    member: str = ""
    #: Set by the repair (a thread for services) once it is done; ``repair_error`` if failed.
    repaired: threading.Event = field(default_factory=threading.Event)
    repaired_at: float | None = None
    repair_error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    settled_at: float | None = None
    outcome: str | None = None
    incidents: list[dict[str, Any]] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        p = self.planned
        waited = None if self.at_s is None else round(max(0.0, self.at_s - p.due_s), 1)
        down = [i["downtime_s"] for i in self.incidents if i.get("downtime_s") is not None]
        return {
            "index": p.index,
            "kind": p.kind,
            "due_s": p.due_s,
            "at_s": None if self.at_s is None else round(self.at_s, 1),
            "waited_s": waited,
            "target": self.target or None,
            "step": self.step if self.at_s is not None else None,
            "outcome": self.outcome or "not injected",
            "detected_by": sorted({d for i in self.incidents for d in i.get("detected_by", [])}),
            "downtime_s": round(sum(down), 3) if down else None,
            "steps_lost": sum(i.get("steps_lost") or 0 for i in self.incidents),
            "settled_s": None
            if self.settled_at is None
            else round(self.settled_at - self.injected, 1),
            "detail": self.detail,
            "incidents": self.incidents,
        }


#: Outcomes that count as handled: the control plane recovered the job from the fault, or the
#: job went on through it with nothing to recover.
HANDLED = ("recovered", "tolerated")


class Chaos(Demo):
    """One chaos run; ``run()`` returns the exit status (0: every fault handled, the log whole,
    the loss matched)."""

    command = "elasticctl chaos"

    def __init__(self, chaos: ChaosConfig) -> None:
        chaos.validate()
        super().__init__(chaos.demo_config())
        self.chaos = chaos
        self.rng = random.Random(chaos.seed + 1)
        self.faults = [Fault(p) for p in chaos.plan()]
        #: Each pretend node's launcher (its members are its children), by node name.
        self.pods: dict[str, Child] = {}
        self.repairs = 0
        self.serves: list[Child] = []
        self.first_step: float | None = None
        self.current: Fault | None = None
        self.next = 0
        #: Names of the children the run killed on purpose (a control plane).
        self.killed: set[str] = set()
        #: Why the run ended before the jobs did (None: it did not).
        self.aborted: str | None = None
        self.job_watch: Watch | None = None
        #: With partitions: the hosts, and each pod's (its index among them).
        self.hosts: netns.Hosts | None = None
        self.host_of: dict[str, int] = {}

    def run(self) -> int:
        """The run; with partitions, on hosts made for it: the services and the control
        planes in the control namespace (this process enters it), each pod on a host."""
        if not self.chaos.partitions:
            return super().run()
        pods = self._nodes()[self.job_id]
        try:
            self.hosts = netns.Hosts(len(pods))
        except RuntimeError as exc:  # an `ip` command refused
            raise DemoError(f"could not make the hosts of the partitions: {exc}") from exc
        self.host_of = {name: i for i, name in enumerate(pods)}
        try:
            with netns.entered(self.hosts.control):
                return super().run()
        finally:
            self.hosts.close()

    # -------------------------------------------------------------- set-up

    def _nodes(self) -> dict[str, list[str]]:
        """Credentials for every pod the run may start: the workers', the spares', and one
        spare pod per planned fault that loses a member (its repair)."""
        c = self.chaos
        losing = sum(1 for f in self.faults if f.planned.kind in LOSING)
        pods = [f"p{i}" for i in range(c.nproc)] + [f"s{i}" for i in range(c.spares + losing)]
        return {self.job_id: pods, f"{self.job_id}-ref": ["node0"]}

    def _pod(self, name: str, *, workers: int, spares: int) -> None:
        """Start a pod's launcher: ``workers`` ranks and ``spares`` spares of the job."""
        assert self.children is not None and self.stack is not None
        c, config = self.chaos, self.config
        rack = f"rack{len(self.pods) % 2}"
        policy = (
            f"{config.policy(world=c.nproc)},world_size={c.nproc},slow_window_s={SLOW_WINDOW_S:g}"
        )
        if c.partitions:
            policy += f",collective_timeout_s={COLLECTIVE_TIMEOUT_S:g}"
        argv = [
            sys.executable, "-m", "controlplane", "run", "--nproc", str(workers),
            "--spares", str(spares), "--node", name, "--rack", rack, "--job-id", self.job_id,
            "--policy", policy, str(config.script), "--steps", str(config.steps),
            "--seed", str(config.seed), "--step-time", str(c.step_time_s),
        ]  # fmt: skip
        env = self._env(self.stack, **self.stack.launcher_env(self.job_id))
        if self.hosts is not None:
            # On its host: its members reach their peers over the hosts' bridge ("peer"),
            # the services over its own link.
            i = self.host_of[name]
            argv = ["ip", "netns", "exec", self.hosts.hosts[i], *argv]
            env |= {"ELASTIC_ADVERTISE": self.hosts.peer_address(i), "GLOO_SOCKET_IFNAME": "peer"}
        self.pods[name] = self.children.start(f"pod-{name}", argv, env)

    def _repair_pod(self) -> str:
        """A new node with a warm spare, for one lost: its name."""
        name = f"s{self.chaos.spares + self.repairs}"
        self.repairs += 1
        self._pod(name, workers=0, spares=1)
        return name

    def _services(self) -> Stack:
        """The demo's services, always its own (the run kills and restarts them): external
        ones named by the environment are left alone."""
        from controlplane.settings import DATABASE_URL_ENV, NATS_URL_ENV

        saved = {k: os.environ.pop(k) for k in (NATS_URL_ENV, DATABASE_URL_ENV) if k in os.environ}
        if saved:
            self._phase(f"not using {', '.join(saved)}: the run starts servers of its own")
        try:
            return super()._services()
        finally:
            os.environ.update(saved)

    # -------------------------------------------------------------- the run

    def _run(self) -> dict[str, Any]:
        config, c = self.config, self.chaos
        self._phase("starting NATS (JetStream) and PostgreSQL")
        t = time.monotonic()
        stack = self.stack = self._services()
        self.timings["services_s"] = time.monotonic() - t
        self._phase("starting the control plane" + (" and a standby" if config.standby else ""))
        self.serves = self._serve(stack)
        from controlplane.store.postgres import PostgresEventStore

        store = PostgresEventStore.from_url(stack.database_url)
        try:
            self._phase(
                f"plan: {len(self.faults)} faults over {c.minutes:g} min, one every "
                f"~{c.every_s:g}s (seed {c.seed}): {', '.join(c.kinds)}"
            )
            reference = self._launch(store, f"{self.job_id}-ref", "reference",
                                     nproc=1, spares=0, faults=[])  # fmt: skip
            self._phase(
                f"training: {c.nproc} worker pods + {c.spares} spare pod(s), {config.steps} "
                f"steps of {self._script_name()} at >= {c.step_time_s:g}s each"
            )
            for i in range(c.nproc):
                self._pod(f"p{i}", workers=1, spares=0)
            for i in range(c.spares):
                self._pod(f"s{i}", workers=0, spares=1)
            job = Run("chaos", self.pods["p0"], Watch(store, self.job_id), time.monotonic())
            self.job_watch = job.watch
            self._follow_chaos(job, reference)
            audited = audit(store.read(job_id=self.job_id))
        finally:
            store.close()
            self._stop_slowing()
        self._phase("done")
        return self._chaos_summary(job.watch, reference.watch, audited)

    def _follow_chaos(self, job: Run, reference: Run) -> None:
        """Fold both logs, inject the plan's faults one at a time, until both jobs ended. What
        ends the run early (a control plane that exited unbidden, a job past its time) is
        the report's ``aborted``, with the fault in progress settled as it stands."""
        try:
            self._follow_runs(job, reference)
        except DemoError as exc:
            self.aborted = str(exc)
            self._phase(f"aborted: {exc}")
            if self.current is not None and job.watch.view is not None:
                self._settle(self.current, job.watch.view, time.monotonic(), ended=True)

    def _follow_runs(self, job: Run, reference: Run) -> None:
        assert self.progress is not None
        while True:
            self.stop.check()
            now = time.monotonic()
            for run in (job, reference):
                if run.ended is not None:
                    continue
                view = run.watch.poll()
                self.progress.update(run.watch, run.label)
                if view is not None and view.state.value in TERMINAL and view.open_incident is None:
                    run.ended = now
                    self.timings[f"{run.label}_s"] = now - run.launched
                elif now - run.launched > self.config.train_timeout_s:
                    raise DemoError(f"the {run.label} run did not finish in "
                                    f"{self.config.train_timeout_s:.0f}s")  # fmt: skip
                elif run is reference and not run.launcher.alive:
                    run.exited = run.exited if run.exited is not None else now
                    if now - run.exited > 15.0:
                        raise DemoError(f"the reference launcher exited (see {run.launcher.log})")
            view = job.watch.view
            if view is not None and view.history and self.first_step is None and view.last_step:
                self.first_step = now
            if job.ended is None and view is not None and self.first_step is not None:
                self._chaos_turn(view, now)
            self._check_serves()
            if job.ended is not None and reference.ended is not None:
                if self.current is not None:
                    self._settle(self.current, view, now, ended=True)
                return
            self.stop.sleep(0.25)

    def _check_serves(self) -> None:
        """Raise ``DemoError`` when a control plane exited that the run did not kill."""
        for child in self.serves:
            if not child.alive and child.name not in self.killed:
                raise DemoError(
                    f"the control plane ({child.name}) exited (status {child.popen.returncode})"
                )

    # -------------------------------------------------------------- faults

    def _chaos_turn(self, view: JobView, now: float) -> None:
        assert self.first_step is not None
        current = self.current
        if current is not None:
            self._settle(current, view, now)
            return
        if self.next >= len(self.faults):
            return
        fault = self.faults[self.next]
        elapsed = now - self.first_step
        if elapsed < fault.planned.due_s:
            return
        # Near the job's end a recovery would race its completion: what is left is not injected.
        remaining = (self.config.steps - view.last_step) * self.chaos.step_time_s
        if remaining < 2 * TAIL_S:
            for left in self.faults[self.next :]:
                left.detail["why"] = "the job was about to end"
            self.next = len(self.faults)
            return
        why = self._unready(view, fault.planned.kind)
        if why is not None:
            if elapsed - fault.planned.due_s > self.chaos.settle_timeout_s:
                # Never ready (no standby left to take over, say): the plan goes on without it.
                fault.detail["why"] = (
                    f"not ready {self.chaos.settle_timeout_s:.0f} s after it was due: {why}"
                )
                self.next += 1
                self._phase(f"fault {fault.planned.index + 1}: {fault.detail['why']}")
            return
        self.next += 1
        self._inject(fault, view, now)

    def _unready(self, view: JobView, kind: str) -> str | None:
        """Why a fault of ``kind`` cannot come now (None: it can): the job must run with its
        whole world and no open incident; a lost worker needs a spare ready to take its rank,
        a killed control plane a standby (and one leader: a PostgreSQL restart may have moved
        the lead)."""
        if view.state.value != "RUNNING" or view.open_incident is not None:
            return f"the job is {view.state.value}"
        if len(view.world) != self.chaos.nproc:
            return f"the world has {len(view.world)} of {self.chaos.nproc} ranks"
        if kind == "control":
            alive = [c for c in self.serves if c.alive]
            if len(alive) < 2 or sum(map(leads, alive)) != 1:
                return "no control plane leads with another standing by"
        cut = [f for f in self.faults if f.planned.kind in PARTITION_KINDS and f.at_s is not None]
        if any(not f.repaired.is_set() for f in cut):
            return "a host is still cut off"
        if kind in LOSING and not any(
            m.status is MemberStatus.ACTIVE and m.rank is None and m.member_id not in view.world
            for m in view.members.values()
        ):
            return "no spare is ready"
        return None

    def _inject(self, fault: Fault, view: JobView, now: float) -> None:
        assert self.first_step is not None
        kind = fault.planned.kind
        fault.at_s = now - self.first_step
        fault.injected = now
        fault.position = view.last_position
        fault.step = view.last_step
        self.current = fault
        if kind in RANK_KINDS:
            member = self.rng.choice(sorted(view.world))
            fault.target = fault.member = member
            pid = view.members[member].pid
            if kind == "crash":
                self._signal(pid, signal.SIGKILL)
            elif kind == "hang":
                self._signal(pid, signal.SIGSTOP)
            elif kind in PARTITION_KINDS:
                self._cut(fault, member)
            elif kind == "node":
                pod = self.pods.get(view.members[member].node)
                if pod is None:
                    raise DemoError(f"no pod of {member} (node {view.members[member].node})")
                fault.target = f"{member} (pod {view.members[member].node})"
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pod.popen.pid, signal.SIGKILL)
            else:
                self._slow(fault, pid)
            if kind in LOSING:
                fault.detail["repair"] = f"pod {self._repair_pod()} with a spare"
                if kind not in PARTITION_KINDS:  # (repaired once the host is joined again)
                    self._repaired(fault)
        else:
            self._infra(fault)
        self._phase(
            f"fault {fault.planned.index + 1}/{len(self.faults)}: {kind}"
            + (f" of {fault.target}" if fault.target else "")
            + f" at step {fault.step}"
        )

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)

    def _repaired(self, fault: Fault) -> None:
        fault.repaired_at = time.monotonic()
        fault.repaired.set()

    def _in_background(self, fault: Fault, work: Callable[[], None]) -> None:
        """Run a repair off the loop (the job's log keeps being followed meanwhile)."""

        def run() -> None:
            try:
                work()
            except Exception as exc:  # the report says what failed
                fault.repair_error = f"{type(exc).__name__}: {exc}"
            self._repaired(fault)

        threading.Thread(target=run, name=f"chaos-{fault.planned.kind}", daemon=True).start()

    def _cut(self, fault: Fault, member: str) -> None:
        """Cut ``member``'s host from the control plane or from its peers; join it again
        ``CUT_S`` later (its member, replaced meanwhile, is then fenced: its pod is lost)."""
        assert self.hosts is not None and self.job_watch is not None
        view = self.job_watch.view
        assert view is not None
        pod = view.members[member].node
        i = self.host_of[pod]
        hosts = self.hosts
        control = fault.planned.kind == "cut-control"
        cut = hosts.cut_from_control if control else hosts.cut_from_peers
        fault.target = f"{member} (host of pod {pod})"
        fault.detail["cut_s"] = CUT_S
        cut(i)

        def rejoin() -> None:
            self.stop.event.wait(CUT_S)
            cut(i, False)

        self._in_background(fault, rejoin)

    def _slow(self, fault: Fault, pid: int) -> None:
        """Stop ``pid`` for ``SLOW_DUTY`` of every ``SLOW_PERIOD_S`` for the set time."""
        until = time.monotonic() + self.chaos.slow_for_s
        fault.detail["slowed_s"] = self.chaos.slow_for_s
        fault.detail["stopped_fraction"] = SLOW_DUTY

        def work() -> None:
            while time.monotonic() < until and not self.stop.event.is_set():
                self._signal(pid, signal.SIGSTOP)
                time.sleep(SLOW_DUTY * SLOW_PERIOD_S)
                self._signal(pid, signal.SIGCONT)
                time.sleep((1 - SLOW_DUTY) * SLOW_PERIOD_S)

        self._in_background(fault, work)

    def _stop_slowing(self) -> None:
        """Let a slowed member go on (it may be stopped at this moment)."""
        for fault in self.faults:
            if fault.planned.kind == "slow" and fault.at_s is not None:
                fault.repaired.wait(timeout=2 * SLOW_PERIOD_S)

    def _infra(self, fault: Fault) -> None:
        from controlplane.devstack import PostgresServer

        assert self.stack is not None and self.children is not None
        kind = fault.planned.kind
        if kind == "nats":
            cluster, node, _ = self._events_leader()
            assert node.cluster is not None
            fault.target = f"NATS node {node.cluster.name}"
            node.kill()

            def nats() -> None:
                time.sleep(NATS_DOWN_S)
                t = time.monotonic()
                node.start()
                cluster.wait_healthy(60.0, nodes=[node])
                fault.detail["down_s"] = NATS_DOWN_S
                fault.detail["healthy_after_s"] = round(time.monotonic() - t, 2)

            self._in_background(fault, nats)
        elif kind == "postgres":
            servers = [s for s in self.stack.servers if isinstance(s, PostgresServer)]
            if not servers:
                raise DemoError("--kinds postgres needs the run's own PostgreSQL")
            postgres = servers[0]
            fault.target = "PostgreSQL"

            def restart() -> None:
                postgres.stop("fast")
                time.sleep(POSTGRES_DOWN_S)
                postgres.start()
                fault.detail["down_s"] = POSTGRES_DOWN_S

            self._in_background(fault, restart)
        else:
            [leader] = [c for c in self.serves if c.alive and leads(c)]  # _unready saw one
            fault.target = f"control plane {leader.name}"
            self.killed.add(leader.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(leader.popen.pid, signal.SIGKILL)
            t = time.monotonic()

            def takeover() -> None:
                leader.popen.wait(10)  # reaped: its log's last word no longer counts
                deadline = t + self.chaos.settle_timeout_s
                while True:
                    successors = [
                        c for c in self.serves if c is not leader and c.alive and leads(c)
                    ]
                    if successors:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError("no standby took over")
                    time.sleep(0.1)
                fault.detail["takeover_s"] = round(time.monotonic() - t, 2)
                fault.detail["leader"] = successors[0].name
                name = f"serve-standby-{len(self.serves)}"
                self.serves.append(self._standby(name))

            self._in_background(fault, takeover)

    # -------------------------------------------------------------- outcomes

    def _settle(self, fault: Fault, view: JobView | None, now: float, ended: bool = False) -> None:
        """Decide whether ``fault`` settled, and how it ended."""
        if view is None:
            return
        kind = fault.planned.kind
        owned = [
            i
            for i in view.incidents.values()
            if i.opened_position > fault.position and i.kind in ("fault", "anomaly")
        ]
        late = now - fault.injected > self.chaos.settle_timeout_s
        if kind in LOSING:
            named = [i for i in owned if fault.member in i.members]
            done = bool(named) and all(not i.is_open for i in owned)
            if not done and not late and not ended:
                return
            if not named:
                fault.outcome = "undetected"
        else:
            if kind == "slow":
                self._computed(fault, view)
            back = fault.repaired_at is not None
            quiet = fault.repaired_at is not None and now - fault.repaired_at >= QUIET_S
            moving = view.last_step > fault.step
            if not (quiet and moving and all(not i.is_open for i in owned)) and not (late or ended):
                return
            if fault.repair_error is not None:
                fault.outcome = "failed"
                fault.detail["repair_error"] = fault.repair_error
            elif not owned and moving and back:
                fault.outcome = "tolerated"
            if kind == "slow":
                # Recorded as slow (``member.slow``) while it lasted; the detector records a
                # member once a generation, so a mark from before this fault counts too.
                mark = view.slow.get(fault.target)
                fault.detail["flagged_slow"] = mark is not None and mark.position > fault.position
                if mark is not None and mark.position <= fault.position:
                    fault.detail["flagged_before"] = mark.generation == view.generation
                if fault.outcome == "tolerated" and not (
                    fault.detail["flagged_slow"] or fault.detail.get("flagged_before")
                ):
                    fault.outcome = "undetected"
        fault.settled_at = now
        assert self.job_watch is not None
        fault.incidents = [incident_summary(self.job_watch, i, None) for i in owned]
        if fault.outcome is None:
            fault.outcome = (
                "recovered" if owned and all(i.outcome == "recovered" for i in owned) else "failed"
            )
        self.current = None
        self._phase(self._words(fault))

    @staticmethod
    def _computed(fault: Fault, view: JobView) -> None:
        """The slowest sustained compute time the log gave the slowed member while the fault
        lasted, and the job's (the median of the others') beside it."""
        mine = view.compute.get(fault.target)
        if mine is None or mine.compute_s <= fault.detail.get("compute_s", 0.0):
            return
        others = [c.compute_s for m, c in view.compute.items() if m != fault.target]
        fault.detail["compute_s"] = mine.compute_s
        fault.detail["job_compute_s"] = statistics.median(others) if others else None

    def _words(self, fault: Fault) -> str:
        r = fault.report()
        down = "" if r["downtime_s"] is None else f", downtime {r['downtime_s']:.2f}s"
        by = f" by {', '.join(r['detected_by'])}" if r["detected_by"] else ""
        return (
            f"fault {r['index'] + 1}: {r['kind']} of {r['target']}: {r['outcome']}{by}{down}"
            f" (settled in {r['settled_s']}s)"
        )

    # -------------------------------------------------------------- summary

    def _chaos_summary(self, watch: Watch, reference: Watch, audited: Any) -> dict[str, Any]:
        c = self.chaos
        view = watch.view
        ref = reference.view
        assert view is not None
        steps = self.config.steps
        completed = finished(view, steps)
        final, ref_loss, rel = final_losses(view, ref, steps)
        loss_ok = rel is not None and rel <= c.loss_tolerance
        reports = [f.report() for f in self.faults]
        injected = [r for r in reports if r["outcome"] != "not injected"]
        handled = [r for r in injected if r["outcome"] in HANDLED]
        by_kind: dict[str, dict[str, int]] = {}
        for r in injected:
            counts = by_kind.setdefault(r["kind"], {"injected": 0, "handled": 0})
            counts["injected"] += 1
            counts["handled"] += r["outcome"] in HANDLED
        breakdown = goodput_breakdown(watch)
        ettr = None if breakdown is None else breakdown["ettr"]
        all_handled = bool(injected) and len(handled) == len(injected)
        return {
            "job_id": view.job_id,
            "job_state": view.state.value,
            "steps": steps,
            "completed_step": view.completed_step,
            "ranks": c.nproc,
            "spares": c.spares,
            "minutes": c.minutes,
            "every_s": c.every_s,
            "seed": c.seed,
            "kinds": list(c.kinds),
            "step_time_s": c.step_time_s,
            "totals": {
                "planned": len(reports),
                "injected": len(injected),
                "handled": len(handled),
                "recovered": sum(r["outcome"] == "recovered" for r in injected),
                "tolerated": sum(r["outcome"] == "tolerated" for r in injected),
                "failed": len(injected) - len(handled),
                "handled_rate": round(len(handled) / len(injected), 4) if injected else None,
                "by_kind": by_kind,
                "incidents": len([i for i in view.incidents.values() if i.kind == "fault"]),
                "spare_pods_started": self.repairs,
            },
            "recovered": all_handled and completed and audited.whole and self.aborted is None,
            "aborted": self.aborted,
            "faults": reports,
            "log": audited.summary(),
            "final_loss": final,
            "reference_loss": ref_loss,
            "loss_rel_diff": None if rel is None else float(f"{rel:.3g}"),
            "loss_tolerance": c.loss_tolerance,
            "loss_ok": loss_ok,
            "ettr": ettr,
            "goodput": breakdown,
        }

    def _render(self, summary: dict[str, Any], console: Console) -> None:
        render_chaos(summary, console)


def render_chaos(summary: dict[str, Any], console: Console) -> None:
    """The human summary: one row per fault, then the totals."""
    table = Table(title=f"Faults of job {summary['job_id']}", title_justify="left")
    for name in ("#", "kind", "at s", "target", "outcome", "detected by", "down s", "lost"):
        table.add_column(name)
    for r in summary["faults"]:
        table.add_row(
            str(r["index"] + 1), r["kind"], "-" if r["at_s"] is None else f"{r['at_s']:.0f}",
            str(r["target"] or "-"), r["outcome"], ", ".join(r["detected_by"]) or "-",
            "-" if r["downtime_s"] is None else f"{r['downtime_s']:.2f}", str(r["steps_lost"]),
        )  # fmt: skip
    console.print(table)
    if summary["aborted"]:
        console.print(f"aborted: {summary['aborted']}", markup=False, highlight=False)
    t = summary["totals"]
    log = summary["log"]
    console.print(
        f"{t['handled']}/{t['injected']} faults handled ({t['recovered']} recovered, "
        f"{t['tolerated']} tolerated, {t['failed']} failed); job {summary['job_state']} at step "
        f"{summary['completed_step']}/{summary['steps']}; log: {log['missing']} lost, "
        f"{log['duplicated']} duplicated of {log['events']}; final loss {summary['final_loss']} "
        f"vs {summary['reference_loss']} (rel {summary['loss_rel_diff']}); ETTR {summary['ettr']}",
        highlight=False,
    )


def default_kinds() -> tuple[str, ...]:
    """Every kind this process can run: the partitions only where it can make network
    namespaces (root and ``ip netns``)."""
    return ALL_KINDS if netns.available() is None else KINDS


def run_chaos(config: ChaosConfig) -> int:
    """Run the chaos; returns the exit status (0: every fault handled, log whole, loss matched;
    1: not; 128+N: stopped by signal N)."""
    return Chaos(config).run()


__all__ = ["ALL_KINDS", "KINDS", "ChaosConfig", "Planned", "default_kinds", "plan", "run_chaos"]
