"""Liveness as soft state: the in-memory table (observe, probe, summaries), the fold of a
summary, re-deciding a log whose heartbeats were never stored, and the counterfactual
timeout replayed from the summaries (exact at or above their resolution, and said when not).
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import replace
from datetime import timedelta

import pytest

from controlplane.bus import HeartbeatListener
from controlplane.core.fold import fold
from controlplane.core.liveness import TABLE, Beats, Heard, LivenessTable, _first, take_beats
from controlplane.core.replay import DEADLINE_TICK, counterfactual, redecide
from controlplane.core.view import Heartbeat
from controlplane.decode import decode_heartbeats
from schemas.common import MAX_WORLD, Phase
from schemas.events import SUMMARY_COLUMN_MEMBERS, JobPolicy, ms_of
from tests.factories import T0, Events, recorded
from tests.recorded import (
    HANG_LAST_HEARTBEAT_S,
    HANG_TIMEOUT_S,
    two_incidents,
    two_incidents_scenario,
)
from tests.scenario import SoftScenario

#: The soft recording's summary interval (its resolution): below the 4 s timeout.
SUMMARY_S = 2.0


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


@functools.cache
def soft():
    return two_incidents_scenario(SoftScenario, liveness_summary_interval_s=SUMMARY_S)


def observe(table: LivenessTable, member: str, t: float, incarnation: str = "i1", **kw):
    table.observe(
        "job1",
        member,
        node="n0",
        incarnation=incarnation,
        generation=kw.pop("generation", 1),
        at=at(t),
        step=kw.pop("step", 1),
        phase=kw.pop("phase", Phase.TRAIN),
        step_seconds=kw.pop("step_seconds", 0.0),
    )


# --------------------------------------------------------------------------- the table


def test_the_table_keeps_the_last_heartbeat_beats_and_the_largest_gap():
    table = LivenessTable(started_at=T0)
    for t in (1.0, 1.25, 1.5, 3.0, 3.25):
        observe(table, "m0", t)
    observe(table, "m0", 2.0)  # reordered in transit: older than the last one heard
    heard = table.heard("job1", "m0")
    assert heard is not None
    assert heard.last_at == at(3.25) and heard.first_ms == ms_of(at(1.0)) and heard.beats == 5
    assert heard.max_gap_ms == 1500 and heard.max_gap_at_ms == ms_of(at(1.5))
    assert table.stats.reordered == 1
    # A new process of the member starts afresh.
    observe(table, "m0", 4.0, incarnation="i2")
    heard = table.heard("job1", "m0")
    assert heard is not None and heard.incarnation == "i2" and heard.beats == 1
    assert heard.max_gap_ms == 0


def test_a_window_ends_with_its_summary_and_the_gap_across_it_counts_in_the_next():
    table = LivenessTable(started_at=T0)
    events = Events()
    view = fold(None, recorded([events.joined("m0", incarnation="i1")]))
    observe(table, "m0", 1.0)
    observe(table, "m0", 2.0)
    # Silent for more than the bound (2 s) at 4.5 s: listed in full, not named regular.
    [summary] = table.summarize(view, at(4.5), "decision")
    [entry] = summary.rows()
    assert (entry.first_at, entry.last_at, entry.beats) == (at(1.0), at(2.0), 2)
    assert summary.since == T0 and summary.at == at(4.5)
    table.summarized("job1", at(4.5))
    assert table.summary_due("job1", 10.0) == at(14.5)
    observe(table, "m0", 5.0)
    [summary] = table.summarize(view, at(6.0), "interval")
    [entry] = summary.rows()
    assert entry.first_at == at(5.0) and entry.beats == 1
    assert entry.max_gap_s == 3.0 and entry.max_gap_at == at(2.0)  # from the last window


def test_a_summary_keeps_each_member_s_longest_step_of_its_window():
    """The per-rank compute times the log keeps (no row per rank per step): the longest step
    each member's heartbeats reported in the window, reset when the window ends."""
    table = LivenessTable(started_at=T0)
    events = Events()
    view = fold(None, recorded([events.joined("m0", incarnation="i1")]))
    for t, seconds in ((1.0, 0.2), (1.25, 2.5), (1.5, 0.0), (1.75, 0.3)):
        observe(table, "m0", t, step_seconds=seconds)
    [summary] = table.summarize(view, at(2.0), "interval")
    assert [e.max_step_s for e in summary.rows()] == [2.5]
    table.summarized("job1", at(2.0))
    observe(table, "m0", 2.25, step_seconds=0.4)
    [summary] = table.summarize(view, at(3.0), "interval")
    assert [e.max_step_s for e in summary.rows()] == [0.4]


