"""A member fences itself between steps (issue 21): a newer generation decided while it trained
ends the old one at the step's end, whether or not a launcher's fence ever lands."""

from __future__ import annotations

import json
import math
import time
import uuid

import pytest

from rank_runtime.elastic import (
    Elastic,
    GenerationSuperseded,
    JobStoppedError,
    LossAnomaly,
    World,
    _Superseded,
)
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


def _formation_fails(
    monkeypatch: pytest.MonkeyPatch, elastic: Elastic, command: Reallocate
) -> None:
    """The generation's rendezvous is a real torch store every other rank already reached;
    ``init_process_group`` then fails as gloo's does when a peer closes its connection midway
    (a replacement that refused its copy and left)."""
    import torch.distributed as dist

    from rank_runtime import rendezvous

    store = dist.HashStore()  # type: ignore[attr-defined]
    for rank, name in enumerate(command.world):
        if name != elastic.identity.member:
            store.set(f"arrived/{rank}", name)

    def connect(*args: object, **kwargs: object) -> object:
        return store

    def init_process_group(*args: object, **kwargs: object) -> None:
        # What torch does before the backend fails: name the default group by its count.
        from torch.distributed import distributed_c10d

        distributed_c10d._process_group_name([], use_hashed_name=False)
        raise RuntimeError(
            "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer"
        )

    monkeypatch.setattr(rendezvous.RendezvousStore, "connect", connect)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)


def _faults(elastic: Elastic) -> list[dict[str, object]]:
    events = [json.loads(body) for _, _, body in elastic.client._buffer]
    return [e for e in events if e["type"] == "member.fault"]


def test_a_group_that_fails_to_form_is_a_reported_fault_and_the_next_decision_is_followed(
    monkeypatch: pytest.MonkeyPatch,
):
    import torch.distributed as dist

    elastic = member()
    failing = reallocate(2, ["w0", "w1", "s0"])
    _formation_fails(monkeypatch, elastic, failing)
    newer = reallocate(3, ["w0", "w1", "w2"])
    elastic.client._commands.put(newer)
    with pytest.raises(_Superseded) as raised:
        elastic._form(failing)
    assert raised.value.command is newer  # followed, not raised out of the loop
    # The failed group is forgotten: the next one is named as the peers' is (their keys meet).
    assert dist.get_pg_count() == 0
    [fault] = _faults(elastic)
    assert fault["generation"] == 2  # the generation it failed in, not the one before
    assert fault["payload"]["kind"] == "collective_error"
    assert fault["payload"]["step"] == 20
    assert "forming generation 2" in fault["payload"]["detail"]
    assert "Connection closed by peer" in fault["payload"]["detail"]


def test_a_group_that_fails_to_form_ends_the_member_when_the_job_stops(
    monkeypatch: pytest.MonkeyPatch,
):
    elastic = member()
    failing = reallocate(2, ["w0", "w1", "s0"])
    _formation_fails(monkeypatch, elastic, failing)
    stop = Stop(command_id=uuid.uuid4(), job_id="job1", decision_position=2, issued_at=T0,
                reason="no complete copy")  # fmt: skip
    elastic.client._commands.put(stop)
    with pytest.raises(JobStoppedError, match="no complete copy"):
        elastic._form(failing)
    assert len(_faults(elastic)) == 1


def test_a_rank_that_must_leave_a_generation_it_formed_waits_until_every_rank_formed_it():
    """A replacement that refuses its copy leaves the group it just formed: not before the
    slower ranks formed it too (they would fail in ``init_process_group``, or wait in it
    deaf to the next decision), unless that decision comes first."""
    from datetime import timedelta

    import torch.distributed as dist

    elastic = member()
    elastic._form_timeout = timedelta(seconds=0.3)
    store = elastic._rendezvous_store = dist.HashStore()  # type: ignore[attr-defined]
    current = reallocate(1, ["w0", "w1", "w2"])
    store.set("formed/0", "w0")
    # w2 has not formed it: no newer decision either, so it waits, then leaves anyway.
    started = time.monotonic()
    assert elastic._await_formed(current) is None
    assert time.monotonic() - started >= 0.3
    assert store.get("formed/1") == b"w1"  # its own mark, for the others
    # A newer decision ends the wait, and is the one to follow.
    newer = reallocate(2, ["w0", "w1", "s0"])
    elastic.client._commands.put(newer)
    assert elastic._await_formed(current) is newer
    # Everyone formed it: no wait.
    store.set("formed/2", "w2")
    started = time.monotonic()
    assert elastic._await_formed(current) is None
    assert time.monotonic() - started < 0.3


def _published(elastic: Elastic) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(body) for _, _, body in elastic.client._buffer]


