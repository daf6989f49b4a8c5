"""The launcher's heartbeat relay: a node's members' heartbeats in one message an interval."""

from __future__ import annotations

import json
import time
from pathlib import Path

from controlplane.core.liveness import Beats
from controlplane.decode import decode_heartbeats
from rank_runtime.client import EventClient
from rank_runtime.identity import Identity
from rank_runtime.relay import HeartbeatRelay
from schemas.common import Phase, Role


def _beat(member: str = "m0", node: str = "n0", incarnation: str = "i0", **over: object) -> bytes:
    body = {
        "job_id": "job1", "type": "member.heartbeat", "v": 1, "source": f"{node}/{member}",
        "incarnation": incarnation, "generation": 2, "emitted_at": "2026-01-01T00:00:00+00:00",
        "payload": {"step": 7, "phase": "train", "step_seconds": 0.5},
    }  # fmt: skip
    body.update(over)
    return json.dumps(body).encode()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_relay_keeps_each_members_latest_beat_and_sends_one_message_per_node() -> None:
    clock = _Clock()
    relay = HeartbeatRelay("unused", "job1", 0.25, lambda node, data: None, clock=clock)
    relay.expect("m0", "n0", "i0")
    relay.expect("m1", "n0", "i1")
    relay.expect("m2", "n1", "i2")
    assert relay.take(_beat("m0", incarnation="i0", payload={"step": 6, "phase": "train"})) is None
    clock.now += 0.1
    assert relay.take(_beat("m0", incarnation="i0")) is None  # the latest one counts
    assert relay.take(_beat("m2", node="n1", incarnation="i2")) is None
    clock.now += 0.15
    sent = relay.flush()
    assert set(sent) == {"n0", "n1"} and all(len(m) == 1 for m in sent.values())
    beats = decode_heartbeats("elastic.hb.job1.n0.launcher", sent["n0"][0])
    assert not isinstance(beats, str)
    assert beats == Beats("job1", "n0", ["m0"], ["i0"], [2], [7], [Phase.TRAIN], [500], [150])
    # m1 was not heard this interval: it is in no message; nothing heard, nothing sent.
    assert relay.flush() == {} and relay.stats.relayed == 2


def test_two_beats_in_one_interval_keep_the_longest_step_either_reported() -> None:
    """Each beat reports the longest step since the member's previous beat: one that lands in
    the same interval as the next must not lose it (a 2 s step reported, then overwritten by
    the next beat's 20 ms, never reached the control plane)."""
    relay = HeartbeatRelay("unused", "job1", 0.25, lambda node, data: None)
    relay.expect("m0", "n0", "i0")
    slow = {"step": 13, "phase": "train", "step_seconds": 2.0, "compute_seconds": 0.01}
    fast = {"step": 14, "phase": "train", "step_seconds": 0.02}
    assert relay.take(_beat(payload=slow)) is None
    assert relay.take(_beat(payload=fast)) is None
    beats = decode_heartbeats("elastic.hb.job1.n0.launcher", relay.flush()["n0"][0])
    assert not isinstance(beats, str)
    assert (beats.step, beats.step_ms, beats.compute_ms) == ([14], [2000], [10])
    # The next interval starts afresh; a beat of a newer generation does not inherit either.
    assert relay.take(_beat(payload=slow)) is None
    assert relay.take(_beat(generation=3, payload=fast)) is None
    beats = decode_heartbeats("elastic.hb.job1.n0.launcher", relay.flush()["n0"][0])
    assert not isinstance(beats, str)
    assert (beats.generation, beats.step_ms, beats.compute_ms) == ([3], [20], None)


def test_the_relay_takes_only_the_processes_its_launcher_started() -> None:
    relay = HeartbeatRelay("unused", "job1", 0.25, lambda node, data: None)
    relay.expect("m0", "n0", "i0")
    refused = {
        b"\xff": "schema violation",
        _beat(extra=1): "schema violation",
        _beat(job_id="job2"): "not a member this launcher started",
        _beat("m9"): "not a member this launcher started",
        _beat(node="n1"): "not a member this launcher started",
        _beat(incarnation="old"): "stale_incarnation",
    }
    for data, reason in refused.items():
        got = relay.take(data)
        assert got is not None and got.startswith(reason), (data, got)
    relay.expect("m0", "n0", "i9")  # a new process of the name: the old one's beats stop
    assert relay.take(_beat(incarnation="i0")) == "stale_incarnation: i0 of n0/m0"
    assert relay.flush() == {}
    assert sum(relay.stats.refused.values()) == 7


def test_a_member_beats_through_its_launchers_socket(tmp_path: Path) -> None:
    path = HeartbeatRelay.usable_path(str(tmp_path))
    assert path is not None
    sent: list[tuple[str, bytes]] = []
    relay = HeartbeatRelay(path, "job1", 0.05, lambda node, data: sent.append((node, data)))
    relay.expect("m0", "n0", "inc0")
    relay.start()
    identity = Identity(
        "job1", "n0", "r0", "m0", Role.WORKER, "nats://127.0.0.1:1", incarnation="inc0",
        heartbeat_relay=path,
    )  # fmt: skip
    client = EventClient(identity, commands=False, command_key=None)  # never started: no NATS
    try:
        client.finished_step(4, 0.3)
        client.heartbeat()
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        relay.close()
        client.close(flush_s=0)
    assert client.stats.heartbeats == 1 and client.stats.heartbeats_dropped == 0
    node, data = sent[0]
    beats = decode_heartbeats("elastic.hb.job1.n0.launcher", data)
    assert node == "n0" and not isinstance(beats, str)
    assert (beats.members, beats.incarnation, beats.step, beats.step_ms) == (
        ["m0"], ["inc0"], [4], [300])  # fmt: skip
    assert not Path(path).exists()  # the socket is removed with the relay


def test_a_socket_path_too_long_to_bind_is_no_relay() -> None:
    assert HeartbeatRelay.usable_path("/tmp/" + "d" * 120) is None