def test_an_active_member_not_heard_since_the_start_counts_as_heard_at_the_start():
    events = Events()
    log = recorded(
        [events.joined("m0", incarnation="i1"), events.joined("m1", incarnation="i1", node="n1")]
    )
    view = fold(None, log)  # joined at T0+1 s and T0+2 s
    table = LivenessTable(started_at=at(30.0))  # a takeover, later
    observe(table, "m1", 31.0)
    probe = table.probe(view)
    assert probe.heartbeats["m0"].at == at(30.0)  # assumed
    assert probe.heartbeats["m1"].at == at(31.0)  # heard
    assert view.heartbeats == {}  # the view is the log's: the probe is a copy
    parts = table.summarize(view, at(32.0), "decision")
    entries = {e.member: e for p in parts for e in p.rows()}
    assert entries["m0"].assumed and entries["m0"].beats == 0
    assert not entries["m1"].assumed
    # Folding the summary gives the log m0's assumed time; m1, heard regularly since the
    # table started, at most the bound (2 s) before the summary (not before the window).
    summary = events.cp("liveness.summary", parts[0].model_dump(mode="json"))
    folded = fold(fold(None, log), recorded([summary], start=3))
    assert folded.heartbeats["m0"].at == at(30.0)
    assert folded.heartbeats["m1"].at == at(30.0) <= probe.heartbeats["m1"].at
    assert {h.evidence for h in folded.heartbeats.values()} == {"liveness.summary"}


def test_a_summary_of_many_members_is_split_into_parts():
    events = Events()
    n = SUMMARY_COLUMN_MEMBERS + 5
    view = fold(None, recorded([events.joined(f"m{i}", incarnation="i1") for i in range(n)]))
    table = LivenessTable(started_at=T0)
    for i in range(n):
        observe(table, f"m{i}", 1.0)
    parts = table.summarize(view, at(4.0), "decision")  # silent past the bound: in full
    assert [(p.part, p.parts, len(list(p.rows()))) for p in parts] == [
        (1, 2, SUMMARY_COLUMN_MEMBERS), (2, 2, 5)]  # fmt: skip


def _steady(table: LivenessTable, member: str, start: float, end: float, **kw) -> None:
    t = start
    while t <= end + 1e-9:
        observe(table, member, t, **kw)
        t += 0.5


def test_an_interval_summary_names_the_regular_members_and_lists_the_others():
    """Heartbeats every 0.5 s (the policy's interval 1 s: the bound is 2 s). Named only:
    heard all through the window, no gap over the bound, in the common generation and
    phase, the longest step near the median. Listed in full: anyone else."""
    events = Events()
    names = ["m0", "m1", "late", "gap", "slow", "stopped", "init"]
    view = fold(None, recorded([events.joined(m, incarnation="i1") for m in names]))
    table = LivenessTable(started_at=T0)
    for member in ("m0", "m1"):
        _steady(table, member, 0.5, 9.5, step_seconds=1.0)
    _steady(table, "late", 3.0, 9.5, step_seconds=1.0)  # first heard 3 s into the window
    for t in (0.5, 1.0, 4.0, 4.5, 9.5):  # a 3 s silence
        observe(table, "gap", t, step_seconds=1.0)
    _steady(table, "slow", 0.5, 9.5, step_seconds=1.5)  # 50% slower than the median
    _steady(table, "stopped", 0.5, 6.0, step_seconds=1.0)  # silent since 6 s
    _steady(table, "init", 0.5, 9.5, phase=Phase.INIT, step_seconds=1.0)
    [summary] = table.summarize(view, at(10.0), "interval")
    assert summary.regular is not None
    assert summary.regular.members == ["m0", "m1"]
    assert (summary.regular.bound_ms, summary.regular.phase) == (2000, Phase.TRAIN)
    assert summary.regular.max_step_ms == 1000
    assert summary.columns is not None
    assert summary.columns.members == ["gap", "init", "late", "slow", "stopped"]
    # The fold moves a regular member's last heartbeat to what the log vouches for (the
    # window's end less the bound), never past the time the table heard it.
    folded = fold(view, recorded([_recorded_summary(events, summary)], start=9))
    heard = table.heard("job1", "m0")
    assert heard is not None
    assert folded.heartbeats["m0"].at == at(8.0) <= heard.last_at
    assert folded.heartbeats["stopped"].at == at(6.0)
    # A decision's summary names them too: the bound (2 s) is shorter than every phase's
    # timeout and than the silence that corroborates a report (3 intervals) ...
    [decision] = table.summarize(view, at(10.0), "decision")
    assert decision.regular == summary.regular and decision.columns == summary.columns
    # ... unless a timeout is that short: then every member is listed in full.
    short = replace(view, policy=JobPolicy(heartbeat_timeout_s={Phase.TRAIN: 2.0}))
    [decision] = table.summarize(short, at(10.0), "decision")
    assert decision.regular is None and decision.columns is not None
    assert len(decision.columns.members) == len(names)


def test_an_interval_summary_of_a_steady_job_costs_a_name_per_member():
    events = Events()
    n = 4096
    view = fold(None, recorded([events.joined(f"m{i}", incarnation="i1") for i in range(n)]))
    table = LivenessTable(started_at=T0)
    for i in range(n):
        _steady(table, f"m{i}", 0.5, 9.5, step_seconds=1.0)
    [interval] = table.summarize(view, at(10.0), "interval")
    short = replace(view, policy=JobPolicy(heartbeat_timeout_s={Phase.TRAIN: 2.0}))
    full = table.summarize(short, at(10.0), "decision")  # every member in full
    interval_bytes = len(interval.model_dump_json())
    full_bytes = sum(len(p.model_dump_json()) for p in full)
    assert interval.columns is None and interval.regular is not None
    assert interval_bytes < 10 * n and full_bytes > 5 * interval_bytes, (interval_bytes, full_bytes)


