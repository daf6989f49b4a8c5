"""Generations are fences, for members (issue 21, items 2 and 3; scenarios 2, 4 and 5).

A peer's report counts only from an active member of the world of the generation it names,
while that generation is current; exits and joins are bound to the process (incarnation) they
name. Each scenario test below failed on the code before this change (the outcome it asserts
differed: a healthy member fenced, a shrink instead of a replace, a stopped job, a failed
member grown back into the world), and each ends with the check that folding the log from
position 0 gives the live view.
"""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.core.fold import fold
from controlplane.core.view import DiscountReason, MemberStatus
from schemas.common import FaultReason, JobState, ReallocationMode
from schemas.events import MemberExited
from tests.factories import Events
from tests.scenario import Scenario

S = JobState
#: The incarnation every event of ``Scenario`` carries unless told otherwise.
FIRST = "inc1"


def running(spares: int = 1) -> Scenario:
    """Four workers on two racks of two nodes (``w00 w01 w10 w11``, each on a node of its
    own: ``node-R-N``), ``spares`` spares (``spare0`` on ``spare-node-0``, rack0), generation
    1, complete backups at steps 10 and 20, last step 23, everyone heartbeating at t=1."""
    s = Scenario("job1", world_size=4, min_world=2)
    s.cluster(2, 2)
    for i in range(spares):
        s.join(f"spare{i}", f"spare-node-{i}", f"rack{i % 2}", role="spare")
    s.start_and_train()
    assert s.v.last_complete_backup == 20
    return s


def only(decided: list[Any], type_: str) -> Any:
    [payload] = [d.payload for d in decided if d.type == type_]
    return payload


def assert_replays(s: Scenario) -> None:
    """Folding the whole log from position 0 reproduces the live view."""
    assert fold(None, s.log) == s.v


def report(
    s: Scenario,
    reporter: str,
    kind: str,
    suspects: list[str],
    *,
    generation: int,
    incarnation: str = FIRST,
) -> None:
    """``reporter`` (its process ``incarnation``) reports a fault naming ``generation``."""
    s.add(
        s.ev.make(
            "member.fault",
            {"kind": kind, "detail": "boom", "suspects": suspects},
            source=s._src(reporter),
            generation=generation,
            incarnation=incarnation,
        )
    )


def heartbeat(s: Scenario, member: str, *, generation: int, incarnation: str = FIRST) -> None:
    s.add(
        s.ev.make(
            "member.heartbeat",
            {"step": 0, "phase": "train"},
            source=s._src(member),
            generation=generation,
            incarnation=incarnation,
        )
    )


def exit_of(s: Scenario, member: str, **process: Any) -> None:
    """The launcher of ``member``'s node reports that a process of it was killed
    (``process``: its ``pid`` and/or ``incarnation``)."""
    s.add(
        s.ev.make(
            "member.exited",
            {"member": member, "signal": 9, **process},
            source=f"{s.nodes[member]}/launcher",
        )
    )


def restart(s: Scenario, member: str, rack: str, *, incarnation: str, pid: int) -> None:
    """``member``'s launcher starts a new process of it (announced with its pid and
    incarnation), which joins as a worker."""
    node = s.nodes[member]
    s.add(
        s.ev.make(
            "member.launched",
            {"member": member, "role": "worker", "pid": pid, "incarnation": incarnation},
            source=f"{node}/launcher",
        ),
        Events(s.job_id, incarnation=incarnation).joined(
            member, node=node, rack=rack, payload={"role": "worker", "pid": pid}
        ),
    )


def discounted(s: Scenario, since: int = 0) -> list[tuple[str, str, DiscountReason]]:
    return [(d.type, d.source, d.reason) for d in s.v.discounts if d.position > since]


# --------------------------------------------------------------------------- scenario 2


