"""The local launcher: start a job's members on this machine, watch them, report their exits.

``elasticctl run --nproc N --spares K [--nodes X --racks Y] train.py ARGS`` starts N workers
and K warm spares as processes of ``train.py``, each with the environment that tells it who it
is (``ELASTIC_JOB_ID``, ``_NODE``, ``_RACK``, ``_MEMBER``, ``_ROLE``, the NATS URL, the policy
the job asks for, the faults to inject). ``--nodes``/``--racks`` lay the members out over
pretend nodes and racks, so topology-aware placement can be exercised on one machine. The
launcher has its own identity on each node it starts members on (source ``<node>/launcher``,
its own subject): it gives every process it starts an incarnation of its own
(``ELASTIC_INCARNATION``, which the process's events carry), announces it (``member.launched``:
member, role, pid, incarnation; the control plane counts a spare only once its launcher
announced it), reports every exit as ``member.exited`` with the pid and incarnation of the
process that ended (the control plane believes an exit only from that launcher, and applies it
only to that process, never to a successor of the same name),
relays its members' heartbeats, one message per node an interval (``rank_runtime/relay.py``),
kills a random worker every S seconds for ``--fault random:every=S``, forwards SIGINT/SIGTERM,
and returns when every member has exited. ``--checkpoint-dir`` is where members write cold
checkpoints (``ELASTIC_CHECKPOINT_DIR``; the policy's ``checkpoint_every`` says how often).
``--no-fence`` (for tests only) turns off the fencing of members a newer generation leaves
out (``_follow``), so a test can resume a hung member itself and watch its late events.

Its exit status is the job's outcome (``exit_code``; docs/operations.md, "Launcher exit
codes"), which it learns from the job's commands, verified like its members verify them: the
``Stop`` the control plane sends when the job ends says ``completed`` or ``stopped``. A job that
completed is 0, whatever members died and were replaced on the way: a member that failed is
reported (its ``member.exited``, a log line), and fails the launcher only when the job did not
go on without it. Without a ``Stop`` that says (every member gone before it came, or a control
plane that does not say), the launcher judges by its own members: 0 when each exited 0, was
killed by the launcher, or had a rank that the newest generation it saw gave to another
(replaced; or the world shrank without it), 1 otherwise, 3 when no command of the job ever
came. Stopped by SIGTERM/SIGINT N, it is ``128 + N`` (retryable), unless the job completed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rank_runtime import checkpoint, faults
from rank_runtime.client import EventClient
from rank_runtime.identity import (
    HEARTBEAT_RELAY_ENV,
    INCARNATION_ENV,
    JOB_ID_ENV,
    MEMBER_ENV,
    NATS_CREDS_ENV,
    NATS_PASSWORD_ENV,
    NATS_URL_ENV,
    NATS_USER_ENV,
    NODE_ENV,
    POLICY_ENV,
    RACK_ENV,
    ROLE_ENV,
    Identity,
)
from rank_runtime.relay import HeartbeatRelay
from schemas import creds
from schemas.auth import COMMAND_KEY_ENV, MASTER_SECRET_ENV
from schemas.commands import Reallocate, Stop
from schemas.common import Role
from schemas.events import JobPolicy
from schemas.subjects import LAUNCHER_MEMBER

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one member runs and what it is."""

    member: str
    node: str
    rack: str
    role: Role


def layout(
    nproc: int,
    spares: int,
    nodes: int,
    racks: int,
    *,
    node: str | None = None,
    rack: str | None = None,
) -> list[Slot]:
    """Workers then spares, dealt over ``nodes`` pretend nodes (round robin); node ``j`` is in
    rack ``j * racks // nodes`` (consecutive nodes share a rack).

    With ``node`` (the real machine or pod this launcher runs on, one launcher per node of a
    multi-node job) every member is on that node, in ``rack`` (default ``rack0``), and its
    name starts with the node's (``<node>-w0``, ``<node>-s0``), so the launchers of one job
    never name two members alike.
    """
    if node is not None:
        return [
            Slot(f"{node}-{slot.member}", node, rack or "rack0", slot.role)
            for slot in layout(nproc, spares, 1, 1)
        ]
    if rack is not None:
        raise ValueError("--rack goes with --node (pretend nodes get their racks from --racks)")
    if nodes < 1 or racks < 1 or racks > nodes:
        raise ValueError("need 1 <= racks <= nodes")
    out = []
    for i in range(nproc + spares):
        j = i % nodes
        role = Role.WORKER if i < nproc else Role.SPARE
        name = f"w{i}" if role is Role.WORKER else f"s{i - nproc}"
        out.append(Slot(name, f"node{j}", f"rack{j * racks // nodes}", role))
    return out