def _recorded_summary(events: Events, summary):
    return events.cp("liveness.summary", summary.model_dump(mode="json"))


def test_a_summary_of_another_process_or_from_a_member_changes_nothing():
    events = Events()
    log = recorded([events.joined("m0", incarnation="i2")])
    table = LivenessTable(started_at=T0)
    observe(table, "m0", 5.0, incarnation="i1")  # an earlier process
    assert table.summarize(fold(None, log), at(6.0), "interval") == []
    table2 = LivenessTable(started_at=T0)
    observe(table2, "m0", 5.0, incarnation="i2")
    [part] = table2.summarize(fold(None, log), at(6.0), "interval")
    forged = events.make("liveness.summary", part.model_dump(mode="json"), source="n0/m0")
    view = fold(None, [*log, *recorded([forged], start=2)])
    assert view.heartbeats == {}


# --------------------------------------------------------------------------- a recorded run


def test_a_soft_recording_decides_as_the_stored_heartbeats_did_and_replays_exactly():
    s = soft()
    log = s.log
    assert not [e for e in log if e.event.type == "member.heartbeat"]
    summaries = [e.event.payload for e in log if e.event.type == "liveness.summary"]
    assert {p.reason for p in summaries} == {"interval", "decision"}
    assert all(r.matches for r in redecide(log))
    # The same decisions at the same times as the recording with stored heartbeats.
    stored = two_incidents()

    def decisions(events):
        return [(e.recorded_at, e.event.type, e.event.event_id) for e in events
                if e.event.source == "controlplane" and e.event.type != "liveness.summary"]  # fmt: skip

    assert decisions(log) == decisions(stored)
    [_, hang] = [e.event.payload for e in log if e.event.type == "fault.detected"]
    assert hang.reason == "heartbeat_timeout" and hang.members == ["w10"]
    [evidence] = hang.evidence
    assert evidence.what == "liveness.summary" and evidence.at == at(HANG_LAST_HEARTBEAT_S)


def test_a_counterfactual_timeout_at_or_above_the_resolution_is_exact():
    longer = {"heartbeat_timeout": HANG_TIMEOUT_S + 3}
    from_summaries = counterfactual(soft().log, longer)
    from_heartbeats = counterfactual(two_incidents(), longer)
    [_, hang] = from_summaries.incidents
    [_, expected] = from_heartbeats.incidents
    assert hang.members == ("w10",) and hang.reasons == ("heartbeat_timeout",)
    assert (
        hang.detected_at
        == expected.detected_at
        == (at(HANG_LAST_HEARTBEAT_S + HANG_TIMEOUT_S + 3) + DEADLINE_TICK)
    )
    assert [(i.kind, i.members, i.decision) for i in from_summaries.incidents] == [
        (i.kind, i.members, i.decision) for i in from_heartbeats.incidents
    ]
    [note] = [n for n in from_summaries.notes if "liveness summaries" in n]
    assert "exact for the heartbeat timeouts" in note and "NOT" not in note


def test_a_counterfactual_timeout_below_the_resolution_says_it_is_not_exact():
    result = counterfactual(soft().log, {"heartbeat_timeout": SUMMARY_S / 2})
    [note] = [n for n in result.notes if "liveness summaries" in n]
    windows = [
        (e.event.payload.at - e.event.payload.since).total_seconds()
        for e in soft().log
        if e.event.type == "liveness.summary"
    ]
    # The resolution is the longest window: the interval, and up to a turn more (the
    # decider records an interval summary at its first turn once it is due; the recording
    # takes a turn a second, and a decision's summary leaves the window open).
    assert SUMMARY_S <= max(windows) <= SUMMARY_S + 1.0
    assert "NOT exact" in note and f"resolution {max(windows):g}s" in note


# --------------------------------------------------------------------------- the listener


def _beat(**over):
    body = {
        "job_id": "job1", "type": "member.heartbeat", "v": 1, "source": "n0/m0",
        "incarnation": "i1", "generation": 1, "emitted_at": "2026-01-01T00:00:00+00:00",
        "payload": {"step": 3, "phase": "train"},
    }  # fmt: skip
    body.update(over)
    return json.dumps(body).encode()


def test_a_heartbeat_is_validated_and_bound_to_its_subject():
    subject = "elastic.hb.job1.n0.member"
    beats = decode_heartbeats(subject, _beat())
    assert not isinstance(beats, str)
    assert beats == Beats("job1", "n0", ["m0"], ["i1"], [1], [3], [Phase.TRAIN], [0], [0])
    refused = {
        (subject, b"\xff"): "not JSON",
        (subject, _beat(source="n1/m0")): "forged source",
        (subject, _beat(job_id="job2")): "job mismatch",
        (subject, _beat(payload={"step": -1, "phase": "train"})): "schema violation",
        (subject, _beat(type="member.joined")): "schema violation",
        (subject, _beat(extra=1)): "schema violation",
        ("elastic.hb.job1.n0", _beat()): "not a heartbeat subject",
        ("elastic.evt.job1.n0.member.member.heartbeat", _beat()): "not a heartbeat subject",
        ("elastic.hb.job1.n0.m0", _beat()): "not a heartbeat subject",  # a name, no role
        (subject, _beat(source="n0/launcher")): "forged source",
        ("elastic.hb.job1.n0.launcher", _beat(source="n0/launcher")): "schema violation",
        (subject, b" " * 70_000): "oversized",
    }
    for (subj, data), reason in refused.items():
        got = decode_heartbeats(subj, data)
        assert isinstance(got, str) and got.startswith(reason), (subj, data[:40], got)


