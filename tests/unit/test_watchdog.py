"""A step blocked in its collectives (issue 27): the member probes its peers' hosts while it
waits and names those that do not answer (``Elastic._watch``), and a newer generation decided
meanwhile ends the group's connections, releasing the step (``Elastic._on_command``). A host
cut from its peers is then found, and its peers go on, in seconds rather than at the
collective timeout."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from rank_runtime.elastic import RELEASE_GRACE_S, Elastic, World
from rank_runtime.group import GroupSockets
from rank_runtime.identity import Identity
from schemas.commands import Reallocate
from schemas.common import FaultKind, Phase, ReallocationMode, RestoreFrom, Role
from schemas.events import JobPolicy
from tests.factories import T0


def member(probe_s: float = 2.0) -> Elastic:
    """w1, a member of generation 1 (w0, w1, w2) training, as ``start`` leaves it; no I/O."""
    elastic = Elastic(
        Identity("job1", "n1", "r0", "w1", Role.WORKER, "nats://127.0.0.1:1"),
        policy=JobPolicy(collective_probe_s=probe_s),
    )
    elastic.world = World(1, 1, 3, ("w0", "w1", "w2"), (), {}, "tcp://rdzv/job1/1")
    elastic.client.phase = Phase.TRAIN
    return elastic


def reallocate(generation: int) -> Reallocate:
    return Reallocate(
        command_id=uuid.uuid4(), job_id="job1", decision_position=1, issued_at=T0,
        generation=generation, world=["w0", "w1", "s0"], rendezvous="tcp://rdzv/job1/2",
        incident_id=uuid.uuid4(), mode=ReallocationMode.REPLACE, restore_step=20,
        restore_from=RestoreFrom.MEMORY, plan=["w0", "w1", "s0"],
    )  # fmt: skip


def arrives(elastic: Elastic, command: Reallocate) -> None:
    """``command`` as the client takes it from its subscription."""
    elastic.client._take_command("elastic.cmd.job1", command.model_dump_json().encode(), None)


def faults(elastic: Elastic) -> list[dict[str, Any]]:
    """The ``member.fault`` events the member published (still in its client's buffer)."""
    events = [json.loads(data) for _, _, data in list(elastic.client._buffer)]
    return [e["payload"] for e in events if e["type"] == "member.fault"]


@contextmanager
def connection(elastic: Elastic) -> Iterator[socket.socket]:
    """A TCP connection whose near end the member's group recorded; yields the near end, as
    gloo's loop reads it (its end, once ended, is what fails gloo's pair and closes it)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        opened = GroupSockets({})
        with opened.recording():
            near = socket.create_connection(server.getsockname())
        far, _ = server.accept()
    elastic.group_sockets = opened
    try:
        yield near
    finally:
        near.close()
        far.close()


def ended(near: socket.socket) -> bool:
    """Whether the connection's near end reads its end now (ended), without waiting."""
    near.settimeout(0)
    try:
        return near.recv(1) == b""
    except BlockingIOError:
        return False


def test_the_client_tells_which_step_is_open():
    client = member().client
    assert client.open_step() is None  # none began
    client.step_began(7)
    began = client.open_step()
    assert began is not None and began.ready is None and began.step == 7
    client.gradients_ready()
    opened = client.open_step()
    assert opened is not None and opened.ready is not None and opened.began == began.began
    client.phase = Phase.BACKUP
    assert client.open_step() is None  # only in phase train
    client.phase = Phase.TRAIN
    client.finished_step(7, 0.5)
    assert client.open_step() is None
    client.step_began(8)
    opened = client.open_step()
    assert opened is not None and opened.longest == 0.5  # the longest recent step
    client.finished_step(8, 0.1)
    client.step_began(9)
    opened = client.open_step()
    assert opened is not None and 0.4 < opened.longest < 0.5  # remembered, decaying
    client.step_abandoned()
    assert client.open_step() is None


def test_a_newer_generation_decided_during_a_step_past_its_course_ends_the_connections():
    """The step has run longer than twice the longest recent step (and the grace): it waits
    on a peer, and the decision releases it at once."""
    elastic = member()
    with connection(elastic) as near:
        elastic.client.finished_step(6, 0.05)
        elastic.client.step_began(7)
        time.sleep(RELEASE_GRACE_S + 0.05)
        arrives(elastic, reallocate(2))
        assert ended(near)  # at once: gloo's loop reads the end and fails what waits
    assert elastic.client.newest_generation == 2
    assert elastic.client.next_command() is not None  # queued all the same, to be followed


def test_a_step_still_running_its_course_is_released_only_at_its_end():
    elastic = member()
    with connection(elastic) as near:
        elastic.client.step_began(7)
        began = time.monotonic()
        arrives(elastic, reallocate(2))
        assert not ended(near)  # left to end on its own
        while not ended(near) and time.monotonic() - began < 5:
            time.sleep(0.01)
        waited = time.monotonic() - began
        assert RELEASE_GRACE_S - 0.01 <= waited < 5  # still open at the end of its course


@pytest.mark.parametrize("case", ["between steps", "same generation", "ended in its course"])
def test_the_connections_stay_when_no_step_waits_or_nothing_newer_is_decided(case: str):
    elastic = member()
    with connection(elastic) as near:
        elastic.client.step_began(7)
        if case == "between steps":
            elastic.client.finished_step(7, 0.1)
            arrives(elastic, reallocate(2))
        elif case == "same generation":
            arrives(elastic, reallocate(1))
        else:  # the step ends before its course is run: the member leaves between steps
            arrives(elastic, reallocate(2))
            elastic.client.finished_step(7, 0.1)
        time.sleep(RELEASE_GRACE_S + 0.1)
        assert not ended(near)  # still open: nothing ended


@contextmanager
def watching(elastic: Elastic) -> Iterator[None]:
    thread = threading.Thread(target=elastic._watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        elastic._closing.set()
        thread.join(5)


@dataclass
class Probes:
    """The members whose hosts do not answer, and how many probes were made."""

    down: list[str] = field(default_factory=lambda: ["w0"])
    made: int = 0


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> Probes:
    """The probe of peers' hosts (``replication.unreachable``, tested with real sockets in
    ``test_replication``): w0's host does not answer, unless the test empties ``down``."""
    probes = Probes()

    def probe(endpoints: dict[str, str], own: str) -> list[str]:
        assert own == "w1" and set(endpoints) == {"w0", "w1", "w2"}
        probes.made += 1
        return list(probes.down)

    monkeypatch.setattr("rank_runtime.elastic.unreachable", probe)
    return probes


def _until(condition: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_member_waiting_in_a_step_names_the_peers_whose_hosts_do_not_answer(probes):
    elastic = member(probe_s=0.2)
    with watching(elastic):
        elastic.client.step_began(7)
        elastic.client.gradients_ready()  # from here it only waits for its peers
        assert _until(lambda: faults(elastic), 10), "no report"
        time.sleep(1.0)  # probed again (after 0.4 s): still one report a step
    (report,) = faults(elastic)
    assert report["kind"] == FaultKind.COLLECTIVE_ERROR.value
    assert report["suspects"] == ["w0"] and report["step"] == 7
    assert "collectives" in report["detail"] and "w0" in report["detail"]
    assert probes.made >= 1


def test_nothing_is_probed_while_steps_go_on(probes):
    elastic = member(probe_s=0.3)
    with watching(elastic):
        for step in range(1, 8):  # steps shorter than the probe's wait
            elastic.client.step_began(step)
            elastic.client.gradients_ready()
            time.sleep(0.1)
            elastic.client.finished_step(step, 0.1)
    assert faults(elastic) == [] and probes.made == 0


def test_nothing_is_reported_when_every_host_answers(probes):
    probes.down.clear()  # a slow peer, not a cut one: the stall detector's to find
    elastic = member(probe_s=0.2)
    with watching(elastic):
        elastic.client.step_began(1)
        elastic.client.gradients_ready()
        time.sleep(1.0)
    assert faults(elastic) == []
    assert 2 <= probes.made <= 3  # at 0.2 s, 0.4 s, 0.8 s: twice the wait each time


def test_without_gradient_evidence_the_wait_counts_past_twice_the_longest_step(probes):
    elastic = member(probe_s=0.2)
    elastic.client.finished_step(6, 0.4)  # a step of 0.4 s: nothing before 0.8 + 0.2 s
    with watching(elastic):
        elastic.client.step_began(7)
        time.sleep(0.6)
        assert faults(elastic) == []
        assert _until(lambda: faults(elastic), 10), "no report"
