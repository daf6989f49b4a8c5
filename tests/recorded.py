"""A recorded run with two incidents, decided by the real decider, for audit tests.

``two_incidents()`` builds the log of one job the way the service records it (member events
at their times, the decider run between them, its decisions in the same log): 4 workers on
2 racks and 1 spare, steps with a falling loss and a backup every 5 steps; at t=20 w01 is
killed (replaced by the spare), at t≈40 w10 stops heartbeating (hang; no spare left, so the
world shrinks to 3); the job completes at step 90. Deterministic: same events, ids and times
on every call.
"""

from __future__ import annotations

from typing import Any

from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView, MemberStatus
from schemas.common import Phase
from tests.scenario import Scenario

JOB = "job-recorded"
#: Heartbeat timeout in the train phase, seconds.
HANG_TIMEOUT_S = 4.0
CRASH_AT_S = 20.0
HANG_LAST_HEARTBEAT_S = 40.0
LAST_STEP = 90
BACKUP_INTERVAL = 5


def loss_at(step: int) -> float:
    """The loss every rank reports at ``step``."""
    return round(2.0 / (1.0 + 0.1 * step), 6)


def _alive(s: Scenario, *, silent: tuple[str, ...] = ()) -> list[str]:
    return [
        m
        for m, member in s.v.members.items()
        if member.status is MemberStatus.ACTIVE and m not in silent
    ]


def _train(s: Scenario, start: int, stop: int, t: float, *, silent: tuple[str, ...] = ()) -> float:
    """Steps ``start..stop`` one per half second from time ``t`` (heartbeats, backups at the
    interval, the decider run after each step); return the time after the last step."""
    for step in range(start, stop + 1):
        s.at(t)
        s.heartbeat(*_alive(s, silent=silent), step=step)
        s.step(step, loss_at(step))
        if step % BACKUP_INTERVAL == 0:
            s.backup(step)
        assert s.decide() == [], f"unexpected decision at step {step}"
        t += 0.5
    return t


def _recover(s: Scenario, t: float) -> float:
    """The world of the open incident's decision acks (+0.1 s), restores (+0.5 s), resumes
    and steps once (+0.8 s); return the time after."""
    decision = s.v.incidents[s.v.open_incident or ""].decisions[-1]
    g = decision.generation
    phases = (
        (0.1, "command.acked", {"command_id": decision.command_id}),
        (0.5, "restore.completed",
         {"generation": g, "step": decision.restore_step, "bytes": 4096, "seconds": 0.3}),
        (0.6, "train.resumed", {"generation": g, "step": decision.restore_step}),
    )  # fmt: skip
    for offset, kind, payload in phases:
        s.at(t + offset)
        s.add(*(s.ev.make(kind, payload, source=s._src(m), generation=g) for m in decision.world))
    s.at(t + 0.8)
    s.step(decision.restore_step + 1, loss_at(decision.restore_step + 1))
    s.decide()
    assert s.v.open_incident is None, "the incident did not resolve"
    return t + 1.0


def _fenced(s: Scenario, member: str, t: float, *, named: bool) -> None:
    """Just after the decision at ``t`` that left ``member`` out: its launcher kills it, the
    survivors' collective with it fails, and the launcher reports the exit."""
    g = s.v.generation
    s.at(t + 0.02)
    for survivor in s.v.world:
        s.add(
            s.ev.make(
                "member.fault",
                {"kind": "collective_error", "detail": "Connection closed by peer",
                 "suspects": [member]},
                source=s._src(survivor),
                generation=g - 1,
            )
        )  # fmt: skip
    s.at(t + 0.05)
    exited: dict[str, Any] = {"member": member, "signal": 9}
    if named:
        exited["fenced_by"] = g
    s.add(s.ev.make("member.exited", exited, source=f"{s.nodes[member]}/launcher"))


def two_incidents_scenario(
    kind: type[Scenario] = Scenario, *, fencing: str | None = None, **policy: Any
) -> Scenario:
    """The scenario behind :func:`two_incidents` (its log, view and clock); ``kind``
    ``SoftScenario``: with heartbeats as soft state (summaries in the log instead).

    ``fencing``: what the hang's decision caused, as a live job records it: the survivors'
    collective errors (released when the launcher kills the hung member), then that
    member's exit, which its launcher reports with the generation it fenced it for
    (``"named"``) or, as launchers before ``fenced_by`` did, without (``"unnamed"``)."""
    s = kind(
        JOB,
        world_size=4,
        min_world=2,
        backup_interval=BACKUP_INTERVAL,
        redundancy=1,
        heartbeat_timeout_s={Phase.INIT: 30.0, Phase.TRAIN: HANG_TIMEOUT_S},
        **policy,
    )
    s.cluster(racks=2, nodes_per_rack=2, spares=1)
    s.decide()
    t = _train(s, 1, 38, 1.0)  # t == 20.0 after step 38
    assert t == CRASH_AT_S
    s.at(CRASH_AT_S)
    s.exited("w01")
    assert s.decide(), "the crash was not decided"
    t = _recover(s, CRASH_AT_S)
    # Training goes on from the restore step until w10 hangs at t=40.
    step = s.v.last_step + 1
    t = _train(s, step, step + 36, t)
    s.at(HANG_LAST_HEARTBEAT_S)
    s.heartbeat(*_alive(s))
    # w10 is silent from here; the others heartbeat every second until the decider acts.
    t = HANG_LAST_HEARTBEAT_S
    while True:
        t += 1.0
        s.at(t)
        s.heartbeat(*_alive(s, silent=("w10",)))
        if s.decide():
            break
    if fencing is not None:
        _fenced(s, "w10", t, named=fencing == "named")
    t = _recover(s, t)
    t = _train(s, s.v.last_step + 1, LAST_STEP, t)
    s.at(t)
    for member in s.v.world:
        s.add(
            s.ev.make(
                "train.completed",
                {"step": LAST_STEP, "loss": loss_at(LAST_STEP)},
                source=s._src(member),
                generation=s.v.generation,
            )
        )
    s.decide()
    return s


def two_incidents() -> list[StoredEvent]:
    """The recorded log (positions from 1, recorded times as the service would give them)."""
    return two_incidents_scenario().log


def final_view() -> JobView:
    """The view the recorded log folds to."""
    return two_incidents_scenario().v