def test_one_bad_heartbeat_or_a_failing_taker_never_stops_the_listener():
    taken = []

    def take(beats, at):
        if beats.step[0] == 13:
            raise RuntimeError("a bug in the taker")
        taken.append((beats.node, beats.members, at))
        return [] if beats.incarnation[0] == "i1" else ["stale_incarnation: i2"]

    listener = HeartbeatListener(None, take, clock=lambda: T0)  # type: ignore[arg-type]
    subject = "elastic.hb.job1.n0.member"
    for data in (b"\x00garbage", _beat(payload={"step": 13, "phase": "train"}),
                 _beat(incarnation="i2"), _beat()):  # fmt: skip
        listener.receive(subject, data)
    assert listener.stats.received == 4 and listener.stats.accepted == 1
    assert listener.stats.refused == {"not JSON": 1, "undecodable": 1, "stale_incarnation": 1}
    assert taken[-1] == ("n0", ["m0"], T0)


def test_heartbeats_held_during_a_decision_s_append_are_taken_after_at_their_arrival():
    taken = []
    now = [T0]
    listener = HeartbeatListener(  # type: ignore[arg-type]
        None, lambda beats, at: taken.append((beats.step[0], at)) or [], clock=lambda: now[0]
    )
    subject = "elastic.hb.job1.n0.member"

    async def turn():
        with listener.held():
            for step in (1, 2):
                now[0] = T0 + timedelta(seconds=step)
                listener.receive(subject, _beat(payload={"step": step, "phase": "train"}))
            assert taken == []  # the append waits for none of them
        now[0] = T0 + timedelta(seconds=3)
        listener.receive(subject, _beat(payload={"step": 3, "phase": "train"}))
        assert taken == []  # kept behind the held ones, in order
        await asyncio.sleep(0)

    asyncio.run(turn())
    assert taken == [(s, T0 + timedelta(seconds=s)) for s in (1, 2, 3)]
    assert listener.stats.received == 3 and listener.stats.accepted == 3


def _node(beats, **over):
    """A node's message of ``beats`` (each a dict of one member's values), in columns."""
    body = {
        "job_id": "job1", "type": "node.heartbeat", "v": 1, "source": "n0/launcher",
        "emitted_at": "2026-01-01T00:00:00+00:00",
        **{key: [b[key] for b in beats] for key in
           ("members", "incarnation", "generation", "age_ms", "step", "phase", "step_ms")},
    }  # fmt: skip
    body.update(over)
    return json.dumps(body).encode()


def _relayed(member="m0", **over):
    beat = {"members": member, "incarnation": "i1", "generation": 1, "age_ms": 200,
            "step": 3, "phase": "train", "step_ms": 0}  # fmt: skip
    beat.update(over)
    return beat


def test_a_nodes_heartbeats_are_bound_to_its_launcher_and_speak_for_its_members_only():
    subject = "elastic.hb.job1.n0.launcher"
    beats = decode_heartbeats(
        subject, _node([_relayed("m0"), _relayed("m1", age_ms=0, step_ms=1500)])
    )
    assert beats == Beats("job1", "n0", ["m0", "m1"], ["i1", "i1"], [1, 1], [3, 3],
                          [Phase.TRAIN, Phase.TRAIN], [0, 1500], [200, 0])  # fmt: skip
    assert beats.source(1) == "n0/m1"
    refused = {
        (subject, _node([_relayed()], source="n1/launcher")): "forged source",
        ("elastic.hb.job1.n0.member", _node([_relayed()], source="n0/m0")): "schema violation",
        (subject, _node([_relayed()], job_id="job2")): "job mismatch",
        (subject, _node([_relayed("launcher")])): "forged",
        (subject, _node([_relayed(), _relayed()])): "schema violation",
        (subject, _node([_relayed(), _relayed("m1")], step=[1])): "schema violation",
        (subject, _node([_relayed(age_ms=60_001)])): "schema violation",
        (subject, _node([_relayed(age_ms=-1)])): "schema violation",
        (subject, _node([_relayed(phase="sleeping")])): "schema violation",
        (subject, _node([_relayed(member=f"m{i}") for i in range(513)])): "schema violation",
        (subject, _beat(source="n0/launcher")): "schema violation",
    }
    for (subj, data), reason in refused.items():
        got = decode_heartbeats(subj, data)
        assert isinstance(got, str) and got.startswith(reason), (subj, data[:60], got)


