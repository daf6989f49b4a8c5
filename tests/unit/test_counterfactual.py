"""Replaying a log without a server: the view at a point, and the counterfactual decider."""

from __future__ import annotations

import functools
import io
import json
from datetime import timedelta

import pytest
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.core.decide import Context
from controlplane.core.fold import fold
from controlplane.core.replay import (
    DEADLINE_TICK,
    PolicyError,
    counterfactual,
    override_policy,
)
from controlplane.postmortem.logfile import read_log, write_log
from controlplane.postmortem.replay import (
    ReplayError,
    parse_overrides,
    parse_until,
    replay_log,
)
from schemas.common import CONTROLPLANE_SOURCE, JobState, Phase
from schemas.events import JobPolicy
from tests.factories import T0
from tests.recorded import CRASH_AT_S, HANG_LAST_HEARTBEAT_S, HANG_TIMEOUT_S, two_incidents_scenario
from tests.recorded import two_incidents as _two_incidents
from tests.scenario import RENDEZVOUS

two_incidents = functools.cache(_two_incidents)
TICK_S = DEADLINE_TICK.total_seconds()


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


def hang(result):
    """The hang incident of a replay of the recorded run (the second one)."""
    [_crash, hang] = result.incidents
    assert hang.members == ("w10",) and hang.reasons == ("heartbeat_timeout",)
    return hang


# --------------------------------------------------------------------------- counterfactual


def test_a_longer_heartbeat_timeout_moves_the_hang_detection_by_the_difference():
    log = two_incidents()
    redecided = counterfactual(log, {})
    longer = counterfactual(log, {"heartbeat_timeout": HANG_TIMEOUT_S + 3})
    # The fault is the hung member's last heartbeat either way.
    assert hang(redecided).fault_at == hang(longer).fault_at == at(HANG_LAST_HEARTBEAT_S)
    # The decider runs just after its deadline (one tick): timeout + tick after the fault.
    assert hang(redecided).detected_at == at(HANG_LAST_HEARTBEAT_S + HANG_TIMEOUT_S + TICK_S)
    assert hang(longer).detected_at == at(HANG_LAST_HEARTBEAT_S + HANG_TIMEOUT_S + 3 + TICK_S)
    assert hang(longer).detected_at - hang(redecided).detected_at == timedelta(seconds=3)
    # Against the recording: its decider ran once a second (at the heartbeats), so it was up
    # to a second later than the deadline; the shift is 3 s less that lateness.
    [_, recorded] = longer.recorded_incidents
    late = recorded.detected_at - hang(redecided).detected_at
    assert timedelta(0) <= late <= timedelta(seconds=1)
    assert hang(longer).detected_at - recorded.detected_at == timedelta(seconds=3) - late
    # The same decision, answered as it was answered (shifted): the recovery takes as long.
    assert hang(longer).decision == recorded.decision
    assert hang(longer).first_step_at - hang(longer).decided_at == (
        recorded.first_step_at - recorded.decided_at
    )
    assert hang(longer).downtime_s == pytest.approx(recorded.downtime_s + 3 - late.total_seconds())
    assert longer.replayed.state is JobState.COMPLETED and longer.unplayed == 0


@functools.cache
def fenced_run(named: str) -> list:
    """The recorded run with what its hang's decision caused: the survivors' collective
    errors and the hung member's fencing exit (named by its launcher, or not)."""
    return two_incidents_scenario(fencing=named).log


@pytest.mark.parametrize("named", ["named", "unnamed"])
def test_what_a_decision_caused_moves_with_it(named):
    """A longer timeout on a run whose decision fenced the hung member: the fencing exit and
    the errors it released in the survivors are the decision's consequences, not facts of
    the world. The hang is found by its timeout after the member's last heartbeat, and the
    downtime grows by the difference, as on the run without them; replayed at their
    recorded times, the exit would have been taken for a crash found at once."""
    log = fenced_run(named)
    plain = counterfactual(two_incidents(), {"heartbeat_timeout": HANG_TIMEOUT_S + 5})
    result = counterfactual(log, {"heartbeat_timeout": HANG_TIMEOUT_S + 5})
    found = hang(result)
    assert found.reasons == ("heartbeat_timeout",)
    assert found.fault_at == at(HANG_LAST_HEARTBEAT_S)
    assert found.detected_at == at(HANG_LAST_HEARTBEAT_S + HANG_TIMEOUT_S + 5 + TICK_S)
    [_, recorded] = result.recorded_incidents
    assert recorded.downtime_s < HANG_TIMEOUT_S + 2
    assert found.downtime_s == pytest.approx(hang(plain).downtime_s)
    assert found.downtime_s == pytest.approx(9.8, abs=0.01)
    assert found.downtime_s > recorded.downtime_s + 4
    assert result.replayed.state is JobState.COMPLETED and result.unplayed == 0
    inferred = 0 if named == "named" else 1
    [caused] = [n for n in result.notes if "fencing exit" in n]
    assert f"1 fencing exit(s) ({1 - inferred} named by their launcher, {inferred} inferred" in (
        caused
    )
    assert "3 fault report(s)" in caused
    # A replay up to the hang's detection, which moved; a simulation after it.
    assert result.replay_until == min(recorded.detected_at, found.detected_at)
    assert any(n.startswith(f"a replay until {result.replay_until.isoformat()}")
               for n in result.notes)  # fmt: skip


