"""A member fences itself between steps (issue 21): a newer generation decided while it trained
ends the old one at the step's end, whether or not a launcher's fence ever lands."""

from __future__ import annotations

import uuid

import pytest

from rank_runtime.elastic import Elastic, GenerationSuperseded, JobStoppedError, World
from rank_runtime.identity import Identity
from schemas.commands import Reallocate, Stop
from schemas.common import ReallocationMode, RestoreFrom, Role
from schemas.events import JobPolicy
from tests.factories import T0


def member(name: str = "w1") -> Elastic:
    """A member of generation 1 (w0, w1, w2), as ``start`` leaves it; no I/O."""
    elastic = Elastic(
        Identity("job1", "n0", "r0", name, Role.WORKER, "nats://127.0.0.1:1"), policy=JobPolicy()
    )
    elastic.world = World(1, 1, 3, ("w0", "w1", "w2"), (), {}, "tcp://rdzv/job1/1")
    return elastic


def reallocate(generation: int, world: list[str]) -> Reallocate:
    return Reallocate(
        command_id=uuid.uuid4(),
        job_id="job1",
        decision_position=1,
        issued_at=T0,
        generation=generation,
        world=world,
        rendezvous=f"tcp://rdzv/job1/{generation}",
        incident_id=uuid.uuid4(),
        mode=ReallocationMode.REPLACE,
        restore_step=20,
        restore_from=RestoreFrom.MEMORY,
        plan=world,
    )


def test_a_newer_generation_naming_the_member_ends_the_step_and_recover_follows_it():
    elastic = member()
    newer = reallocate(2, ["w0", "w1", "s0"])
    elastic.client._commands.put(newer)
    with pytest.raises(GenerationSuperseded) as raised:
        elastic._superseded(1)
    assert raised.value.command is newer
    assert isinstance(raised.value, RuntimeError)  # the training loop's ``except`` takes it
    # ``recover`` waits for the world it is to join: the command found between steps.
    assert elastic._wait_for_world(0.01) is newer
    elastic._superseded(1)  # consumed: nothing pending any more


def test_a_newer_generation_without_the_member_ends_it():
    elastic = member("w2")
    elastic.client._commands.put(reallocate(2, ["w0", "w1", "s0"]))
    with pytest.raises(JobStoppedError, match="generation 2 goes on without w2"):
        elastic._superseded(1)


def test_a_stop_ends_it():
    elastic = member()
    stop = Stop(command_id=uuid.uuid4(), job_id="job1", decision_position=1, issued_at=T0,
                reason="no complete copy")  # fmt: skip
    elastic.client._commands.put(stop)
    with pytest.raises(JobStoppedError, match="no complete copy"):
        elastic._superseded(1)


def test_nothing_new_lets_it_train_on_without_waiting():
    elastic = member()
    elastic._superseded(1)  # no command: returns at once
    elastic.client._commands.put(reallocate(1, ["w0", "w1", "w2"]))  # its own, re-sent
    elastic._superseded(1)
    assert elastic.client.next_command() is None