def test_a_relayed_beat_is_heard_when_its_launcher_heard_it_and_one_bad_beat_spares_the_rest():
    """Each beat of a node's message is taken as its member's own: heard ``age_ms`` before
    the message arrived; one that is refused (never joined, another node's member, an old
    incarnation) leaves the others taken."""
    sc = SoftScenario(heartbeat_interval_s=0.25)
    sc.join("m0", "n0", "r0")
    sc.join("m1", "n0", "r0")
    sc.join("m3", "n1", "r0")
    joined = {m: sc.v.members[m].incarnation for m in ("m0", "m1", "m3")}
    data = _node([
        _relayed("m0", age_ms=250, incarnation=joined["m0"]), _relayed("m2"),
        _relayed("m1", age_ms=0, incarnation=joined["m1"]),
        _relayed("m3", incarnation=joined["m3"]),  # joined on n1: n0's launcher has no say
    ])  # fmt: skip
    beats = decode_heartbeats("elastic.hb.job1.n0.launcher", data)
    assert not isinstance(beats, str)
    table = LivenessTable(T0)
    at = T0 + timedelta(seconds=5)
    refused = take_beats(table, sc.v, beats, at)
    assert [r.split(":")[0] for r in refused] == ["never joined", "forged node"]
    assert table.heard("job1", "m0").last_at == at - timedelta(milliseconds=250)
    assert table.heard("job1", "m1").last_at == at
    assert table.heard("job1", "m3") is None
    probe = table.probe(sc.v)  # what the decider judges the members on
    assert probe.heartbeats["m0"].at == at - timedelta(milliseconds=250)
    assert probe.heartbeats["m1"] == Heartbeat(at, None, TABLE, Phase.TRAIN)
    assert "m3" not in probe.heartbeats
    stale = decode_heartbeats(
        "elastic.hb.job1.n0.launcher", _node([_relayed("m1", incarnation="old")])
    )
    assert not isinstance(stale, str)
    assert take_beats(table, sc.v, stale, at)[0].startswith("stale_incarnation")
    assert take_beats(table, None, stale, at) == ["never joined: n0's members of job job1"]


# --------------------------------------------------------------------------- the columns


def _columns(**changes: object) -> dict[str, object]:
    columns: dict[str, object] = {
        "epoch_ms": 1_767_225_600_000, "members": ["m0", "m1"], "generation": [1, 1],
        "last_ms": [-250, -10], "assumed": [], "first_ms": [-9_800, None], "beats": [40, 0],
        "max_gap_ms": [260, 0], "max_gap_at_ms": [-5_000, None], "phase": ["train", "train"],
        "step": [7, 7], "max_step_ms": [1_000, 0],
    }  # fmt: skip
    columns.update(changes)
    return columns


def test_a_columnar_summary_reads_back_each_member_s_line_on_the_millisecond():
    from schemas.events import LivenessSummary, at_ms

    summary = LivenessSummary.model_validate_json(
        json.dumps(
            {
                "reason": "interval",
                "at": "2026-01-01T00:00:00.000500Z",
                "columns": _columns(assumed=[1]),
            }
        )
    )
    first, second = summary.rows()
    epoch = 1_767_225_600_000
    assert first.member == "m0" and first.node is None and first.incarnation is None
    assert first.last_at == at_ms(epoch - 250) and first.first_at == at_ms(epoch - 9_800)
    assert first.max_gap_s == 0.26 and first.max_gap_at == at_ms(epoch - 5_000)
    assert (first.beats, first.step, first.max_step_s, first.assumed) == (40, 7, 1.0, False)
    assert second.assumed and second.first_at is None and second.max_gap_at is None
    assert [m for m, *_ in summary.last_heard()] == ["m0", "m1"]


def test_a_columnar_summary_whose_columns_disagree_is_refused():
    import pytest
    from pydantic import ValidationError

    from schemas.events import LivenessColumns

    for bad, says in (
        ({"last_ms": [-250]}, "column last_ms has 1 values, not 2"),
        ({"members": ["m0", "m0"]}, "listed twice"),
        ({"assumed": [2]}, "past the members"),
        ({"last_ms": [-250, 2**40]}, "less than or equal"),
        ({"phase": ["train", "asleep"]}, "phase"),
    ):
        with pytest.raises(ValidationError, match=says):
            LivenessColumns.model_validate_json(json.dumps(_columns(**bad)))


def test_a_summary_recorded_as_entries_still_folds():
    """Logs recorded before the columns list one entry per member: they fold as before."""
    events = Events()
    log = recorded([events.joined("m0", incarnation="i1")])
    entry = {"member": "m0", "node": "n0", "incarnation": "i1", "generation": 0,
             "last_at": at(5.0).isoformat(), "phase": "train", "step": 3}  # fmt: skip
    summary = events.cp("liveness.summary", {"reason": "interval", "at": at(6.0).isoformat(),
                                             "members": [entry]})  # fmt: skip
    view = fold(fold(None, log), recorded([summary], start=2))
    assert view.heartbeats["m0"] == Heartbeat(at(5.0), 2, "liveness.summary", Phase.TRAIN)


def test_the_table_keeps_times_on_the_millisecond_a_summary_records():
    table = LivenessTable(started_at=T0 + timedelta(microseconds=1_999))
    assert table.started_at == T0 + timedelta(milliseconds=1)
    observe(table, "m0", 1.0004)  # 1000.4 ms after T0
    heard = table.heard("job1", "m0")
    assert heard is not None and heard.last_at == at(1.0)