@dataclass(slots=True)
class Running:
    """A member's process and what became of it."""

    slot: Slot
    process: subprocess.Popen[bytes]
    reporter: EventClient
    #: The incarnation given to the process (its events carry it; its exit names it).
    incarnation: str = ""
    returncode: int | None = None
    killed_by_launcher: bool = False
    #: The generation whose command left it out, for which the launcher killed it.
    fenced_by: int | None = None


#: ``elasticctl run``'s exit statuses (docs/operations.md, "Launcher exit codes"); a launcher
#: stopped by signal N (SIGTERM, SIGINT: forwarded to its members) exits ``128 + N``.
EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_CONTROL_PLANE = 3


def exit_code(
    *, outcome: str | None, failed: Collection[str], heard: bool, signal: int | None = None
) -> int:
    """The launcher's exit status: the job's outcome, else what became of this node's members.

    ``outcome``: what the control plane's (verified) ``Stop`` said, ``completed`` or
    ``stopped``, None when none came (or it did not say). ``failed``: this launcher's members
    that failed on their own and were not replaced (see ``LaunchResult.failed``). ``heard``:
    some command of the job reached the launcher. ``signal``: the one that stopped the
    launcher. In order: a completed job is 0 whatever its members went through; a launcher
    stopped by a signal is ``128 + signal`` (retryable: preempted, evicted, cancelled); a
    stopped job is 1; with no outcome, 0 when no member failed unreplaced, else 1, or 3 when
    the launcher never heard from the control plane at all.
    """
    if outcome == "completed":
        return EXIT_COMPLETED
    if signal is not None:
        return 128 + signal
    if outcome == "stopped":
        return EXIT_FAILED
    if not failed:
        return EXIT_COMPLETED
    return EXIT_FAILED if heard else EXIT_NO_CONTROL_PLANE


@dataclass(slots=True)
class LaunchResult:
    """How the members ended, and the job with them."""

    job_id: str
    exits: dict[str, int] = field(default_factory=dict)
    #: Members the launcher killed on purpose (``random`` faults, fencing).
    killed: list[str] = field(default_factory=list)
    #: Members that had a rank and that the newest generation the launcher saw goes on
    #: without (replaced by a spare, or the world shrank): reported, not failed.
    replaced: list[str] = field(default_factory=list)
    #: The job's end as the control plane's ``Stop`` said (``completed``/``stopped``), or None.
    outcome: str | None = None
    #: The launcher received some command of the job (the control plane is there).
    heard: bool = False
    #: The signal that stopped the launcher (forwarded to its members), if any.
    signal: int | None = None

    @property
    def failed(self) -> list[str]:
        """Members that exited non-zero on their own (not killed by the launcher) and were not
        replaced."""
        return [m for m, code in self.exits.items()
                if code != 0 and m not in self.killed and m not in self.replaced]  # fmt: skip

    @property
    def code(self) -> int:
        """The launcher's exit status (``exit_code``)."""
        return exit_code(
            outcome=self.outcome, failed=self.failed, heard=self.heard, signal=self.signal
        )

    @property
    def ok(self) -> bool:
        """The launcher exits 0: the job completed, or none of its members failed unreplaced."""
        return self.code == 0