def test_a_fenced_member_s_stale_reports_fail_no_healthy_member():
    """w01 hangs (SIGSTOP), is found silent and replaced by spare0; generation 2 recovers.
    w01 resumes: its generation-1 all-reduce times out and it names w00 and w10; a survivor's
    generation-1 error naming them arrives late too (two nodes: it used to corroborate, and
    both were fenced). Neither counts: the generation they name is over."""
    s = running()
    for t in (3, 5.5):
        s.at(t)
        s.heartbeat("w00", "w10", "w11", "spare0")
    s.at(6.5)
    decided = s.decide()
    detected = only(decided, "fault.detected")
    assert (detected.members, detected.reason) == (["w01"], FaultReason.HEARTBEAT_TIMEOUT)
    assert only(decided, "reallocation.issued").world == ["w00", "spare0", "w10", "w11"]
    s.recover()
    assert s.decide() and s.v.state is S.RUNNING and s.v.generation == 2
    mark = s.log[-1].position

    s.at(7)
    heartbeat(s, "w01", generation=1)  # w01 resumed, still in generation 1
    report(s, "w01", "collective_error", ["w00", "w10"], generation=1)
    report(s, "w11", "timeout", ["w00", "w10"], generation=1)
    s.heartbeat("w00", "spare0", "w10", "w11")
    assert s.decide() == []
    assert s.v.state is S.RUNNING and s.v.world == ("w00", "spare0", "w10", "w11")
    assert all(s.v.members[m].status is MemberStatus.ACTIVE for m in s.v.world)
    assert discounted(s, mark) == [
        # The failed w01's heartbeat of the abandoned world is no sign of life in this one.
        ("member.heartbeat", "node-0-1/w01", DiscountReason.STALE_GENERATION),
        ("member.fault", "node-0-1/w01", DiscountReason.STALE_REPORT),
        ("member.fault", "node-1-1/w11", DiscountReason.STALE_REPORT),
    ]
    started = s.v.generation_mark
    assert started is not None
    assert s.v.discounts[-2].detail == (
        f"collective_error from w01 about generation 1: generation 2 is current (started at"
        f" #{started.position})"
    )
    assert s.v.members["w11"].last_fault is None  # nothing waits on the stale report

    # A fenced member naming the current generation is no member of its world either.
    s.at(8)
    report(s, "w01", "collective_error", ["w00"], generation=2)
    assert s.v.discounts[-1].reason is DiscountReason.REPORTER_NOT_IN_WORLD
    assert s.v.discounts[-1].detail == (
        "collective_error from w01, not an active member of generation 2's world: it failed"
        " (heartbeat_timeout)"
    )
    assert s.decide() == []

    # Members of generation 2 on two nodes, about generation 2: that is evidence.
    report(s, "w11", "collective_error", ["w10"], generation=2)
    report(s, "spare0", "collective_error", ["w10"], generation=2)
    detected = only(s.decide(), "fault.detected")
    assert (detected.members, detected.reason) == (["w10"], FaultReason.REPORTED)
    assert detected.detail.endswith("corroborated by 2 reporters on 2 nodes (w11, spare0)")
    assert_replays(s)


def test_a_survivor_s_generation_1_error_arriving_during_recovery_fails_no_one():
    """w01 is killed; generation 2 is issued at once. The survivors' generation-1
    communicator errors, naming w10, arrive after it (from two nodes: they used to fence w10
    and cascade). The recovery goes on and resolves with its one decision."""
    s = running()
    s.at(2)
    s.exited("w01")
    first = only(s.decide(), "reallocation.issued")
    assert (first.generation, first.world) == (2, ["w00", "spare0", "w10", "w11"])
    s.at(2.02)
    report(s, "w00", "collective_error", ["w10"], generation=1)
    report(s, "w11", "collective_error", ["w10"], generation=1)
    assert s.decide() == []
    assert [d.reason for d in s.v.discounts] == [DiscountReason.STALE_REPORT] * 2
    s.at(2.5)
    s.recover()
    decided = s.decide()
    assert [d.type for d in decided] == ["incident.resolved", "job.state_changed"]
    assert decided[-1].payload.reason == "generation 2 took its first step"
    [incident] = s.v.incidents.values()
    assert len(incident.decisions) == 1 and incident.members == ["w01"]
    assert s.v.members["w10"].status is MemberStatus.ACTIVE
    assert_replays(s)