# --------------------------------------------------------------------------- a deaf control plane


class _Store:
    """The decider's appender over the in-memory store (its port, awaited)."""

    def __init__(self, log: list) -> None:
        from controlplane.store.memory import InMemoryEventStore

        self.store = InMemoryEventStore(clock=lambda: T0)
        self.store.import_events(log)

    async def append(self, events, dead_letters=(), *, expected=None, encoded=None):  # type: ignore[no-untyped-def]
        return self.store.append(events, dead_letters, expected=expected)

    def encode(self, events):  # type: ignore[no-untyped-def]
        return None


async def _turn(
    queued: list[str], *, hear: bool, stream: list[bool] | None = None, exited: str = ""
) -> list[tuple[str, list[str]]]:
    """A running job of four, all heard at t=1; the decider's turn at t=3 (timeout 1 s)
    while the heartbeats of ``queued``, sent meanwhile, still wait unread in NATS (the
    control plane's loop was busy). With ``stream``, whether the event stream answers, turn
    after turn (a turn each); with ``exited``, that member's exit reported before. What it
    recorded: (fault reason, members) of each ``fault.detected``."""
    from controlplane.core.fold import fold_jobs
    from controlplane.decider import Decider

    timeouts = {Phase.INIT: 30.0, Phase.TRAIN: 1.0, Phase.WAITING: 30.0, Phase.BACKUP: 30.0,
                Phase.RESTORE: 30.0}  # fmt: skip
    s = SoftScenario(world_size=4, min_world=1, heartbeat_timeout_s=timeouts)
    s.cluster(2, 2)
    s.start_and_train()
    s.at(3)
    if exited:
        s.exited(exited)
    views = {s.job_id: s.v}
    store = _Store(s.log)

    def apply(result) -> None:  # type: ignore[no-untyped-def]
        views.update(fold_jobs(views, result.stored))

    async def catch_up() -> None:  # the heartbeats that were queued: heard now
        s.heartbeat(*queued)

    decider = Decider(
        views=lambda: views, apply=apply, refresh=None, appender=store, publisher=None,
        context=s.context, clock=lambda: s.now, liveness=s.table,
        hear=catch_up if hear else None,
        events_current=None if stream is None else lambda: answers[0],
    )  # fmt: skip
    answers = list(stream or [True])
    await decider.turn()
    for _ in answers[1:]:
        answers.pop(0)
        assert decider.next_wake is not None and decider.next_wake <= s.now + timedelta(seconds=1)
        await decider.turn()
    assert decider.stats.postponed == sum(1 for a in (stream or []) if not a)
    found = [
        (e.event.payload.reason.value, e.event.payload.members)
        for e in store.store.read(job_id=s.job_id, types=["fault.detected"])
    ]
    return found


async def test_a_silence_the_control_plane_caused_fails_no_one():
    """A stall of the control plane (a long fold, a collection) leaves heartbeats unread in
    NATS; judged on the table alone, every member looks silent and the job is failed whole.
    The decider takes in what reached NATS first and judges again: only a member that truly
    went silent is found."""
    everyone = ["w00", "w01", "w10", "w11"]
    assert await _turn(everyone, hear=False) == [("heartbeat_timeout", everyone)]
    assert await _turn(everyone, hear=True) == []
    assert await _turn(["w00", "w01", "w11"], hear=True) == [("heartbeat_timeout", ["w10"])]


async def test_a_silence_waits_while_the_event_stream_does_not_answer():
    """While the event stream does not answer (its leader failing over), a silent member's
    last events (its exit, its completion) may be in it: the silence is judged on a later
    turn, once the stream answers again (the decider wakes soon to look)."""
    silent = [("heartbeat_timeout", ["w10"])]
    assert await _turn(["w00", "w01", "w11"], hear=True, stream=[False]) == []
    assert await _turn(["w00", "w01", "w11"], hear=True, stream=[False, False, True]) == silent
    assert await _turn(["w00", "w01", "w11"], hear=True, stream=[True]) == silent


class _Nats:
    """What ``EventConsumer`` asks of a connection to send a pull request: nothing answers."""

    def jetstream(self, **_: object) -> object:
        return object()

    async def publish(self, *_: object, **__: object) -> None:
        return None


