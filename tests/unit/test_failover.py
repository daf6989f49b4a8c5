"""Where a NATS connection goes when it leaves a server (``schemas.nats.Failover``)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from schemas.nats import Failover


@dataclass
class Server:
    uri: object


SERVERS = [Server(urlparse(f"nats://10.0.0.{i}:4222")) for i in range(3)]


def test_after_leaving_a_server_every_other_one_comes_first_then_any():
    failover = Failover(wait_s=0.25)
    failover.leave(SERVERS[1].uri)  # type: ignore[arg-type]
    picks = [failover(SERVERS, {}) for _ in range(2)]
    assert {p.uri.netloc for p, _ in picks} <= {"10.0.0.0:4222", "10.0.0.2:4222"}
    assert [delay for _, delay in picks] == [0.0, 0.25]  # at once, then nats-py's wait
    # Each other one tried: the one left is a choice again (it may be the only one up).
    seen = {failover(SERVERS, {})[0].uri.netloc for _ in range(200)}
    assert "10.0.0.1:4222" in seen


def test_a_server_that_went_away_by_itself_leaves_every_server_a_choice():
    failover = Failover()
    seen = {failover(SERVERS, {})[0].uri.netloc for _ in range(200)}
    assert seen == {s.uri.netloc for s in SERVERS}  # type: ignore[attr-defined]
    failover.leave(SERVERS[0].uri)  # type: ignore[arg-type]
    failover.connected()  # it reconnected: the next reconnection starts afresh
    assert failover(SERVERS, {})[1] == 0.0


class _Nats:
    """What ``EventClient._check_beacon`` asks of a connection."""

    def __init__(self) -> None:
        self.servers = [s.uri for s in SERVERS]
        self.connected_url = SERVERS[0].uri
        self.is_connected = True
        self.moves = 0

    async def force_reconnect(self) -> None:
        self.moves += 1


async def test_a_member_leaves_a_server_the_beacon_stopped_on_then_again_every_few_seconds(
    monkeypatch,
):
    """No beacon before one was heard: nothing moves (the control plane not up yet, or
    credentials without it). Once heard and then missing for 2 s, the connection leaves its
    server, then again every 2 to 4 s (drawn) while none comes: the control plane may be
    away, and when it is back, a connection on a server cut off meanwhile must reach it
    before silences are judged again. A beacon heard starts over."""
    import random
    import time

    from controlplane.bus import EVENTS_SETTLE_S
    from rank_runtime import client as client_module
    from rank_runtime.client import BEACON_RETRY_S, EventClient
    from rank_runtime.identity import Identity
    from schemas.common import Role
    from schemas.events import JobPolicy

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    drawn: list[tuple[float, float]] = []
    monkeypatch.setattr(random, "uniform", lambda lo, hi: drawn.append((lo, hi)) or hi)
    identity = Identity("job1", "n0", "r0", "w0", Role.WORKER, "nats://unused:1")
    member = EventClient(identity, commands=False)
    nc = _Nats()

    async def after(seconds: float) -> int:
        clock[0] += seconds
        await member._check_beacon(nc)  # type: ignore[arg-type]
        return nc.moves

    await member._follow_beacon(_Subscribing(member))  # type: ignore[arg-type]
    assert await after(10.0) == 0  # never heard: nothing follows
    await _Subscribing.beacon(member)
    assert await after(1.9) == 0
    assert await after(0.2) == 1  # 2 s without one: leave
    assert await after(3.9) == 1
    assert await after(0.2) == 2  # then every 2 to 4 s (here the longest drawn)
    assert await after(4.1) == 3
    assert await after(60.0) == 4  # however long the control plane is away
    assert drawn == [BEACON_RETRY_S] * 4
    await _Subscribing.beacon(member)  # heard again: as at first
    assert await after(2.1) == 5
    assert client_module.BEACON_TIMEOUT_S == 2.0
    # The longest wait, a reconnection and a heartbeat interval of the default policy fit in
    # the control plane's settling after its stream answers (and its beacon resumes) again.
    assert BEACON_RETRY_S[1] + 0.5 + JobPolicy().heartbeat_interval_s < EVENTS_SETTLE_S


class _Subscribing:
    """A connection that only takes the beacon's subscription; ``beacon`` delivers one."""

    callbacks: dict[int, object] = {}

    def __init__(self, member: object) -> None:
        self._member = member

    async def subscribe(self, subject: str, cb: object) -> None:
        _Subscribing.callbacks[id(self._member)] = cb

    @staticmethod
    async def beacon(member: object) -> None:
        await _Subscribing.callbacks[id(member)](None)  # type: ignore[operator]


def test_a_leader_counts_as_answering_only_while_it_hears_a_majority_of_its_group():
    """A consumer's leader on a server cut off from the cluster still answers pull requests;
    whom it heard lately (its info's replicas, ``active`` in nanoseconds) tells."""
    from nats.js.api import ClusterInfo, PeerInfo

    from controlplane.bus import QUORUM_ACTIVE_S, has_quorum

    def peer(active_s: float | None, offline: bool = False) -> PeerInfo:
        ns = None if active_s is None else int(active_s * 1e9)
        return PeerInfo(name="n", current=True, offline=offline, active=ns)

    lately, long_ago = QUORUM_ACTIVE_S / 3, QUORUM_ACTIVE_S * 4
    assert has_quorum(None) and has_quorum(ClusterInfo(leader="n0", replicas=None))
    assert has_quorum(ClusterInfo(leader="n0", replicas=[]))  # a group of one
    assert has_quorum(ClusterInfo(leader="n0", replicas=[peer(lately), peer(lately)]))
    assert has_quorum(ClusterInfo(leader="n0", replicas=[peer(lately), peer(long_ago)]))
    assert not has_quorum(ClusterInfo(leader="n0", replicas=[peer(long_ago), peer(long_ago)]))
    assert not has_quorum(ClusterInfo(leader="n0", replicas=[peer(lately, True), peer(None)]))
    five = [peer(lately), peer(long_ago), peer(long_ago), peer(long_ago)]
    assert not has_quorum(ClusterInfo(leader="n0", replicas=five))
    assert has_quorum(ClusterInfo(leader="n0", replicas=[peer(lately), *five[:3]]))