def test_a_member_s_own_fault_counts_whatever_generation_it_names_but_only_from_its_process():
    """A fault a member reports about itself is believed although it names an older
    generation (the process says it cannot go on: it fences only itself). From an earlier
    process of the name it is nothing (it used to flag the new process, which then could not
    replace anyone: the world shrank)."""
    s = running()
    s.at(2)
    s.exited("w01")
    assert only(s.decide(), "reallocation.issued").generation == 2
    # w10's out-of-memory in generation 1, arriving while generation 2 recovers.
    s.at(2.02)
    report(s, "w10", "oom", [], generation=1)
    decided = s.decide()
    detected = only(decided, "fault.detected")
    assert (detected.members, detected.reason) == (["w10"], FaultReason.REPORTED)
    assert detected.detail == "w10 reported oom: boom"
    assert only(decided, "reallocation.issued").generation == 3
    s.at(2.5)
    s.recover()
    assert s.decide() and s.v.state is S.RUNNING
    world = s.v.world
    assert "w01" not in world and "w10" not in world

    # w01 is started again (a new process); its old process then says it failed.
    s.at(3)
    restart(s, "w01", "rack0", incarnation="inc2", pid=202)
    heartbeat(s, "w01", generation=0, incarnation="inc2")
    mark = s.log[-1].position
    report(s, "w01", "exception", [], generation=1)  # the earlier process, inc1
    heartbeat(s, "w01", generation=1)  # ... which beats on, too
    new = s.v.members["w01"]
    assert (new.incarnation, new.status, new.last_fault) == ("inc2", MemberStatus.ACTIVE, None)
    assert s.v.heartbeats["w01"].position == mark
    assert s.decide() == []
    # The new process is what replaces the next member to fail (spare0: every shard of the
    # backup of step 20 still has a copy on the others).
    s.at(3.5)
    s.heartbeat(*world)
    heartbeat(s, "w01", generation=0, incarnation="inc2")
    s.exited("spare0")
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.mode is ReallocationMode.REPLACE
    assert realloc.reason == "replace spare0 with w01; restore step 20"
    assert discounted(s, mark) == [
        ("member.fault", "node-0-1/w01", DiscountReason.STALE_INCARNATION),
        ("member.heartbeat", "node-0-1/w01", DiscountReason.STALE_INCARNATION),
    ]
    assert s.v.discounts[-2].detail == (
        f"member.fault from w01's process {FIRST}: its current process is inc2 (joined at"
        f" #{new.joined_position})"
    )
    # The earlier process acks the command, restores and trains too: none of it is the
    # member's (the new process has yet to ack), and each is a discount.
    mark = s.log[-1].position
    for type_, payload in (
        ("command.acked", {"command_id": str(realloc.command_id)}),
        ("restore.completed", {"generation": realloc.generation, "step": 20, "bytes": 1,
                               "seconds": 0.1}),
        ("train.resumed", {"generation": realloc.generation, "step": 20}),
        ("train.step", {"step": 21, "loss": 1.0, "step_seconds": 0.1, "samples": 8}),
    ):  # fmt: skip
        s.add(
            s.ev.make(
                type_, payload, source=s._src("w01"), generation=realloc.generation,
                incarnation=FIRST,
            )
        )  # fmt: skip
    decision = s.v.incidents[s.v.open_incident].decisions[-1]  # type: ignore[index]
    assert "w01" not in decision.acked and "w01" not in decision.restored
    assert s.v.last_step == 20
    assert discounted(s, mark) == [
        (t, "node-0-1/w01", DiscountReason.STALE_INCARNATION)
        for t in ("command.acked", "restore.completed", "train.resumed", "train.step")
    ]
    assert_replays(s)


# --------------------------------------------------------------------------- scenario 4