async def test_the_event_stream_counts_as_answering_once_what_members_sent_meanwhile_came(
    monkeypatch: pytest.MonkeyPatch,
):
    """A pull request unanswered past its expiry and a grace: the stream does not answer. Once
    it does again, what members published meanwhile is still on its way (each publication
    is sent again when its acknowledgement times out): the silences wait ``EVENTS_SETTLE_S``
    more. An answer in time (a request ending by its expiry) changes nothing."""
    from controlplane import bus
    from controlplane.settings import Settings
    from schemas.subjects import EVENT_ACK_TIMEOUT_S

    assert bus.EVENTS_SETTLE_S > EVENT_ACK_TIMEOUT_S
    clock = [1000.0]
    monkeypatch.setattr(bus.time, "monotonic", lambda: clock[0])
    settings = Settings(ingest_fetch_timeout_s=0.5)
    consumer = bus.EventConsumer(_Nats(), settings)  # type: ignore[arg-type]
    answer_s = settings.ingest_fetch_timeout_s + bus.STREAM_ANSWER_GRACE_S

    await consumer._request(10, 0.5)
    clock[0] += answer_s - 0.01
    assert consumer.answering()
    consumer._on_status("408", "Request Timeout")
    assert consumer.answering()  # answered in time: no outage

    await consumer._request(10, 0.5)
    clock[0] += answer_s + 0.01
    assert not consumer.answering()  # unanswered: a leader being elected, say
    clock[0] += 7.0
    consumer._on_status("404", "No Messages")
    assert not consumer.answering()  # answers again; members' retries still on their way
    clock[0] += bus.EVENTS_SETTLE_S - 0.01
    assert not consumer.answering()
    clock[0] += 0.02
    assert consumer.answering()


async def test_an_exit_waits_too_while_the_event_stream_does_not_answer():
    """An exit is decided on at once, but not while the stream does not answer, or answered
    again only lately: the restore step is chosen on the backups' reports, and the members'
    last ones may still be on their way."""
    everyone = ["w00", "w01", "w10", "w11"]
    exited = [("exited", ["w10"])]
    assert await _turn(everyone, hear=True, exited="w10") == exited
    assert await _turn(everyone, hear=True, exited="w10", stream=[False]) == []
    assert await _turn(everyone, hear=True, exited="w10", stream=[False, True]) == exited


def test_milliseconds_of_a_time_are_exact_and_round_down():
    import random
    from datetime import UTC, datetime

    from schemas.events import at_ms, ms_of

    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    rng = random.Random(7)
    for _ in range(20_000):
        at = epoch + timedelta(microseconds=rng.randrange(10**16))
        assert ms_of(at) == (at - epoch) // timedelta(milliseconds=1), at
        ms = rng.randrange(2**45)
        assert ms_of(at_ms(ms)) == ms


# --------------------------------------------------------------------------- the probe


def test_a_summary_moves_the_view_s_heartbeats_and_copies_no_member():
    """A summary of a large job names thousands of members: its fold changes the view's
    ``heartbeats`` (one mapping, copied once) and shares every member with the view before."""
    events = Events()
    names = ["m0", "m1", "stopped"]
    view = fold(None, recorded([events.joined(m, incarnation="i1") for m in names]))
    table = LivenessTable(started_at=T0)
    for member in ("m0", "m1"):
        _steady(table, member, 0.5, 9.5)
    _steady(table, "stopped", 0.5, 6.0)
    [summary] = table.summarize(view, at(10.0), "interval")
    assert summary.regular is not None and summary.regular.members == ["m0", "m1"]
    folded = fold(view, recorded([_recorded_summary(events, summary)], start=4))
    assert all(folded.members[m] is view.members[m] for m in names)
    assert view.heartbeats == {}  # the view folded before is untouched
    assert folded.heartbeats == {
        "m0": Heartbeat(at(8.0), 4, "liveness.summary", Phase.TRAIN),
        "m1": Heartbeat(at(8.0), 4, "liveness.summary", Phase.TRAIN),
        "stopped": Heartbeat(at(6.0), 4, "liveness.summary", Phase.TRAIN),
    }


def test_a_quick_probe_errs_only_towards_silence_and_an_exact_one_drops_an_earlier_process():
    """The quick probe merges the table's heartbeats over the log's in C; an entry of a
    member's earlier process (it joined again, and its new process has not beaten yet)
    makes it look silent since then. The exact probe takes only the view's processes, and
    drops the earlier one's entry from the table."""
    events = Events()
    log = recorded([events.joined("m0", incarnation="i1"), events.joined("m1", incarnation="i1")])
    table = LivenessTable(started_at=T0)
    observe(table, "m0", 2.5)
    observe(table, "m1", 2.5)
    view = fold(None, [*log, *recorded([events.joined("m1", incarnation="i2")], start=3)])
    quick = table.probe(view)
    assert quick.heartbeats["m1"].at == at(2.5) < view.members["m1"].joined_at == at(3.0)
    assert table.exact_for(view, quick, ["m0"]) and not table.exact_for(view, quick, ["m1"])
    exact = table.probe(view, exact=True)
    assert exact.heartbeats == {"m0": quick.heartbeats["m0"]}  # m1: its join (3 s) counts
    assert table.heard("job1", "m1") is None
    assert table.probe(view).heartbeats == exact.heartbeats  # repaired for the quick one too
    assert view.heartbeats == {}  # a probe is a copy: the view is the log's


def test_after_the_heartbeats_came_back_every_member_counts_as_heard_then_at_the_latest():
    events = Events()
    view = fold(None, recorded([events.joined(m, incarnation="i1") for m in ("m0", "m1")]))
    table = LivenessTable(started_at=T0)
    observe(table, "m0", 3.0)
    observe(table, "m0", 9.0)
    table.resume(at(6.0))  # the heartbeats' connection came back at 6 s
    probe = table.probe(view)
    assert probe.heartbeats["m0"].at == at(9.0)  # heard since
    assert probe.heartbeats["m1"].at == at(6.0)  # never heard: assumed at 6 s
    entries = {e.member: e for p in table.summarize(view, at(10.0), "decision") for e in p.rows()}
    assert entries["m1"].assumed and not entries["m0"].assumed