def test_without_overrides_a_fenced_run_replays_as_recorded_until_the_hang():
    """Under the recorded policy the consequences move with the same decision, only the
    deadline (not the recording's once-a-second turn) sets when: the same incidents."""
    result = counterfactual(fenced_run("named"), {})
    [crash, found] = result.incidents
    [recorded_crash, recorded] = result.recorded_incidents
    assert crash == recorded_crash
    assert found.reasons == recorded.reasons and found.decision == recorded.decision
    assert found.detected_at <= recorded.detected_at


def test_a_counterfactual_that_decides_as_recorded_is_a_replay_throughout():
    log = [s for s in two_incidents() if s.recorded_at < at(HANG_LAST_HEARTBEAT_S)]
    result = counterfactual(log, {})
    assert result.replay_until is None
    assert "a replay throughout" in " ".join(result.notes)


def test_a_shorter_timeout_detects_the_hang_sooner():
    result = counterfactual(two_incidents(), {"heartbeat_timeout": 2})
    assert hang(result).detected_at == at(HANG_LAST_HEARTBEAT_S + 2 + TICK_S)
    assert hang(result).downtime_s < result.recorded_incidents[1].downtime_s


def test_the_timeout_changes_nothing_for_a_crash():
    result = counterfactual(two_incidents(), {"heartbeat_timeout": 30})
    crash, recorded = result.incidents[0], result.recorded_incidents[0]
    assert crash.detected_at == recorded.detected_at == at(CRASH_AT_S)
    assert (crash.reasons, crash.members, crash.decision) == (
        recorded.reasons,
        recorded.members,
        recorded.decision,
    )
    assert crash.downtime_s == recorded.downtime_s and crash.steps_lost == recorded.steps_lost


def test_without_overrides_the_decider_reproduces_the_recorded_decisions_until_the_hang():
    """Same member events, same decider: the same decisions (ids and payloads) as recorded,
    up to the hang, which the recording's once-a-second decider found later."""
    log = two_incidents()
    result = counterfactual(log, {})
    recorded = [s.event for s in log if s.event.source == CONTROLPLANE_SOURCE]
    before_hang = [e for e in recorded if e.emitted_at < at(HANG_LAST_HEARTBEAT_S)]
    replayed = [s.event for s in result.decisions][: len(before_hang)]
    assert [(e.event_id, e.type, e.payload) for e in replayed] == [
        (e.event_id, e.type, e.payload) for e in before_hang
    ]
    # And the hang is decided the same way, with the same ids, only sooner.
    assert [s.event.event_id for s in result.decisions] == [e.event_id for e in recorded]
    assert result.policy == result.recorded_policy
    assert result.replayed.state is JobState.COMPLETED


def test_recorded_decisions_are_not_replayed():
    """The counterfactual decides from member events alone: up to the hang (where nothing is
    shifted), a log stripped of the recorded decisions gives the same decisions; only the
    policy (from job.registered), the rendezvous base and the recorded generation starts are
    read from them."""
    log = [s for s in two_incidents() if s.recorded_at < at(HANG_LAST_HEARTBEAT_S)]
    members_only = [s for s in log if s.event.source != CONTROLPLANE_SOURCE]
    full = counterfactual(log, {"heartbeat_timeout": 6})
    policy = {"min_world": 2, "world_size": 4, "backup_interval": 5, "redundancy": 1}
    # The rendezvous base is read from the recorded starts too: given here.
    context = Context(rendezvous=RENDEZVOUS)
    bare = counterfactual(members_only, {"heartbeat_timeout": 6, **policy}, context=context)
    assert bare.policy == full.policy
    assert [s.event for s in bare.decisions] == [s.event for s in full.decisions]
    assert bare.incidents == full.incidents and len(full.incidents) == 1
    assert "no job.registered" in " ".join(bare.notes)


def test_a_timeout_longer_than_the_log_lasts_still_detects_the_hang():
    """The members of the shrunken world answered a decision the counterfactual has not made
    yet: they wait for it (silent), and the hang is detected after the log's last event."""
    result = counterfactual(two_incidents(), {"heartbeat_timeout": 60})
    assert two_incidents()[-1].recorded_at < at(HANG_LAST_HEARTBEAT_S + 60)
    assert hang(result).detected_at == at(HANG_LAST_HEARTBEAT_S + 60 + TICK_S)
    assert result.unplayed == 0 and result.replayed.state is JobState.COMPLETED