def test_a_non_finite_step_is_reported_not_recorded_nor_backed_up():
    elastic = member("w0")
    elastic.world = World(1, 0, 3, ("w0", "w1", "w2"), (), {}, "tcp://rdzv/job1/1")
    taken = []
    with pytest.raises(LossAnomaly) as raised:
        elastic.step_done(10, loss=float("nan"), samples=8, state=lambda: taken.append(1))
    assert isinstance(raised.value, RuntimeError) and raised.value.step == 10
    assert [(e["type"], e["payload"]) for e in _published(elastic)] == [
        ("train.anomaly", {"step": 10, "kind": "non_finite_loss", "detail": "loss=nan"})
    ]
    assert taken == []  # the spoiled step is no backup
    with pytest.raises(LossAnomaly, match="grad_norm=inf"):
        elastic.step_done(11, loss=0.5, samples=8, grad_norm=float("inf"))


def test_an_injected_nan_spoils_the_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_FAULTS", "nan@4:rank=1")
    monkeypatch.setenv("ELASTIC_FAULTS_STATE", str(tmp_path))
    elastic = member("w1")
    spoiled = []
    elastic.poison = spoiled.append
    elastic.step_done(3, loss=0.5, samples=8)
    with pytest.raises(LossAnomaly):
        elastic.step_done(4, loss=0.5, samples=8)
    assert len(spoiled) == 1 and math.isnan(spoiled[0])
    elastic.step_done(4, loss=0.5, samples=8)  # the step replayed after the rollback is clean


def test_an_injected_spike_multiplies_the_parameters_once_after_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_FAULTS", "spike@4:rank=1:10")
    monkeypatch.setenv("ELASTIC_FAULTS_STATE", str(tmp_path))
    elastic = member("w1")
    spoiled: list[float] = []
    elastic.poison = spoiled.append
    elastic.step_done(3, loss=0.5, samples=8)
    assert spoiled == []
    elastic.step_done(4, loss=0.5, samples=8)  # reported as it was: the next steps show it
    assert spoiled == [10.0]
    elastic.step_done(4, loss=0.5, samples=8)  # the step replayed after the rollback is clean
    assert spoiled == [10.0]


def test_a_rollback_tells_the_member_which_steps_to_skip():
    elastic = member()
    command = reallocate(2, ["w0", "w1", "w2"]).model_copy(
        update={
            "mode": ReallocationMode.ROLLBACK,
            "skip": [(24, 24), (30, 32)],
            "restore_from": RestoreFrom.INITIAL,
        }
    )
    elastic._form = lambda command: None  # type: ignore[method-assign]
    elastic.defer_restore = True
    elastic._rejoin(command)
    assert elastic.resume_step == 20
    assert [s for s in range(20, 35) if elastic.skips(s)] == [24, 30, 31, 32]


# --------------------------------------------------------------------------- another process


def fresh(name: str = "w1", role: Role = Role.WORKER) -> Elastic:
    """A process of ``name`` that has just started (no rank yet), with its own incarnation."""
    elastic = Elastic(
        Identity("job1", "n0", "r0", name, role, "nats://127.0.0.1:1", incarnation="b" * 16),
        policy=JobPolicy(),
    )
    return elastic


def naming(generation: int, world: list[str], incarnations: list[str]) -> Reallocate:
    return reallocate(generation, world).model_copy(update={"incarnations": incarnations})


def test_a_generation_of_an_earlier_process_of_the_name_is_not_this_ones():
    """A launcher restarted with its pod starts a process under the old name; the command in
    force names its dead predecessor (incarnation a...): the new process waits as a spare,
    and takes the generation that names its own incarnation."""
    elastic = fresh()
    earlier = naming(2, ["w0", "w1", "w2"], ["x" * 16, "a" * 16, "y" * 16])
    own = naming(3, ["w0", "w1", "w2"], ["x" * 16, "b" * 16, "y" * 16])
    assert elastic._judge(earlier, 0) is None
    assert elastic.successor and elastic._waits_as_spare()  # it waits as long as the job runs
    assert elastic._judge(own, 0) is own
    # An older control plane that names no incarnations: the name is enough, as before.
    assert fresh()._judge(reallocate(2, ["w0", "w1", "w2"]), 0) is not None


def test_a_member_with_a_rank_named_by_another_process_stops():
    """The job went on with another process of this name: this one is fenced."""
    elastic = member()
    elastic.client.incarnation = "b" * 16
    elastic.client._commands.put(naming(2, ["w0", "w1", "w2"], ["x" * 16, "c" * 16, "y" * 16]))
    with pytest.raises(JobStoppedError, match="for another process of w1"):
        elastic._superseded(1)
