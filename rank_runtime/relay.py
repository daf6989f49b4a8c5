"""A node's heartbeats in one message: the launcher relays what its members send it.

A member started by the launcher sends each heartbeat as a datagram to the launcher's Unix
socket (``ELASTIC_HEARTBEAT_RELAY``, in a directory only the launcher's user can enter) rather
than to NATS. The launcher keeps each member's latest heartbeat (with the longest step of any
it replaced) and, once an interval, sends the node's as one ``node.heartbeat`` on its own
subject ``elastic.hb.<job>.<node>.launcher``: the control plane receives one message per node
and interval instead of one per rank (eight times fewer at eight ranks a node), and hears each
beat at the time the launcher heard it (the message says how long before sending: ``age_s``).
A member the launcher did not hear from over an interval is not in that interval's message,
so a hung member falls silent at the control plane as it would beating on its own; a dead
launcher silences its node.

The launcher relays only for the processes it started: a datagram is taken when it is a
valid heartbeat of this job, from a member of the node the launcher started, naming the
incarnation the launcher gave that process; anything else is counted and dropped. The
control plane binds the message to the launcher's identity (its credentials may publish only
that subject), and takes each beat only for a member that joined on that node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import ValidationError

from schemas.common import MAX_EVENT_BYTES
from schemas.events import NODE_BEATS, RELAY_AGE_MAX_MS, HeartbeatMessage

log = logging.getLogger(__name__)

#: The longest path a Unix socket can be bound to (``sun_path``, less its terminator).
_SOCKET_PATH_MAX = 107


@dataclass(slots=True)
class RelayStats:
    received: int = 0
    #: Node messages sent, and the beats they carried.
    sent: int = 0
    relayed: int = 0
    #: Datagrams refused, by reason.
    refused: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Latest:
    heard_at: float  # the relay's monotonic clock
    incarnation: str
    generation: int
    step: int
    phase: str
    step_seconds: float
    compute_seconds: float | None = None
    since_step_seconds: float | None = None
    ready_seconds: float | None = None


def _ms_column(values: list[float | None]) -> list[int | None] | None:
    """An optional column in milliseconds (None: no member reported a value)."""
    if all(v is None for v in values):
        return None
    return [None if v is None else round(v * 1000) for v in values]


def node_message(
    job_id: str, node: str, emitted_at: str, heard: list[tuple[str, _Latest]], now: float
) -> bytes:
    """``heard`` (member, its latest heartbeat) as ``node``'s ``node.heartbeat``, a column
    per field (``schemas.events.NodeHeartbeatMessage``; ``compute_ms``, ``since_step_ms`` and
    ``ready_ms`` only when a member reported one)."""
    message = {
        "job_id": job_id, "type": "node.heartbeat", "v": 1, "source": f"{node}/launcher",
        "emitted_at": emitted_at,
        "members": [m for m, _ in heard],
        "incarnation": [h.incarnation for _, h in heard],
        "generation": [h.generation for _, h in heard],
        "age_ms": [min(max(round((now - h.heard_at) * 1000), 0), RELAY_AGE_MAX_MS)
                   for _, h in heard],
        "step": [h.step for _, h in heard],
        "phase": [h.phase for _, h in heard],
        "step_ms": [round(h.step_seconds * 1000) for _, h in heard],
    }  # fmt: skip
    for name, values in (
        ("compute_ms", [h.compute_seconds for _, h in heard]),
        ("since_step_ms", [h.since_step_seconds for _, h in heard]),
        ("ready_ms", [h.ready_seconds for _, h in heard]),
    ):
        column = _ms_column(values)
        if column is not None:
            message[name] = column
    return json.dumps(message, separators=(",", ":")).encode()


class HeartbeatRelay:
    """Gathers the heartbeats of the members a launcher started; sends them once an interval,
    one message per node, through ``send(node, data)`` (see the module docstring)."""

    def __init__(
        self,
        path: str,
        job_id: str,
        interval_s: float,
        send: Callable[[str, bytes], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.job_id = job_id
        self.interval_s = interval_s
        self._send = send
        self._clock = clock
        #: member -> (node, incarnation) of the process the launcher started under the name.
        self._expected: dict[str, tuple[str, str]] = {}
        self._latest: dict[str, _Latest] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.stats = RelayStats()

    @classmethod
    def usable_path(cls, directory: str) -> str | None:
        """The socket's path in ``directory``, or None when it is too long to bind."""
        path = os.path.join(directory, "heartbeats.sock")
        return path if len(os.fsencode(path)) <= _SOCKET_PATH_MAX else None

    def expect(self, member: str, node: str, incarnation: str) -> None:
        """The launcher started ``member`` on ``node`` as ``incarnation``: relay its beats
        (and no longer those of an earlier process of the name)."""
        with self._lock:
            self._expected[member] = (node, incarnation)
            self._latest.pop(member, None)

    def take(self, data: bytes) -> str | None:
        """One datagram: None when it was taken, else why not."""
        self.stats.received += 1
        try:
            beat = HeartbeatMessage.model_validate_json(data)
        except ValidationError as exc:
            return self._refuse(f"schema violation: {exc.errors()[0]['msg']}")
        node, _, member = beat.source.partition("/")
        with self._lock:
            expected = self._expected.get(member)
            if beat.job_id != self.job_id or expected is None or expected[0] != node:
                return self._refuse(f"not a member this launcher started: {beat.source}")
            if expected[1] != beat.incarnation:
                return self._refuse(f"stale_incarnation: {beat.incarnation} of {beat.source}")
            p = beat.payload
            step_seconds, compute = p.step_seconds, p.compute_seconds
            earlier = self._latest.get(member)
            if earlier is not None and earlier.generation == beat.generation:
                # Two beats in one interval (the member's clock and the relay's drift): the
                # message carries the latest, and what the earlier one said of the steps
                # between: the longest step (each beat says the longest since the one
                # before), the compute time when the latest has none.
                step_seconds = max(step_seconds, earlier.step_seconds)
                if compute is None:
                    compute = earlier.compute_seconds
            self._latest[member] = _Latest(
                self._clock(), beat.incarnation, beat.generation, p.step, p.phase.value,
                step_seconds, compute, p.since_step_seconds, p.ready_seconds,
            )  # fmt: skip
        return None

    def flush(self) -> dict[str, list[bytes]]:
        """What was heard since the previous flush, as each node's messages (and forget it)."""
        now = self._clock()
        with self._lock:
            latest, self._latest = self._latest, {}
            nodes: dict[str, list[tuple[str, _Latest]]] = {}
            for member, heard in latest.items():
                nodes.setdefault(self._expected[member][0], []).append((member, heard))
            self.stats.relayed += len(latest)
        emitted_at = datetime.now(UTC).isoformat()
        out: dict[str, list[bytes]] = {}
        for node, beats in nodes.items():
            out[node] = [
                node_message(self.job_id, node, emitted_at, beats[i : i + NODE_BEATS], now)
                for i in range(0, len(beats), NODE_BEATS)
            ]
        return out

    def start(self) -> HeartbeatRelay:
        """Bind the socket and relay from a thread of its own."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self._socket = sock
        self._thread = threading.Thread(target=self._run, name="elastic-relay", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(max(1.0, 2 * self.interval_s))
        if self._socket is not None:
            self._socket.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _run(self) -> None:
        sock = self._socket
        assert sock is not None
        due = self._clock() + self.interval_s
        while not self._closing.is_set():
            left = due - self._clock()
            if left > 0:
                sock.settimeout(left)
                try:
                    data = sock.recv(MAX_EVENT_BYTES + 1)
                except TimeoutError:
                    pass
                except OSError as exc:
                    log.warning("the heartbeat relay's socket failed: %s", exc)
                    return
                else:
                    self.take(data)
                    continue
            self._send_all()
            due = max(due + self.interval_s, self._clock())

    def _send_all(self) -> None:
        for node, messages in self.flush().items():
            for data in messages:
                try:
                    self._send(node, data)
                except Exception:  # one node's failure must not stop the others'
                    log.exception("relaying %s's heartbeats failed", node)
                    continue
                self.stats.sent += 1

    def _refuse(self, reason: str) -> str:
        key = reason.split(":", 1)[0]
        self.stats.refused[key] = self.stats.refused.get(key, 0) + 1
        return reason