def test_a_decision_s_summary_leaves_the_window_open():
    """A fault, then its resolution a step later: the second decision's summary still
    covers the window since the last interval's, so it names the members heard regularly
    (a window of a fraction of an interval would list every member not heard in it)."""
    events = Events()
    view = fold(None, recorded([events.joined(f"m{i}", incarnation="i1") for i in range(4)]))
    table = LivenessTable(started_at=T0)
    for i in range(4):
        _steady(table, f"m{i}", 0.5, 9.5)
    [first] = table.summarize(view, at(9.6), "decision")
    table.summarized("job1", at(9.6), "decision")
    assert table.summary_due("job1", 10.0) == at(10.0)  # the interval's, as before
    [second] = table.summarize(view, at(9.8), "decision")
    assert first.since == second.since == T0
    assert second.regular is not None and len(second.regular.members) == 4
    table.summarized("job1", at(10.0), "interval")
    assert table.summary_due("job1", 10.0) == at(20.0)


def _timeouts(train: float) -> dict[Phase, float]:
    return {Phase.INIT: 30.0, Phase.TRAIN: train, Phase.WAITING: 30.0, Phase.BACKUP: 30.0,
            Phase.RESTORE: 30.0}  # fmt: skip


async def test_the_decider_decides_once_on_the_log_s_own_view_and_replays_exactly():
    """A hang: the decider judges it on its probe, records the summary (the three members
    heard regularly named, the silent one in full), and decides on the view that folded
    it. Its views are the fold of its log, and re-deciding the log gives its decisions."""
    from controlplane.core.fold import fold_jobs
    from controlplane.decider import Decider

    s = SoftScenario(world_size=4, min_world=1, heartbeat_timeout_s=_timeouts(2.5))
    s.cluster(2, 2)
    s.start_and_train()  # all heard at 1 s
    for t in (2.0, 3.0):
        s.at(t)
        s.heartbeat("w00", "w01", "w11")  # w10 hangs after 1 s
    s.at(4.0)
    views = {s.job_id: s.v}
    store = _Store(s.log)

    def apply(result) -> None:  # type: ignore[no-untyped-def]
        views.update(fold_jobs(views, result.stored))

    decider = Decider(
        views=lambda: views, apply=apply, refresh=None, appender=store, publisher=None,
        context=s.context, clock=lambda: s.now, liveness=s.table,
    )  # fmt: skip
    await decider.turn()
    log = store.store.read(job_id=s.job_id)
    [summary] = [e for e in log if e.event.type == "liveness.summary"][-1:]
    payload = summary.event.payload
    assert payload.reason == "decision" and payload.regular is not None
    assert payload.regular.members == ["w00", "w01", "w11"]
    assert payload.columns is not None and payload.columns.members == ["w10"]
    [detected] = [e.event.payload for e in log if e.event.type == "fault.detected"]
    assert (detected.reason, detected.members) == ("heartbeat_timeout", ["w10"])
    assert detected.evidence[0].position == summary.position
    assert views[s.job_id] == fold(None, log)  # the live view is the log's
    assert all(r.matches for r in redecide(log))


def test_a_summary_names_more_regular_members_than_a_world_holds_in_several_parts():
    """A world of MAX_WORLD ranks with its spares: the members heard regularly are named in
    parts of at most MAX_WORLD (one list of them all failed validation, and with it every
    summary of such a job); the parts folded give each one its heartbeat."""
    n = MAX_WORLD + 8
    names = [f"m{i}" for i in range(n)]
    events = Events()
    view = fold(None, recorded([events.joined(m, incarnation="i1") for m in names]))
    table = LivenessTable(started_at=T0)
    beats = Beats("job1", "n0", names, ["i1"] * n, [0] * n, [0] * n, [Phase.TRAIN] * n,
                  [0] * n, [0] * n)  # fmt: skip
    for t in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0):
        assert take_beats(table, view, beats, at(t)) == []
    parts = table.summarize(view, at(3.0), "interval")
    assert [(p.part, p.parts, p.columns) for p in parts] == [(1, 2, None), (2, 2, None)]
    named = [m for p in parts if p.regular is not None for m in p.regular.members]
    assert [len(p.regular.members) for p in parts if p.regular] == [MAX_WORLD, 8]
    assert named == sorted(names)
    folded = fold(view, recorded([_recorded_summary(events, p) for p in parts], start=n + 1))
    assert {folded.heartbeats[m].at for m in names} == {at(1.0)}


def test_the_entry_of_a_first_heartbeat_holds_what_its_fields_say():
    """``_first`` builds a ``Heard`` positionally (one per member a simulated turn): a field
    added or moved in ``Heard`` must not shift what it holds."""
    made = _first("n0", "i1", 3, Phase.TRAIN, 7, at(1.0), 1000, 250, 2)
    assert made == Heard("n0", "i1", 3, Phase.TRAIN, 7, at(1.0), 1000, window=2, first_ms=1000,
                         beats=1, max_step_ms=250)  # fmt: skip