def run(
    script: Sequence[str],
    *,
    nproc: int,
    spares: int = 0,
    nodes: int = 1,
    racks: int = 1,
    job_id: str | None = None,
    nats_url: str = "nats://127.0.0.1:4222",
    policy: JobPolicy | None = None,
    fault_specs: Sequence[str] = (),
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    checkpoint_dir: str | None = None,
    node: str | None = None,
    rack: str | None = None,
    fence: bool = True,
    verdict_wait_s: float = 2.0,
    relay: bool = True,
) -> LaunchResult:
    """Launch the job and wait for every member; see the module docstring (``fence``
    False: members a newer generation leaves out are not killed; for tests; ``relay`` False:
    each member heartbeats on NATS itself, not through the launcher). When every
    member has exited and no ``Stop`` said how the job ended, the launcher waits up to
    ``verdict_wait_s`` for one (if it heard from the control plane at all)."""
    job_id = job_id or f"job-{uuid.uuid4().hex[:8]}"
    policy = policy or JobPolicy(world_size=nproc, min_world=1, max_world=max(nproc, 1))
    step_faults: list[faults.StepFault] = []
    randoms: list[faults.RandomFaults] = []
    for spec in fault_specs:
        parsed = faults.parse(spec)
        (step_faults if isinstance(parsed, faults.StepFault) else randoms).append(parsed)  # type: ignore[arg-type]
    state = tempfile.mkdtemp(prefix=f"elastic-{job_id}-")
    base = {
        **(os.environ if env is None else env),
        JOB_ID_ENV: job_id,
        NATS_URL_ENV: nats_url,
        POLICY_ENV: policy.model_dump_json(),
        faults.FAULTS_ENV: faults.encode(step_faults),
        faults.FAULTS_STATE_ENV: state,
    }
    if checkpoint_dir:
        base[checkpoint.CHECKPOINT_DIR_ENV] = str(Path(checkpoint_dir).resolve())
    # Per-node credentials (``elasticctl creds``, controlplane/creds.py): the launcher's own
    # connections of a node use that node's launcher credential; its members get the node's
    # member credential, the job's secret and the command key, and neither the directory nor
    # a password. Without a directory, every connection uses the environment's credentials.
    # No member ever gets the installation secret (every credential derives from it).
    base.pop(MASTER_SECRET_ENV, None)
    node_creds = _node_credentials(
        base, job_id, layout(nproc, spares, nodes, racks, node=node, rack=rack)
    )
    auth = Identity(
        job_id, "launcher", "launcher", "launcher", Role.WORKER, nats_url,
        nats_user=base.get(NATS_USER_ENV) or None,
        nats_password=base.get(NATS_PASSWORD_ENV) or None,
        nats_creds=base.get(NATS_CREDS_ENV) or None,
    )  # fmt: skip
    if node_creds:
        first = next(iter(node_creds.values()))
        auth = dataclasses.replace(auth, nats_creds=str(first.launcher))
    members: list[Running] = []
    #: node -> its launcher's reporter.
    reporters: dict[str, EventClient] = {}

    def relay_to(node: str, data: bytes) -> None:
        reporter = reporters.get(node)
        if reporter is not None:
            reporter.send_node_heartbeats(data)

    # Each node's heartbeats in one message an interval (rank_runtime/relay.py).
    relay_path = HeartbeatRelay.usable_path(state) if relay else None
    heartbeats = (
        HeartbeatRelay(relay_path, job_id, policy.heartbeat_interval_s, relay_to).start()
        if relay_path is not None
        else None
    )
    if heartbeats is not None:
        base[HEARTBEAT_RELAY_ENV] = heartbeats.path
    elif relay:
        log.warning("%s is too long a path for a socket: members heartbeat on NATS", state)
    stopping = False
    stopped_by: int | None = None

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping, stopped_by
        stopping = True
        stopped_by = signum
        for m in members:
            if m.process.poll() is None:
                m.process.send_signal(signum)

    # Signals can only be caught in the main thread (a caller in another thread keeps its own).
    main = threading.current_thread() is threading.main_thread()
    previous = (
        {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    )
    result = LaunchResult(job_id)
    followed = _Followed()
    try:
        #: node -> members started on it so far (a member's LOCAL_RANK: its GPU there).
        local_ranks: dict[str, int] = {}
        for slot in layout(nproc, spares, nodes, racks, node=node, rack=rack):
            # One incarnation per process started: the launcher knows which process an exit
            # is of, and says so (a late exit never lands on a successor of the name).
            incarnation = uuid.uuid4().hex[:16]
            local_rank = local_ranks[slot.node] = local_ranks.get(slot.node, -1) + 1
            member_env = {
                **base,
                NODE_ENV: slot.node,
                RACK_ENV: slot.rack,
                MEMBER_ENV: slot.member,
                ROLE_ENV: slot.role.value,
                INCARNATION_ENV: incarnation,
                "LOCAL_RANK": str(local_rank),
            }
            if node_creds:  # this node's: the exit reports below go out as its launcher
                auth = dataclasses.replace(auth, nats_creds=str(node_creds[slot.node].launcher))
                member_env[NATS_CREDS_ENV] = str(node_creds[slot.node].member)
            # The launcher of this node: it announces each member it starts and reports its
            # exit, as ``<node>/launcher`` (the only source whose exits the control plane
            # believes, and whose announcement makes a spare count).
            reporter = reporters.get(slot.node)
            if reporter is None:
                reporter = reporters[slot.node] = EventClient(
                    dataclasses.replace(
                        auth, node=slot.node, rack=slot.rack, member=LAUNCHER_MEMBER,
                        role=slot.role,
                    ),
                    commands=False,
                ).start()  # fmt: skip
            if heartbeats is not None:
                heartbeats.expect(slot.member, slot.node, incarnation)
            process = subprocess.Popen([python, *script], env=member_env)
            reporter.publish(
                "member.launched",
                {"member": slot.member, "role": slot.role.value, "pid": process.pid,
                 "incarnation": incarnation},
            )  # fmt: skip
            members.append(Running(slot, process, reporter, incarnation))
            log.info("started %s (%s on %s/%s) as pid %d", slot.member, slot.role.value,
                     slot.rack, slot.node, process.pid)  # fmt: skip
        # Follows the job's commands to fence: a member a newer generation leaves out (found
        # hung, say) is killed, which also fails the collectives its peers are blocked in.
        # It verifies the control plane's signature like the members do (a forged
        # Reallocate must not fence anyone, a forged Stop must not set the exit status), and
        # learns who was replaced and how the job ended (``_Followed``: the exit status).
        watcher = EventClient(
            dataclasses.replace(auth, member=f"launcher-{uuid.uuid4().hex[:8]}"),
            command_key=base.get(COMMAND_KEY_ENV) or None,
        ).start()  # fmt: skip
        rng = random.Random(randoms[0].seed if randoms else 0)
        next_kill = time.monotonic() + randoms[0].every if randoms else None
        while any(m.returncode is None for m in members):
            for m in members:
                if m.returncode is None and (code := m.process.poll()) is not None:
                    m.returncode = code
                    _report_exit(m)
            if next_kill is not None and not stopping and time.monotonic() >= next_kill:
                victims = [m for m in members if m.returncode is None
                           and m.slot.role is Role.WORKER]  # fmt: skip
                if victims:
                    victim = rng.choice(victims)
                    log.info("injected fault: killing %s", victim.slot.member)
                    victim.killed_by_launcher = True
                    victim.process.kill()
                next_kill += randoms[0].every
            _follow(watcher, members, followed, fence=fence)
            time.sleep(0.02)
        # The members' last Stop may still be on its way to the launcher's own subscription.
        deadline = time.monotonic() + verdict_wait_s
        while followed.heard and followed.outcome is None and time.monotonic() < deadline:
            _follow(watcher, members, followed, fence=False, timeout=0.1)
    finally:
        if "watcher" in locals():
            watcher.close(flush_s=0.0)
        for s, handler in previous.items():
            signal.signal(s, handler)
        for m in members:
            if m.process.poll() is None:
                m.process.kill()
                m.process.wait()
        if heartbeats is not None:
            heartbeats.close()
        for reporter in reporters.values():
            reporter.close(flush_s=5.0)
        shutil.rmtree(state, ignore_errors=True)  # the fault markers: every member is gone
    result.exits = {m.slot.member: m.returncode if m.returncode is not None else -9
                    for m in members}  # fmt: skip
    result.killed = [m.slot.member for m in members if m.killed_by_launcher]
    result.replaced = [m.slot.member for m in members if followed.replaced(m.slot.member)]
    result.outcome, result.heard, result.signal = followed.outcome, followed.heard, stopped_by
    _report_result(result)
    return result


def _node_credentials(
    base: dict[str, str], job_id: str, slots: list[Slot]
) -> dict[str, creds.NodeCredentials]:
    """With ``ELASTIC_NATS_CREDS_DIR`` in ``base``: the seed files of every node of ``slots``
    (all checked before a member starts), and ``base`` made what members get; otherwise {}."""
    directory = base.pop(creds.CREDS_DIR_ENV, "")
    if not directory:
        log.warning(
            "no %s: the launcher and its members share the environment's NATS credentials, "
            "so NATS cannot tell one node from another (elasticctl creds; docs/security.md)",
            creds.CREDS_DIR_ENV,
        )
        return {}
    on = sorted({s.node for s in slots})
    found = {n: creds.node_credentials(directory, job_id, n) for n in on}
    for name, value in creds.job_environment(directory, job_id).items():
        base.setdefault(name, value)
    for name in (NATS_USER_ENV, NATS_PASSWORD_ENV, NATS_CREDS_ENV):
        base.pop(name, None)
    return found


@dataclass(slots=True)
class _Followed:
    """What the launcher learned from the job's commands (verified like its members do)."""

    #: Every member some generation gave a rank.
    in_world: set[str] = field(default_factory=set)
    #: The world of the newest generation seen.
    world: frozenset[str] = frozenset()
    #: What the ``Stop`` said of the job's end (None: no Stop yet, or it did not say).
    outcome: str | None = None
    #: Some command of the job arrived.
    heard: bool = False

    def replaced(self, member: str) -> bool:
        """``member`` had a rank and the newest generation goes on without it."""
        return member in self.in_world and member not in self.world


def _follow(
    watcher: EventClient,
    members: list[Running],
    followed: _Followed,
    *,
    fence: bool,
    timeout: float | None = None,
) -> None:
    """Take the commands that arrived (waiting up to ``timeout`` for the first): remember who
    is in the world and how the job ended; with ``fence``, kill members a newer generation
    left out (not those it demoted to spares)."""
    while (command := watcher.next_command(timeout)) is not None:
        timeout = None
        followed.heard = True
        if isinstance(command, Stop):
            log.info("the job ended (%s): %s", command.outcome or "outcome not said",
                     command.reason)  # fmt: skip
            followed.outcome = command.outcome or followed.outcome
            continue
        world = frozenset(command.world)
        if fence and isinstance(command, Reallocate):
            # The survivors of a replica a shrink dropped become warm spares: not fenced.
            kept = world | frozenset(command.demoted)
            for m in members:
                name = m.slot.member
                if name in followed.in_world and name not in kept and m.process.poll() is None:
                    log.info("fencing %s: generation %d goes on without it", name,
                             command.generation)  # fmt: skip
                    m.killed_by_launcher = True
                    m.fenced_by = command.generation
                    m.process.kill()
        followed.in_world |= world
        followed.world = world  # the watcher passes no older generation's command


def _report_result(result: LaunchResult) -> None:
    """Log the members that were replaced (reported, not failed) and what the launcher exits
    with, and why."""
    for member in result.replaced:
        code = result.exits.get(member, 0)
        if code != 0 and member not in result.killed:
            log.info("%s %s and was replaced: the job went on without it", member,
                     f"died of signal {-code}" if code < 0 else f"exited {code}")  # fmt: skip
    code = result.code
    if result.outcome == "completed":
        why = "the job completed"
    elif result.signal is not None:
        why = f"the launcher was stopped by signal {result.signal}"
    elif result.outcome == "stopped":
        why = "the job stopped"
    elif not result.failed:
        why = "no member of this launcher failed unreplaced"
    else:
        failed = ", ".join(result.failed)
        why = (
            f"{failed} failed and the job did not go on without them"
            if result.heard
            else f"{failed} failed; nothing came from the control plane"
        )
    log.info("job %s: exiting %d (%s)", result.job_id, code, why)


def _report_exit(member: Running) -> None:
    """Publish ``member.exited`` for a member whose process ended (its code or signal, its
    pid and incarnation)."""
    code = member.returncode
    assert code is not None
    payload: dict[str, object] = {
        "member": member.slot.member,
        "pid": member.process.pid,
        "incarnation": member.incarnation,
    }
    if code < 0:
        payload["signal"] = -code
    else:
        payload["exit_code"] = code
    if member.fenced_by is not None:
        payload["fenced_by"] = member.fenced_by  # the exit is the decision's consequence
    member.reporter.publish("member.exited", payload)
    log.info("%s exited (%s)", member.slot.member,
             f"signal {-code}" if code < 0 else f"status {code}")  # fmt: skip


def script_path(path: str) -> Path:
    """The training script, checked to exist (a clear error rather than N failed children)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no training script at {path}")
    return p
