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
kills a random worker every S seconds for ``--fault random:every=S``, forwards SIGINT/SIGTERM,
and returns when every member has exited. ``--checkpoint-dir`` is where members write cold
checkpoints (``ELASTIC_CHECKPOINT_DIR``; the policy's ``checkpoint_every`` says how often).
``--no-fence`` (for tests only) turns off the fencing of members a newer generation leaves
out (``_fence``), so a test can resume a hung member itself and watch its late events.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from controlplane import creds
from rank_runtime import checkpoint, faults
from rank_runtime.client import EventClient
from rank_runtime.identity import (
    INCARNATION_ENV,
    JOB_ID_ENV,
    LAUNCHER_MEMBER,
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
from schemas.auth import COMMAND_KEY_ENV, MASTER_SECRET_ENV
from schemas.commands import Reallocate, Stop
from schemas.common import Role
from schemas.events import JobPolicy

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


@dataclass(slots=True)
class LaunchResult:
    """How the members ended."""

    job_id: str
    exits: dict[str, int] = field(default_factory=dict)
    #: Members the launcher killed on purpose (``random`` faults, fencing).
    killed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every member the launcher did not kill exited cleanly."""
        return all(code == 0 for m, code in self.exits.items() if m not in self.killed)


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
) -> LaunchResult:
    """Launch the job and wait for every member; see the module docstring (``fence``
    False: members a newer generation leaves out are not killed; for tests)."""
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
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for m in members:
            if m.process.poll() is None:
                m.process.send_signal(signum)

    # Signals can only be caught in the main thread (a caller in another thread keeps its own).
    main = threading.current_thread() is threading.main_thread()
    previous = (
        {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    )
    result = LaunchResult(job_id)
    try:
        for slot in layout(nproc, spares, nodes, racks, node=node, rack=rack):
            # One incarnation per process started: the launcher knows which process an exit
            # is of, and says so (a late exit never lands on a successor of the name).
            incarnation = uuid.uuid4().hex[:16]
            member_env = {
                **base,
                NODE_ENV: slot.node,
                RACK_ENV: slot.rack,
                MEMBER_ENV: slot.member,
                ROLE_ENV: slot.role.value,
                INCARNATION_ENV: incarnation,
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
        # Reallocate must not fence anyone).
        watcher = EventClient(
            dataclasses.replace(auth, member=f"launcher-{uuid.uuid4().hex[:8]}"),
            command_key=base.get(COMMAND_KEY_ENV) or None,
        ).start()  # fmt: skip
        in_world: set[str] = set()
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
            if fence:
                _fence(watcher, members, in_world)
            time.sleep(0.02)
    finally:
        if "watcher" in locals():
            watcher.close(flush_s=0.0)
        for s, handler in previous.items():
            signal.signal(s, handler)
        for m in members:
            if m.process.poll() is None:
                m.process.kill()
                m.process.wait()
        for reporter in reporters.values():
            reporter.close(flush_s=5.0)
        shutil.rmtree(state, ignore_errors=True)  # the fault markers: every member is gone
    result.exits = {m.slot.member: m.returncode if m.returncode is not None else -9
                    for m in members}  # fmt: skip
    result.killed = [m.slot.member for m in members if m.killed_by_launcher]
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


def _fence(watcher: EventClient, members: list[Running], in_world: set[str]) -> None:
    """Kill members a newer generation left out; remember who is in the world."""
    while (command := watcher.next_command()) is not None:
        if isinstance(command, Stop):
            continue
        world = set(command.world)
        if isinstance(command, Reallocate):
            for m in members:
                name = m.slot.member
                if name in in_world and name not in world and m.process.poll() is None:
                    log.info("fencing %s: generation %d goes on without it", name,
                             command.generation)  # fmt: skip
                    m.killed_by_launcher = True
                    m.process.kill()
        in_world |= world


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
    member.reporter.publish("member.exited", payload)
    log.info("%s exited (%s)", member.slot.member,
             f"signal {-code}" if code < 0 else f"status {code}")  # fmt: skip


def script_path(path: str) -> Path:
    """The training script, checked to exist (a clear error rather than N failed children)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no training script at {path}")
    return p
