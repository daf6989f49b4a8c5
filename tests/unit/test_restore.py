"""Choosing the restore step and the source of each shard."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.commands import owed
from controlplane.core.fold import fold
from controlplane.core.placement import Slot
from controlplane.core.replay import redecide
from controlplane.core.restore import plan_restore, surviving_copies
from schemas.commands import Reallocate
from tests.factories import Events, recorded
from tests.scenario import Scenario

SLOTS = {
    "m0": Slot("m0", "n0", "r0"),
    "m1": Slot("m1", "n1", "r0"),
    "m2": Slot("m2", "n2", "r1"),
    "m3": Slot("m3", "n3", "r1"),
    "spare": Slot("spare", "n1", "r0"),
}
WORLD = ["m0", "m1", "m2", "m3"]


def backups(
    ev: Events, step: int, holders: dict[int, list[str]], skip_owner: set[int] = frozenset()
):
    out = []
    for r, owner in enumerate(WORLD):
        checksum = f"crc32:{step:04x}{r:04x}"
        if r not in skip_owner:
            out.append(
                ev.make(
                    "backup.snapshot",
                    {"step": step, "shard": r, "nbytes": 8, "checksum": checksum, "seconds": 0.0},
                    source=f"{SLOTS[owner].node}/{owner}",
                )
            )
        for holder in holders.get(r, []):
            out.append(
                ev.make(
                    "backup.replicated",
                    {
                        "step": step,
                        "shard": r,
                        "owner": owner,
                        "nbytes": 8,
                        "checksum": checksum,
                        "seconds": 0.0,
                    },
                    source=f"{SLOTS[holder].node}/{holder}",
                )
            )
    return out


def view_with(*steps):
    ev = Events()
    events = [ev.cp("job.registered", {"policy": {"redundancy": 1}})]
    events += [ev.joined(m, node=s.node, rack=s.rack) for m, s in SLOTS.items()]
    events.append(ev.cp("generation.started", {"generation": 0, "world": WORLD, "rendezvous": "x"}))
    for step, holders in steps:
        events += backups(ev, step, holders)
    return fold(None, recorded(events))


RING = {0: ["m2"], 1: ["m3"], 2: ["m0"], 3: ["m1"]}


def test_survivors_restore_from_their_own_memory_and_the_spare_from_a_holder():
    view = view_with((10, RING), (20, RING))
    survivors = {"m0", "m1", "m2", "spare"}  # m3 died; the spare takes rank 3
    receivers = {0: "m0", 1: "m1", 2: "m2", 3: "spare"}
    plan = plan_restore(view, survivors, receivers, SLOTS)
    assert plan is not None and plan.step == 20
    assert dict(enumerate(plan.sources)) == {0: "m0", 1: "m1", 2: "m2", 3: "m1"}  # m1 holds shard 3


def test_the_newest_step_whose_every_shard_survives():
    # At step 20 shards 1 and 3 have one replica each (on m3, m1); at step 10 also on m2.
    view = view_with((10, {**RING, 1: ["m3", "m2"], 3: ["m1", "m2"]}), (20, RING))
    survivors = {"m0", "m2", "spare"}  # m1 and m3 died together
    plan = plan_restore(view, survivors, {0: "m0", 1: "spare", 2: "m2", 3: "spare"}, SLOTS)
    assert plan is not None and plan.step == 10
    assert dict(enumerate(plan.sources)) == {0: "m0", 1: "m2", 2: "m2", 3: "m2"}


def test_no_whole_copy_anywhere():
    view = view_with((10, RING))
    # Shard 1 lived on m1 and m3 only; both are gone.
    assert plan_restore(view, {"m0", "m2", "spare"}, {}, SLOTS) is None


def test_sources_spread_over_holders_and_prefer_nearby():
    holders = {0: ["m1", "m2"], 1: ["m0", "m2"], 2: ["m3", "m0"], 3: ["m2", "m0"]}
    view = view_with((10, holders))
    survivors = {"m2", "m3", "spare"}  # rack r0's workers died
    plan = plan_restore(view, survivors, {0: "spare", 1: "m3", 2: "m2", 3: "m3"}, SLOTS)
    assert plan is not None
    sources = dict(enumerate(plan.sources))
    assert sources[2] == "m2" and sources[3] == "m3"  # own memory
    assert {sources[0], sources[1]} <= {"m2"}  # the only survivors holding them


MEMBERS = list(SLOTS)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {r: st.lists(st.sampled_from(MEMBERS), max_size=3, unique=True) for r in range(4)}
        ),
        min_size=1,
        max_size=3,
    ),
    st.sets(st.sampled_from(MEMBERS)),
)
def test_the_chosen_step_is_always_fully_covered_by_survivors(steps, survivors):
    holders = [{r: [h for h in hs if h != WORLD[r]] for r, hs in step.items()} for step in steps]
    view = view_with(*((10 * (i + 1), h) for i, h in enumerate(holders)))
    receivers = dict(enumerate(WORLD))
    plan = plan_restore(view, survivors, receivers, SLOTS)
    covered = [
        s
        for s, b in view.backups.items()
        if all(surviving_copies(x, survivors) for x in b.shards.values())
    ]
    if plan is None:
        assert covered == []
        return
    assert plan.step == max(covered)
    backup = view.backups[plan.step]
    for shard, source in enumerate(plan.sources):
        assert source in survivors
        assert source in surviving_copies(backup.shards[shard], survivors)
    assert plan_restore(view, survivors, receivers, SLOTS) == plan  # deterministic


# --------------------------------------------------------------------------- refused copies


def refuse(ev: Events, reporter: str, step: int, shard: int, source: str):
    """A member's restore refused ``source``'s copy of ``shard`` (not the recorded digest)."""
    payload = {"kind": "restore_failed", "detail": "digest mismatch", "step": step,
               "shard": shard, "source": source}  # fmt: skip
    return ev.make("member.fault", payload, source=f"{SLOTS[reporter].node}/{reporter}")


def test_a_refused_copy_is_never_a_source_again():
    holders = {**RING, 3: ["m1", "m2"]}
    ev = Events()
    events = [ev.cp("job.registered", {"policy": {"redundancy": 1}})]
    events += [ev.joined(m, node=s.node, rack=s.rack) for m, s in SLOTS.items()]
    events.append(ev.cp("generation.started", {"generation": 0, "world": WORLD, "rendezvous": "x"}))
    events += backups(ev, 10, holders) + backups(ev, 20, holders)
    view = fold(None, recorded(events))
    survivors = {"m0", "m1", "m2", "spare"}
    receivers = {0: "m0", 1: "m1", 2: "m2", 3: "spare"}
    assert plan_restore(view, survivors, receivers, SLOTS).sources[3] == "m1"  # same node
    view = fold(view, recorded([refuse(ev, "spare", 20, 3, "m1")], start=100))
    assert view.backups[20].shards[3].refuted == ("m1",)
    plan = plan_restore(view, survivors, receivers, SLOTS)
    assert plan is not None and plan.step == 20 and plan.sources[3] == "m2"
    # Both copies of step 20 refused: the older step, still whole.
    view = fold(view, recorded([refuse(ev, "spare", 20, 3, "m2")], start=200))
    plan = plan_restore(view, survivors, receivers, SLOTS)
    assert plan is not None and plan.step == 10 and plan.sources[3] == "m1"
    # An owner whose own memory was refused restores its shard from a holder.
    view = fold(view, recorded([refuse(ev, "m2", 10, 2, "m2")], start=300))
    plan = plan_restore(view, survivors, receivers, SLOTS)
    assert plan is not None and plan.step == 10 and plan.sources[2] == "m0"


def recovering_with_digests() -> tuple[Scenario, object]:
    """4 workers (redundancy 2, sha256 digests), w01 killed: the spare is to restore shard 1."""
    s = Scenario("job1", world_size=4, min_world=2, redundancy=2)
    s.cluster(2, 2, spares=1)
    s.decide()
    s.at(1)
    s.heartbeat_all()
    for step in (10, 20):
        s.step(step)
        s.backup(step)
    s.step(23)
    s.at(2)
    s.exited("w01")
    [first] = [d.payload for d in s.decide() if d.type == "reallocation.issued"]
    return s, first


def test_the_decision_and_the_command_carry_each_shard_s_recorded_digest():
    s, first = recovering_with_digests()
    backup = s.v.backups[first.restore_step]
    digests = [backup.shards[n].checksum for n in range(4)]
    # The recorded decision leaves them to the fold, which takes them from the catalog.
    assert first.digests == []
    decision = s.v.incidents[str(first.incident_id)].decisions[-1]
    assert list(decision.digests) == digests
    [command] = owed(s.v)
    assert isinstance(command, Reallocate) and command.digests == digests
    assert Reallocate.model_validate_json(command.model_dump_json()).digests == digests


def _with_recorded_digests(log: list, digests: list[str]) -> list:
    """``log`` as a decider before fold revision 5 recorded it: each ``reallocation.issued``
    carrying its digests."""
    out = []
    for stored in log:
        event = stored.event
        if event.type == "reallocation.issued":
            payload = event.payload.model_copy(update={"digests": digests})
            event = event.model_copy(update={"payload": payload})
        out.append(replace(stored, event=event))
    return out


def test_a_log_that_recorded_the_digests_folds_and_re_decides_the_same():
    s, first = recovering_with_digests()
    backup = s.v.backups[first.restore_step]
    digests = [backup.shards[n].checksum for n in range(4)]
    old = _with_recorded_digests(s.log, digests)
    view = fold(None, old)
    decision = view.incidents[str(first.incident_id)].decisions[-1]
    assert list(decision.digests) == digests
    [command] = owed(view)
    assert isinstance(command, Reallocate) and command.digests == digests
    assert all(r.matches for r in redecide(old))
    # Digests the catalog does not hold are a decision this decider does not make.
    forged = _with_recorded_digests(s.log, ["sha256:" + "0" * 64] * 4)
    assert not all(r.matches for r in redecide(forged))
    assert all(r.matches for r in redecide(s.log))


def test_a_forged_copy_refused_at_restore_is_re_planned_around_and_never_resolved_on():
    s, first = recovering_with_digests()
    forger = first.plan[1]
    assert forger not in {"w01", "spare0"}
    s.at(3)
    s.add(
        s.ev.make(
            "member.fault",
            {"kind": "restore_failed", "detail": "digest mismatch", "step": first.restore_step,
             "shard": 1, "source": forger},
            source=s._src("spare0"), generation=first.generation,
        )
    )  # fmt: skip
    decided = s.decide()
    types = [d.type for d in decided]
    assert "incident.resolved" not in types and "fault.detected" not in types, types
    [second] = [d.payload for d in decided if d.type == "reallocation.issued"]
    assert second.incident_id == first.incident_id and second.generation == first.generation + 1
    assert second.restore_step == first.restore_step and second.plan[1] not in {forger, "w01"}
    assert second.digests == first.digests == []
    decisions = s.v.incidents[str(first.incident_id)].decisions
    assert decisions[-1].digests == decisions[-2].digests != ()
    assert s.v.members[forger].status.value == "active"  # the copy is refuted, not the member
    assert any("refused shard 1 from" in d.payload.reason for d in decided
               if d.type == "job.state_changed")  # fmt: skip


def test_when_every_copy_of_the_step_is_refused_an_older_one_is_restored():
    s, first = recovering_with_digests()
    refused = [first.plan[1]]
    decided: list = []
    for t in (3, 4):
        s.at(t)
        s.add(
            s.ev.make(
                "member.fault",
                {"kind": "restore_failed", "detail": "digest mismatch", "step": 20, "shard": 1,
                 "source": refused[-1]},
                source=s._src("spare0"), generation=s.v.generation,
            )
        )  # fmt: skip
        decided = s.decide()
        [realloc] = [d.payload for d in decided if d.type == "reallocation.issued"]
        refused.append(realloc.plan[1])
    assert realloc.restore_step == 10 and "incident.resolved" not in [d.type for d in decided]


# --------------------------------------------------------------------------- unheard owners


def _trained(
    *, past: bool, unheard: int, dies: int, heard: int | None = None
) -> tuple[Scenario, object]:
    """4 workers and a spare, complete backups at step 10; at step 15 nothing heard of rank
    ``unheard``'s shard, then (when ``past``) step 17; (with ``heard``) a liveness summary
    hearing the other ranks at that step; then rank ``dies`` exits. The decision."""
    s = Scenario("job1", world_size=4, min_world=2, redundancy=1)
    s.cluster(2, 2, spares=1)
    s.decide()
    s.at(1)
    s.heartbeat_all()
    s.step(10)
    s.backup(10, named=True)
    s.step(15)
    s.backup(15, named=True, unheard={s.v.world[unheard]})
    if past:
        s.step(17)
    if heard is not None:
        others = [m for m in s.v.world if m != s.v.world[unheard]]
        _heard_at(s, others, heard)
    s.at(2)
    s.exited(s.v.world[dies])
    [decision] = [d.payload for d in s.decide() if d.type == "reallocation.issued"]
    return s, decision


def test_a_backup_whose_lost_owner_never_reported_is_restored_from_where_its_copies_went():
    """A member whose reports were never heard (cut off from the control plane while it
    trained on with its peers, or killed before its report left) took the backups its peers
    reported: the job went past them, so every rank took their steps. Its shard comes from
    the holders the placement sent it to, without the owners' digests (none was recorded for
    it); a copy a holder turns out not to have is refuted, and the plan falls back to the
    newest step whose every shard was reported."""
    s, decision = _trained(past=True, unheard=1, dies=1)
    placed = _placement_before(s)
    assert decision.restore_step == 15
    assert decision.plan[1] in placed[1], (decision.plan, placed)
    recorded_decision = s.v.incidents[str(decision.incident_id)].decisions[-1]
    assert recorded_decision.digests == ()  # shard 1's was never recorded: none is checked
    # Its holder does not have it (the owner died before it sent it): refuted, re-planned.
    s.add(_not_held(s, decision.world[1], 15, 1, decision.plan[1]))
    [again] = [d.payload for d in s.decide() if d.type == "reallocation.issued"]
    assert again.restore_step == 10 and again.incident_id == decision.incident_id


def test_no_unreported_shard_is_guessed_while_its_owner_lives_or_before_the_job_went_past():
    # Rank 1's report of step 15 is only late (it lives); rank 2 dies.
    assert _trained(past=True, unheard=1, dies=2)[1].restore_step == 10
    # The job never went past step 15: its lost owner may have died taking it.
    assert _trained(past=False, unheard=1, dies=1)[1].restore_step == 10


def test_heartbeats_tell_the_job_went_past_when_the_member_that_reports_steps_is_cut_off():
    """Rank 0 reports the job's steps: cut off from the control plane, its last report is
    the step of the cut, though the others trained on with it. Their heartbeats (a liveness
    summary) carry their steps: two past a backup, every rank took the step after it, the
    lost rank 0's snapshot of it too."""
    s, decision = _trained(past=False, unheard=0, dies=0, heard=17)
    assert decision.restore_step == 15 and decision.plan[0] in _placement_before(s)[0]
    assert s.v.heard_step == s.v.last_step == 15  # the new generation starts at its restore
    # One step past it is not enough: rank 0 may have died between the step and its backup.
    assert _trained(past=False, unheard=0, dies=0, heard=16)[1].restore_step == 10


def _heard_at(s: Scenario, members: list[str], step: int) -> None:
    """A ``liveness.summary`` now: ``members`` heard in the current generation at ``step``."""
    payload = {
        "reason": "interval", "at": s.now, "since": s.now,
        "regular": {
            "members": members, "bound_ms": 500, "generation": s.v.generation,
            "phase": "train", "step_min": step, "step_max": step, "max_step_ms": 100,
        },
    }  # fmt: skip
    s.add(s.ev.make("liveness.summary", payload, source="controlplane", generation=s.v.generation))


def _placement_before(s: Scenario) -> list[list[str]]:
    """The placement of the generation before the latest decision's."""
    started = [e for e in s.log if e.event.type == "generation.started"]
    return started[-2].event.payload.placement


def _not_held(s: Scenario, reporter: str, step: int, shard: int, source: str):
    """``reporter``'s restore (in the current generation) found no copy at ``source``."""
    payload = {"kind": "restore_failed", "detail": "not held", "step": step, "shard": shard,
               "source": source}  # fmt: skip
    return s.ev.make("member.fault", payload, source=s._src(reporter), generation=s.v.generation)