def test_a_decision_never_made_leaves_its_answers_unplayed():
    """With min_world 4 the hang cannot shrink the world: the job stops, and what the members
    did in the recorded generation 3 is not replayed."""
    result = counterfactual(two_incidents(), {"min_world": 4})
    crash, stopped = result.incidents
    assert crash.outcome == "recovered" and crash.decision == result.recorded_incidents[0].decision
    assert stopped.outcome == "stopped" and stopped.decision is None
    assert result.replayed.state is JobState.STOPPED
    recorded_answers = [
        s for s in two_incidents()
        if s.event.source != CONTROLPLANE_SOURCE and s.event.generation == 3
    ]  # fmt: skip
    assert result.unplayed == len(recorded_answers) > 0
    assert any("generations [3]" in note for note in result.notes)


def test_policy_overrides():
    base = JobPolicy(heartbeat_timeout_s={Phase.TRAIN: 4.0, Phase.BACKUP: 15.0}, redundancy=1)
    policy = override_policy(base, {"heartbeat_timeout": 7})
    assert policy.heartbeat_timeout_s == {Phase.TRAIN: 7.0, Phase.BACKUP: 15.0}
    policy = override_policy(base, {"heartbeat_timeout.backup": 20, "redundancy": 2})
    assert policy.heartbeat_timeout_s == {Phase.TRAIN: 4.0, Phase.BACKUP: 20.0}
    assert policy.redundancy == 2
    # The whole map, then a phase on top of it.
    policy = override_policy(
        base, {"heartbeat_timeout_s": {"train": 9}, "heartbeat_timeout.init": 1.5}
    )
    assert policy.heartbeat_timeout_s == {Phase.TRAIN: 9.0, Phase.INIT: 1.5}
    assert override_policy(base, {}) == base


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"heartbeat_timeouts": 7}, "unknown policy key 'heartbeat_timeouts'"),
        ({"redundancy.x": 1}, "unknown policy key 'redundancy.x'"),
        ({"heartbeat_timeout.sleep": 7}, "unknown phase 'sleep'"),
        ({"redundancy": 99}, "policy redundancy: Input should be less than or equal to 8"),
        ({"heartbeat_timeout": -1}, "policy heartbeat_timeout_s.train"),
        ({"heartbeat_timeout": "soon"}, "policy heartbeat_timeout_s.train"),
        ({"min_world": 5, "max_world": 4}, "min_world must not exceed max_world"),
    ],
)
def test_bad_overrides_are_refused_with_a_reason(overrides, message):
    with pytest.raises(PolicyError) as info:
        override_policy(JobPolicy(), overrides)
    assert message in str(info.value)


def test_parse_overrides():
    assert parse_overrides('heartbeat_timeout=7, redundancy=1,x={"a": [1, 2]},s=abc') == {
        "heartbeat_timeout": 7,
        "redundancy": 1,
        "x": {"a": [1, 2]},
        "s": "abc",
    }
    for bad in ("redundancy", "=1", ""):
        with pytest.raises(ReplayError):
            parse_overrides(bad)


def test_parse_until():
    assert parse_until("42") == 42
    assert parse_until("2026-01-01T00:00:05Z") == at(5)
    assert parse_until("2026-01-01T00:00:05") == at(5)  # UTC when no offset is given
    with pytest.raises(ReplayError, match=r"position .* or an ISO 8601 time"):
        parse_until("yesterday")


# --------------------------------------------------------------------------- replay to a point


def test_replay_to_a_position_is_the_view_the_log_had_then():
    log = two_incidents()
    for point in (8, 411, 600, len(log)):
        replayed = replay_log(iter(log), until=point, chunk=50)
        assert replayed.view == fold(None, log[:point])
        assert replayed.events == point and replayed.stopped == (point < len(log))


def test_replay_to_a_time_takes_every_event_recorded_until_then():
    log = two_incidents()
    replayed = replay_log(iter(log), until=at(CRASH_AT_S + 0.5))
    expected = [s for s in log if s.recorded_at <= at(CRASH_AT_S + 0.5)]
    assert replayed.view == fold(None, expected)
    assert replayed.view.state is JobState.RECOVERING