@pytest.mark.parametrize("order", ["exit-then-join", "join-then-exit"])
def test_the_exit_of_the_old_process_and_the_join_of_the_new_one_decide_alike_in_any_order(
    order,
):
    """w01's process (inc1, pid 1) is killed and its launcher starts a new one (inc2, pid
    202). Whichever of the old exit and the new join the log holds first, the new process
    takes w01's rank back (it used to be marked exited by a late exit: a shrink)."""
    s = running(spares=0)
    s.at(2)
    mark = s.log[-1].position
    if order == "exit-then-join":
        exit_of(s, "w01", pid=1, incarnation=FIRST)
        restart(s, "w01", "rack0", incarnation="inc2", pid=202)
    else:
        restart(s, "w01", "rack0", incarnation="inc2", pid=202)
        exit_of(s, "w01", pid=1, incarnation=FIRST)
    heartbeat(s, "w01", generation=0, incarnation="inc2")
    s.heartbeat("w00", "w10", "w11")
    new = s.v.members["w01"]
    assert (new.incarnation, new.pid, new.status) == ("inc2", 202, MemberStatus.ACTIVE)
    decided = s.decide()
    detected = only(decided, "fault.detected")
    assert (detected.members, detected.reason) == (["w01"], FaultReason.EXITED)
    assert detected.detail == (
        "w01 came back as a new process (incarnation inc2): its process in generation 1 is gone"
    )
    realloc = only(decided, "reallocation.issued")
    assert realloc.mode is ReallocationMode.REPLACE
    assert realloc.world == ["w00", "w01", "w10", "w11"]
    # The new process is no failed member to replace: the world re-forms with it in w01's rank.
    assert realloc.reason == "re-form the world; restore step 20"
    assert realloc.plan[1] != "w01"  # the new process holds nothing of the old one's
    if order == "join-then-exit":
        assert discounted(s, mark) == [
            ("member.exited", "node-0-1/launcher", DiscountReason.STALE_EXIT)
        ]
        assert s.v.discounts[-1].detail == (
            f"exit of w01's process incarnation {FIRST}: its current process is incarnation"
            f" inc2, pid 202 (joined at #{new.joined_position})"
        )
    else:
        assert discounted(s, mark) == []
    assert_replays(s)


def test_an_exit_naming_only_a_pid_applies_to_that_pid_and_one_naming_nothing_to_the_current():
    s = running(spares=0)
    s.at(2)
    restart(s, "w01", "rack0", incarnation="inc2", pid=202)
    exit_of(s, "w01", pid=1)  # an earlier process, by its pid alone
    assert s.v.members["w01"].status is MemberStatus.ACTIVE
    assert s.v.discounts[-1].reason is DiscountReason.STALE_EXIT
    exit_of(s, "w01")  # an older launcher's exit names no process: the current one
    assert s.v.members["w01"].status is MemberStatus.EXITED
    exit_of(s, "w11", pid=1, incarnation=FIRST)  # w11's own process
    assert s.v.members["w11"].status is MemberStatus.EXITED
    assert_replays(s)


# --------------------------------------------------------------------------- scenario 5


def test_a_repeated_join_of_the_same_process_keeps_its_copies():
    """w10 announces itself again (same incarnation). Then w00 and w01 die: shard 0 survives
    only in w10's copy, which still counts (the repeated join used to make every copy w10
    had reported look like an earlier process's: the job stopped)."""
    s = running(spares=0)
    assert s.v.placement[0] == ("w01", "w10")  # shard 0 (w00's) is held by w01 and w10
    s.at(2)
    before = s.v.members["w10"]
    assert before.generation == 1
    s.add(s.ev.joined("w10", node="node-1-0", rack="rack1", payload={"role": "worker"}))
    assert s.v.members["w10"] == before  # position, copies, status, generation, rank
    [discount] = s.v.discounts
    assert (discount.type, discount.reason) == ("member.joined", DiscountReason.REPEATED_JOIN)
    assert discount.detail == (
        f"w10 joined again as incarnation {FIRST}, which joined at #{before.joined_position}:"
        " the same process, nothing changes"
    )
    s.at(3)
    s.exited("w00")
    s.exited("w01")
    decided = s.decide()
    assert "job.stopped" not in [d.type for d in decided]
    realloc = only(decided, "reallocation.issued")
    assert realloc.mode is ReallocationMode.SHRINK and realloc.world == ["w10", "w11"]
    assert realloc.restore_step == 20
    assert realloc.reason == "shrink to 2 without w00, w01 (no spare); restore step 20"
    assert realloc.plan == ["w10", "w11", "w10", "w11"]
    assert_replays(s)


