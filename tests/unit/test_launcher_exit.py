"""The launcher's exit status is the job's outcome (``rank_runtime.launcher.exit_code``), and the
control plane's ``Stop`` says what that outcome is."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime

import pytest

from controlplane.core.commands import owed
from rank_runtime import launcher
from rank_runtime.launcher import (
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_NO_CONTROL_PLANE,
    LaunchResult,
    Running,
    Slot,
    exit_code,
)
from schemas.commands import COMMAND_ADAPTER, JobOutcome, Reallocate, Stop
from schemas.common import JobState, ReallocationMode, RestoreFrom, Role
from tests.unit.test_decide import crash_w01, running

T = datetime(2026, 1, 1, tzinfo=UTC)


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    ("outcome", "failed", "heard", "sig", "code"),
    [
        # A completed job is 0 whatever its members went through, even a signal at the end.
        ("completed", [], True, None, EXIT_COMPLETED),
        ("completed", ["w0"], True, None, EXIT_COMPLETED),
        ("completed", ["w0"], True, signal.SIGTERM, EXIT_COMPLETED),
        # Stopped by the scheduler (preempted, evicted, scancel): 128 + N, retryable.
        (None, [], True, signal.SIGTERM, 128 + signal.SIGTERM),
        ("stopped", ["w0"], True, signal.SIGINT, 128 + signal.SIGINT),
        # The job could not go on: 1, whatever this node's members did.
        ("stopped", [], True, None, EXIT_FAILED),
        ("stopped", ["w0"], True, None, EXIT_FAILED),
        # No word on the end: this node's members decide.
        (None, [], True, None, EXIT_COMPLETED),
        (None, [], False, None, EXIT_COMPLETED),
        (None, ["w0"], True, None, EXIT_FAILED),
        (None, ["w0"], False, None, EXIT_NO_CONTROL_PLANE),
    ],
)
def test_the_exit_status_is_the_jobs_outcome(outcome, failed, heard, sig, code):
    assert exit_code(outcome=outcome, failed=failed, heard=heard, signal=sig) == code


def test_a_member_replaced_or_killed_by_the_launcher_does_not_fail_it():
    result = LaunchResult(
        "j",
        exits={"w0": -9, "w1": 0, "w2": 1, "w3": -9, "s0": 0, "s1": 0},
        killed=["w3"],  # fenced, or a random fault
        replaced=["w0", "w3"],
        heard=True,
    )
    assert result.failed == ["w2"]  # crashed, and no generation went on without it
    assert result.code == EXIT_FAILED and not result.ok
    result.replaced.append("w2")  # the world shrank without it
    assert result.failed == [] and result.code == 0 and result.ok
    # A spare that crashed before it ever had a rank was not replaced: it failed.
    crashed_spare = LaunchResult("j", exits={"w0": 0, "s0": -9}, heard=True)
    assert crashed_spare.failed == ["s0"] and crashed_spare.code == EXIT_FAILED
    assert LaunchResult("j", exits={"w0": 1}, outcome="completed").code == 0


# --------------------------------------------------------------------------- following commands


class _Watcher:
    """The launcher's command subscription, played back."""

    def __init__(self, *commands: object) -> None:
        self.commands = list(commands)

    def next_command(self, timeout: float | None = None) -> object:
        return self.commands.pop(0) if self.commands else None


def _reallocate(generation: int, world: list[str]) -> Reallocate:
    return Reallocate.model_construct(
        command_id=uuid.uuid4(), job_id="j", decision_position=generation, issued_at=T,
        incident_id=uuid.uuid4(), generation=generation, mode=ReallocationMode.REPLACE,
        world=world, restore_step=20, restore_from=RestoreFrom.MEMORY, plan=world, digests=[], placement=[],
        rendezvous="h:1", endpoints={},
    )  # fmt: skip


def _stop(outcome: JobOutcome | None) -> Stop:
    return Stop(command_id=uuid.uuid4(), job_id="j", decision_position=9, issued_at=T,
                reason="training completed", outcome=outcome)  # fmt: skip


def _member(name: str) -> Running:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return Running(Slot(name, "node0", "rack0", Role.WORKER), process, None)  # type: ignore[arg-type]


def test_members_left_out_of_the_newest_generation_are_replaced_and_the_stop_says_the_end():
    members = [_member(m) for m in ("w0", "w1", "w2", "w3", "s0", "s1")]
    followed = launcher._Followed()
    watcher = _Watcher(
        _reallocate(1, ["w0", "w1", "w2", "w3"]),
        _reallocate(2, ["s0", "w1", "w2", "s1"]),
        _stop("completed"),
    )
    launcher._follow(watcher, members, followed, fence=True)  # type: ignore[arg-type]
    assert followed.heard and followed.outcome == "completed"
    assert [m for m in ("w0", "w1", "w2", "w3", "s0", "s1") if followed.replaced(m)] == [
        "w0",
        "w3",
    ]
    assert not any(m.killed_by_launcher for m in members)  # they had exited: nothing to fence
    # A Stop that does not say (an older control plane) leaves the outcome unknown.
    older = launcher._Followed()
    launcher._follow(_Watcher(_stop(None)), members, older, fence=True)  # type: ignore[arg-type]
    assert older.heard and older.outcome is None


def test_a_member_demoted_to_a_spare_is_not_fenced_and_one_left_out_is():
    running = {m: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
               for m in ("w0", "w1", "w2", "w3")}  # fmt: skip
    members = [Running(Slot(m, "node0", "rack0", Role.WORKER), p, None)  # type: ignore[arg-type]
               for m, p in running.items()]  # fmt: skip
    followed = launcher._Followed()
    # w2 failed; w3, the survivor of its replica, becomes a spare.
    shrink = _reallocate(2, ["w0", "w1"]).model_copy(update={"demoted": ["w3"]})
    try:
        launcher._follow(_Watcher(_reallocate(1, ["w0", "w1", "w2", "w3"]), shrink), members,
                         followed, fence=True)  # type: ignore[arg-type]  # fmt: skip
        by_name = {m.slot.member: m for m in members}
        assert by_name["w2"].killed_by_launcher  # left out: fenced
        assert by_name["w2"].fenced_by == 2  # for generation 2: its exit will say so
        assert not by_name["w3"].killed_by_launcher and running["w3"].poll() is None
        assert by_name["w3"].fenced_by is None
    finally:
        for p in running.values():
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- the control plane


def test_the_stop_of_a_completed_job_says_completed():
    s = running(1)
    s.at(2)
    s.add(s.ev.make("train.completed", {"step": 100}, source=s._src("w00"), generation=1))
    s.decide()
    assert s.v.state is JobState.COMPLETED
    [command] = owed(s.v)  # the spare and the other ranks are still alive
    assert isinstance(command, Stop) and command.outcome == "completed"
    assert COMMAND_ADAPTER.validate_json(command.model_dump_json()) == command


def test_the_stop_of_a_stopped_job_says_stopped():
    s, _ = crash_w01(spares=0, min_world=4)
    assert s.v.state is JobState.STOPPED
    [command] = owed(s.v)
    assert isinstance(command, Stop) and command.outcome == "stopped"


def test_a_stop_without_an_outcome_still_parses():
    raw = (
        '{"kind":"stop","command_id":"8f0e4b8a-3b1c-4d2e-9f00-000000000001","job_id":"j",'
        '"decision_position":1,"issued_at":"2026-01-01T00:00:00Z","reason":"no spare left"}'
    )
    command = COMMAND_ADAPTER.validate_json(raw)
    assert isinstance(command, Stop) and command.outcome is None