def test_replay_of_a_log_with_several_jobs_needs_a_job():
    log = two_incidents()
    other = [
        s.__class__(len(log) + 1, s.recorded_at, s.event.model_copy(update={"job_id": "other"}))
        for s in log[:1]
    ]
    with pytest.raises(ReplayError, match=r"several jobs .*--job"):
        replay_log(iter(log + other))
    assert replay_log(iter(log + other), job_id="other").view.job_id == "other"
    assert replay_log(iter(log + other), job_id="job-recorded").events == len(log)
    with pytest.raises(ReplayError, match="no event of job 'nope'"):
        replay_log(iter(log), job_id="nope")


# --------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def log_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "log.jsonl"
    with path.open("wb") as out:
        write_log(out, two_incidents())
    return path


def test_replay_command_prints_the_view_as_json(log_file):
    result = CliRunner().invoke(app, ["replay", str(log_file), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["job_id"] == "job-recorded" and out["state"] == "COMPLETED"
    assert out["position"] == len(two_incidents()) and out["events"] == len(two_incidents())
    assert out["world"] == list(fold(None, two_incidents()).world)
    assert {m["member_id"]: m["status"] for m in out["members"]}["w10"] == "failed"
    [crash, hang_] = out["incidents"]
    assert [p["name"] for p in crash["points"]] == [
        "fault", "detected", "decided", "acked", "restored", "first_step",
    ]  # fmt: skip
    assert crash["downtime_s"] == pytest.approx(0.8) and hang_["downtime_s"] == pytest.approx(5.8)


def test_replay_command_until_a_position(log_file):
    # 420: spare0's ack of the first reallocation (after the launchers' five announcements).
    result = CliRunner().invoke(app, ["replay", str(log_file), "--until", "420", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["state"], out["position"], out["stopped_early"]) == ("RECOVERING", 420, True)
    assert [i["outcome"] for i in out["incidents"]] == [None]


def test_replay_command_in_the_terminal(log_file):
    result = CliRunner().invoke(app, ["replay", str(log_file)])
    assert result.exit_code == 0, result.output
    last = two_incidents()[-1].position
    assert f"job-recorded COMPLETED at position {last}" in result.stdout
    assert "first_step" in result.stdout and "downtime 5.800s" in result.stdout


def test_counterfactual_command(log_file):
    args = ["replay", str(log_file), "--policy", "heartbeat_timeout=7", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["overrides"] == {"heartbeat_timeout": 7}
    assert out["policy"]["changed"]["heartbeat_timeout_s"]["counterfactual"]["train"] == 7.0
    crash, hang_ = out["incidents"]
    assert crash["detection_shift_s"] == 0
    assert hang_["policy_detection_shift_s"] == pytest.approx(3.0)
    assert hang_["recorded"]["detected_at"] == at(45).isoformat()
    assert hang_["counterfactual"]["detected_at"] == at(47 + TICK_S).isoformat()
    assert hang_["counterfactual"]["reasons"] == ["heartbeat_timeout"]
    assert hang_["counterfactual"]["decision"].startswith("shrink to 3")
    # A replay until the recorded decider's turn that found the hang (the earlier of the two).
    assert out["counterfactual"]["replay_until"] == at(45).isoformat()
    assert out["redecided"]["replay_until"] == at(44 + TICK_S).isoformat()
    text = CliRunner().invoke(app, args[:-1])
    assert text.exit_code == 0, text.output
    assert "counterfactual" in text.stdout and "+3.000s" in text.stdout
    assert "a replay until 2026-01-01T00:00:45" in " ".join(text.stdout.split())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "heartbeat_timout=7"], "unknown policy key 'heartbeat_timout'"),
        (["--policy", "redundancy"], "expected key=value"),
        (["--until", "soon"], "expected a position"),
        (["--job", "nope"], "no event of job 'nope'"),
    ],
)
def test_replay_command_refuses_bad_input(log_file, args, message):
    result = CliRunner().invoke(app, ["replay", str(log_file), *args])
    assert result.exit_code == 2
    assert message in result.stderr


def test_replay_command_names_the_bad_line(tmp_path):
    lines = io.BytesIO()
    write_log(lines, two_incidents()[:20])
    data = lines.getvalue().splitlines(keepends=True)
    data[11] = data[11].replace(b'"v":1', b'"v":3')
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(data))
    result = CliRunner().invoke(app, ["replay", str(path)])
    assert result.exit_code == 2
    assert f"{path}:12: unknown schema version" in result.stderr
    with path.open("rb") as stream, pytest.raises(ValueError, match=":12: unknown schema"):
        list(read_log(stream, source=str(path)))


def test_replay_command_shows_progress_when_asked(log_file):
    result = CliRunner().invoke(app, ["replay", str(log_file), "--json", "--progress"])
    assert result.exit_code == 0, result.output
    assert "replay" in result.stderr and "100%" in result.stderr
    assert json.loads(result.stdout)["state"] == "COMPLETED"
    quiet = CliRunner().invoke(app, ["replay", str(log_file), "--json"])
    assert quiet.stderr == ""