def test_a_repeated_join_does_not_bring_a_failed_member_back():
    """w11 hangs and the world shrinks without it. Resumed, the same process announces
    itself again: it stays failed, and the next complete backup grows no one (it used to
    come back as a fresh member and be grown into the world). A new process of w11 is
    grown at the next backup."""
    s = running(spares=0)
    for t in (3, 5.5):
        s.at(t)
        s.heartbeat("w00", "w01", "w10")
    s.at(6.5)
    detected = only(s.decide(), "fault.detected")
    assert (detected.members, detected.reason) == (["w11"], FaultReason.HEARTBEAT_TIMEOUT)
    s.recover()
    assert s.decide() and s.v.world == ("w00", "w01", "w10") and s.v.state is S.RUNNING
    failed = s.v.members["w11"]
    assert failed.status is MemberStatus.FAILED

    s.at(7)
    s.add(s.ev.joined("w11", node="node-1-1", rack="rack1", payload={"role": "worker"}))
    heartbeat(s, "w11", generation=1)
    kept = s.v.members["w11"]
    assert (kept.status, kept.failed_reason, kept.detected_position, kept.generation) == (
        MemberStatus.FAILED,
        FaultReason.HEARTBEAT_TIMEOUT,
        failed.detected_position,
        1,
    )
    assert kept.joined_position == failed.joined_position
    # The join is discounted as repeated, and its heartbeat of the abandoned world as stale.
    assert [d.reason for d in s.v.discounts[-2:]] == [
        DiscountReason.REPEATED_JOIN,
        DiscountReason.STALE_GENERATION,
    ]
    s.heartbeat("w00", "w01", "w10")
    s.step(30)
    s.backup(30)
    assert s.v.last_complete_backup == 30
    assert s.decide() == []
    assert s.v.world == ("w00", "w01", "w10")

    # A new process of w11 is a new member: grown at the next complete backup.
    s.at(8)
    restart(s, "w11", "rack1", incarnation="inc2", pid=303)
    heartbeat(s, "w11", generation=0, incarnation="inc2")
    s.heartbeat("w00", "w01", "w10")
    s.step(40)
    s.backup(40)
    decided = s.decide()
    realloc = only(decided, "reallocation.issued")
    assert realloc.mode is ReallocationMode.GROW
    assert realloc.reason == "grow to 4 with w11 at the backup of step 40"
    assert_replays(s)


# --------------------------------------------------------------------------- the contract


def test_a_process_takes_the_incarnation_its_launcher_gave_it():
    from rank_runtime.client import EventClient
    from rank_runtime.identity import INCARNATION_ENV, Identity, IdentityError

    env = {"ELASTIC_JOB_ID": "j", "ELASTIC_NODE": "n0", "ELASTIC_RACK": "r0",
           "ELASTIC_MEMBER": "w0"}  # fmt: skip
    given = Identity.from_env({**env, INCARNATION_ENV: "a1b2c3d4e5f60718"})
    assert given.incarnation == "a1b2c3d4e5f60718"
    client = EventClient(given, commands=False, command_key=None)
    assert client.incarnation == "a1b2c3d4e5f60718"
    # Started without one (by hand, or the launcher's own reporter): the client draws one.
    drawn = EventClient(Identity.from_env(env), commands=False, command_key=None)
    assert drawn.incarnation != "a1b2c3d4e5f60718" and len(drawn.incarnation) == 16
    with pytest.raises(IdentityError, match=INCARNATION_ENV):
        Identity.from_env({**env, INCARNATION_ENV: "not one.token"})


def test_an_exit_names_its_process_and_older_exits_still_validate():
    old = MemberExited.model_validate({"member": "w0", "signal": 9})
    assert (old.pid, old.incarnation) == (None, None)
    new = MemberExited.model_validate({"member": "w0", "exit_code": 1, "pid": 4242,
                                       "incarnation": "a1b2c3"})  # fmt: skip
    assert (new.pid, new.incarnation) == (4242, "a1b2c3")
    for bad, field in (({"pid": -1}, "pid"), ({"pid": 2**63}, "pid"),
                       ({"incarnation": "a.b"}, "incarnation")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            MemberExited.model_validate({"member": "w0", **bad})
