"""The member's link to the control plane: events out, heartbeats, commands in.

Training never waits on it. ``publish`` validates an event, numbers it and appends it to a
bounded in-memory buffer, then returns; a background thread with its own event loop connects
to NATS (retrying until it can), publishes the buffer to JetStream with ``Nats-Msg-Id`` set and
keeps what the server did not acknowledge for the next try, so a lost connection delays events
and never blocks or crashes the training loop. A second thread sends heartbeats on a timer,
so a slow step does not silence them, while a stopped process (SIGSTOP) stops them with it.
Heartbeats go to NATS core subjects (``elastic.hb.<job>.<node>.<member>``), not JetStream:
the control plane keeps them in memory (soft state), and one sent while disconnected is lost.
Commands (``elastic.cmd.<job>.all`` and ``.<member>``) arrive on NATS core subscriptions to
those subjects (the control plane publishes them into the commands stream, and every
subscriber gets them as they are published); on subscribing, and again after every
reconnection, the member reads the last command of each subject from the stream (JetStream's
direct get), so a member that connects late, or was away while one was published, still sees
the command in force. The control plane sends a command again while it is owed, and a
command seen twice is applied once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import queue
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import BaseModel, ValidationError

from rank_runtime.identity import Identity
from schemas.auth import (
    COMMAND_KEY_ENV,
    SIGNATURE_HEADER,
    CommandVerifier,
    command_message,
)
from schemas.commands import COMMAND_ADAPTER, Reallocate, Start, Stop
from schemas.common import Phase
from schemas.events import EVENT_ADAPTER
from schemas.ids import new_event_id
from schemas.nats import Failover, auth_options
from schemas.subjects import (
    BEACON_INTERVAL_S,
    BEACON_SUBJECT,
    BEACON_TIMEOUT_S,
    BROADCAST,
    EVENT_ACK_TIMEOUT_S,
    MSG_ID_HEADER,
    command_subject,
    event_subject,
    heartbeat_subject,
)

log = logging.getLogger(__name__)

#: While no beacon comes, a connection leaves its server again after this many seconds,
#: drawn from the range each time (``EventClient._check_beacon``).
BEACON_RETRY_S = (2.0, 4.0)


def _open_relay_socket() -> socket.socket:
    """A datagram socket to the launcher's heartbeat relay (never blocks: a full queue drops
    the heartbeat, the next one is due an interval later)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    return sock


#: Refused messages remembered, so that one read twice is refused (and reported) once.
_REFUSED_KEPT = 1024
#: Events sent per round before waiting for the server's acknowledgements.
_WINDOW = 512
#: The largest compute time per step a heartbeat carries (``schemas.common.ComputeSeconds``).
_COMPUTE_MAX_S = 3600.0
#: How much of the longest recent step ``open_step`` still remembers a step later.
_LONG_STEP_DECAY = 0.98
#: ``command.refused`` reports per minute at most (the rest are counted into the next one), so
#: a flood of forged commands does not become a flood of events from every member.
_REFUSALS_PER_MINUTE = 10
#: ``EventClient(command_key=FROM_ENV)``: read the verifying key from ``ELASTIC_COMMAND_KEY``.
FROM_ENV = "env"


def command_verifier(text: str | None) -> CommandVerifier | None:
    """The verifier of ``ELASTIC_COMMAND_KEY``'s hex (None when unset or empty)."""
    return CommandVerifier.from_hex(text) if text and text.strip() else None


@dataclass(slots=True)
class ClientStats:
    """What the client did since start."""

    published: int = 0
    acked: int = 0
    #: Events dropped because the buffer was full (oldest first): the control plane records
    #: the hole in this member's sequence as a gap.
    dropped: int = 0
    connects: int = 0
    commands: int = 0
    #: Commands refused: unsigned, a signature that did not verify, another job's.
    refused: int = 0
    #: Heartbeats sent (NATS core), and those dropped (no connection).
    heartbeats: int = 0
    heartbeats_dropped: int = 0
    #: Times the connection left a server the control plane's beacon stopped on.
    failovers: int = 0


class OpenStep(NamedTuple):
    """A member's open step (``EventClient.open_step``), times as ``time.monotonic``."""

    step: int
    began: float
    #: When its gradients were all ready (None: not yet, or not reported).
    ready: float | None
    #: The longest of the member's recent steps, seconds.
    longest: float


class EventClient:
    """Publishes this member's events and receives its commands. No I/O before ``start``."""

    def __init__(
        self,
        identity: Identity,
        *,
        buffer_limit: int = 100_000,
        ack_timeout_s: float = EVENT_ACK_TIMEOUT_S,
        commands: bool = True,
        command_key: CommandVerifier | str | None = FROM_ENV,
    ) -> None:
        self.identity = identity
        self._follow_commands = commands
        #: Whether the commands in force were read since the last (re)connection.
        self._commands_current = False
        #: Verifies the control plane's signature on every command (None: nothing verified).
        self.verifier = (
            command_verifier(os.environ.get(COMMAND_KEY_ENV))
            if command_key == FROM_ENV
            else command_verifier(command_key)
            if isinstance(command_key, str)
            else command_key
        )
        if self.verifier is None and commands:
            log.warning("%s is unset: commands are obeyed without checking who sent them",
                        COMMAND_KEY_ENV)  # fmt: skip
        self._refusal_times: collections.deque[float] = collections.deque()
        #: Digests of the messages refused lately: the same message read twice (its
        #: subscription and the read of the command in force, at a (re)connection) is one
        #: refusal, reported once.
        self._refused: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._newest_generation = 0
        self._unreported = 0
        #: This process's incarnation: the one its launcher chose (``ELASTIC_INCARNATION``,
        #: which the launcher also names in the process's exit), else one drawn here. One
        #: client per process: ``seq`` restarts with the incarnation.
        self.incarnation = identity.incarnation or uuid.uuid4().hex[:16]
        #: The generation this member believes current (stamped on every event).
        self.generation = 0
        #: What the heartbeat reports.
        self.step = 0
        self.phase = Phase.INIT
        self.stats = ClientStats()
        self._ack_timeout_s = ack_timeout_s
        self._lock = threading.Lock()
        self._seq = 0
        self._in_flight = 0
        self._buffer: collections.deque[tuple[str, str, bytes]] = collections.deque(
            maxlen=buffer_limit
        )
        self._commands: queue.Queue[Start | Reallocate | Stop] = queue.Queue()
        self._seen_commands: set[str] = set()
        self._thread: threading.Thread | None = None
        self._heart: threading.Thread | None = None
        #: Opened here, before any process group forms: a socket opened while one forms is
        #: taken for one of the group's (``rank_runtime.group``).
        self._relay_socket = _open_relay_socket() if identity.heartbeat_relay else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nc: Client | None = None
        self._wake: asyncio.Event | None = None
        self._closing = threading.Event()
        self._connected = threading.Event()
        self._started = threading.Event()
        self._credential_warned = False
        #: The longest step finished since the last heartbeat (``finished_step``).
        self._step_seconds = 0.0
        #: The compute time of the steps finished since the last heartbeat, and their count.
        self._compute_seconds = 0.0
        self._computed = 0
        #: Where the member is in its steps (``time.monotonic``): when it finished its last
        #: step (or began training), when the next step's gradients were all ready on it
        #: (None: not yet), and the phase its previous heartbeat saw.
        self._stepped_at = time.monotonic()
        self._ready_at: float | None = None
        self._beat_phase: Phase | None = None
        #: The step ``step_began`` began last and when (``time.monotonic``; None: no step is
        #: open), and the longest of its recent steps (decaying): what ``open_step`` tells a
        #: watchdog.
        self._began_step = 0
        self._began_at: float | None = None
        self._long_step = 0.0
        #: Called (on the client's thread) with every command accepted, as it arrives: the
        #: member ends a step its collectives block once a newer generation is decided.
        self.on_command: Callable[[Start | Reallocate | Stop], None] | None = None
        #: Where the connection goes when it leaves a server (``_check_beacon``).
        self._failover = Failover()
        #: When the control plane's beacon was last heard (``time.monotonic``; None: never
        #: yet on this connection), and how long after it (and after the last move) this
        #: connection leaves its server for want of it (``_check_beacon``).
        self._beacon_at: float | None = None
        self._beacon_heard = False
        self._leave_after = BEACON_TIMEOUT_S
        self._left_at = 0.0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> EventClient:
        """Start the background thread (it connects, and keeps reconnecting, on its own)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"elastic-events-{self.identity.member}", daemon=True
            )
            self._thread.start()
            self._started.wait(10)
        return self

    def start_heartbeats(self, interval_s: float) -> None:
        """Send a heartbeat every ``interval_s`` seconds from a thread of its own."""
        if self._heart is not None:
            return

        def beat() -> None:
            while not self._closing.wait(interval_s):
                self.heartbeat()

        self._heart = threading.Thread(
            target=beat, name=f"elastic-heartbeat-{self.identity.member}", daemon=True
        )
        self._heart.start()

    def wait_connected(self, timeout: float) -> bool:
        """Block until connected to NATS (True) or ``timeout`` passes (False)."""
        return self._connected.wait(timeout)

    def close(self, flush_s: float = 5.0) -> None:
        """Send what is buffered (for at most ``flush_s``), then stop the threads."""
        deadline = time.monotonic() + flush_s
        while self.pending() and time.monotonic() < deadline and self._connected.is_set():
            time.sleep(0.01)
        self._closing.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(max(1.0, deadline - time.monotonic() + 2.0))
        if self._heart is not None:
            self._heart.join(1.0)
        if self._relay_socket is not None:
            self._relay_socket.close()

    # ------------------------------------------------------------------ events out

    def publish(self, type_: str, payload: dict[str, Any] | BaseModel) -> str:
        """Validate, number and buffer one event; return its event_id. Never blocks on I/O.

        Raises ``ValueError`` when the event does not match its schema (a bug in the caller).
        """
        body = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
        event_id = new_event_id()
        identity = self.identity
        with self._lock:
            self._seq += 1
            envelope = {
                "event_id": event_id,
                "job_id": identity.job_id,
                "type": type_,
                "v": 1,
                "source": identity.source,
                "incarnation": self.incarnation,
                "seq": self._seq,
                "generation": self.generation,
                "emitted_at": datetime.now(UTC).isoformat(),
                "payload": body,
            }
            try:
                EVENT_ADAPTER.validate_python(envelope, strict=False)
            except ValidationError as exc:
                self._seq -= 1
                raise ValueError(f"invalid {type_} event: {exc}") from exc
            subject = event_subject(identity.job_id, identity.node, identity.member, type_)
            if len(self._buffer) == self._buffer.maxlen:
                self.stats.dropped += 1
            self._buffer.append((subject, event_id, json.dumps(envelope).encode()))
            self.stats.published += 1
        self._poke()
        return event_id

    def finished_step(self, step: int, seconds: float, compute: float | None = None) -> None:
        """The member finished ``step`` in ``seconds``, ``compute`` of them computing (None:
        not measured): its heartbeats carry the step, the longest step and the mean compute
        time of the steps since the previous heartbeat."""
        with self._lock:
            self.step = step
            self._stepped_at = time.monotonic()
            self._ready_at = None
            self._began_at = None
            self._step_seconds = max(self._step_seconds, seconds)
            self._long_step = max(seconds, self._long_step * _LONG_STEP_DECAY)
            if compute is not None and math.isfinite(compute) and compute >= 0:
                self._compute_seconds += compute
                self._computed += 1

    def step_began(self, step: int | None = None) -> None:
        """The member began ``step`` (None: the one after its last): its gradients are not
        ready yet."""
        self._ready_at = None
        self._began_step = self.step + 1 if step is None else step
        self._began_at = time.monotonic()

    def step_abandoned(self) -> None:
        """The member's open step failed (it recovers): no step is open."""
        self._began_at = None
        self._ready_at = None

    def open_step(self) -> OpenStep | None:
        """The member's open step in phase train; None when no step is open."""
        began = self._began_at
        if began is None or self.phase is not Phase.TRAIN:
            return None
        return OpenStep(self._began_step, began, self._ready_at, self._long_step)

    @property
    def newest_generation(self) -> int:
        """The newest generation a command this client accepted named (0: none yet)."""
        return self._newest_generation

    def gradients_ready(self) -> None:
        """Every gradient of the member's current step is ready: from here it waits for its
        peers' (the evidence that tells a stalled peer from a stalled group)."""
        self._ready_at = time.monotonic()

    def _progress(self) -> tuple[float | None, float | None]:
        """Seconds since the last step and since the next step's gradients were ready (in
        phase train; None otherwise), at most what a heartbeat carries."""
        phase = self.phase
        now = time.monotonic()
        if phase is not self._beat_phase:
            if phase is Phase.TRAIN:
                self._stepped_at = now  # training (again): nothing was due before
            self._beat_phase = phase
        if phase is not Phase.TRAIN:
            return None, None
        ready = self._ready_at
        since = min(max(0.0, now - self._stepped_at), _COMPUTE_MAX_S)
        return since, None if ready is None else min(max(0.0, now - ready), _COMPUTE_MAX_S)

    def _take_step_seconds(self) -> tuple[float, float | None]:
        """The longest step and the mean compute time since the previous heartbeat."""
        with self._lock:
            seconds, self._step_seconds = self._step_seconds, 0.0
            computed, self._computed = self._computed, 0
            total, self._compute_seconds = self._compute_seconds, 0.0
        mean = min(total / computed, _COMPUTE_MAX_S) if computed else None
        return seconds, mean

    def heartbeat(self) -> None:
        """Send one heartbeat (step, phase) on ``elastic.hb.<job>.<node>.<member>``: NATS
        core, not JetStream, so it is never stored; one that finds no connection is dropped
        (the next one is due an interval later). Started by a launcher that relays its node's
        heartbeats (``Identity.heartbeat_relay``), it goes to the launcher's socket instead.
        Never blocks on I/O."""
        identity = self.identity
        step_seconds, compute = self._take_step_seconds()
        since, ready = self._progress()
        payload: dict[str, Any] = {"step": self.step, "phase": self.phase.value,
                                   "step_seconds": step_seconds}  # fmt: skip
        if compute is not None:
            payload["compute_seconds"] = compute
        if since is not None:
            payload["since_step_seconds"] = round(since, 3)
        if ready is not None:
            payload["ready_seconds"] = round(ready, 3)
        message = {
            "job_id": identity.job_id,
            "type": "member.heartbeat",
            "v": 1,
            "source": identity.source,
            "incarnation": self.incarnation,
            "generation": self.generation,
            "emitted_at": datetime.now(UTC).isoformat(),
            "payload": payload,
        }
        data = json.dumps(message).encode()
        relay = self.identity.heartbeat_relay
        if relay:
            # To this node's launcher, which relays its members' heartbeats in one message.
            self._relay_beat(relay, data)
            return
        self._send_core(heartbeat_subject(identity.job_id, identity.node, identity.member), data)

    def send_node_heartbeats(self, data: bytes) -> None:
        """Send a ``node.heartbeat`` (this launcher's members' heartbeats) on the launcher's
        heartbeat subject; dropped when there is no connection. Never blocks on I/O."""
        identity = self.identity
        self._send_core(heartbeat_subject(identity.job_id, identity.node, identity.member), data)

    def _relay_beat(self, path: str, data: bytes) -> None:
        try:
            if self._relay_socket is None:
                self._relay_socket = _open_relay_socket()
            self._relay_socket.sendto(data, path)
        except OSError as exc:  # the launcher is gone, or its socket is full: the next one is due
            self.stats.heartbeats_dropped += 1
            if exc.errno in (errno.EPIPE, errno.ENOTCONN, errno.EBADF):
                # This socket was ended under us (a process group's shutdown of the sockets
                # opened while it formed, say): the next heartbeat gets a new one.
                log.warning("the heartbeat relay's socket was closed (%s): opening another", exc)
                broken, self._relay_socket = self._relay_socket, None
                if broken is not None:
                    broken.close()
            return
        self.stats.heartbeats += 1

    def _send_core(self, subject: str, data: bytes) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or not self._connected.is_set():
            self.stats.heartbeats_dropped += 1
            return
        with contextlib.suppress(RuntimeError):  # the loop is shutting down
            loop.call_soon_threadsafe(self._publish_core, subject, data)

    def _publish_core(self, subject: str, data: bytes) -> None:
        nc = self._nc
        if nc is None or not nc.is_connected:
            self.stats.heartbeats_dropped += 1
            return
        task = asyncio.ensure_future(nc.publish(subject, data))
        task.add_done_callback(self._heartbeat_sent)

    def _heartbeat_sent(self, task: asyncio.Future[None]) -> None:
        if task.cancelled() or task.exception() is not None:
            self.stats.heartbeats_dropped += 1
        else:
            self.stats.heartbeats += 1

    def pending(self) -> int:
        """Events not yet acknowledged by the server (buffered or in flight)."""
        with self._lock:
            return len(self._buffer) + self._in_flight

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(wake.set)

    # ------------------------------------------------------------------ commands in

    def next_command(self, timeout: float | None = None) -> Start | Reallocate | Stop | None:
        """The next command not seen before, waiting up to ``timeout`` (None: don't wait)."""
        try:
            if timeout is None:
                return self._commands.get_nowait()
            return self._commands.get(timeout=timeout)
        except queue.Empty:
            return None

    async def _on_command(self, msg: Msg) -> None:
        self._take_command(msg.subject, msg.data, msg.headers)

    def _take_command(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        """One command as published (verified, validated, applied once)."""
        if self.verifier is not None:
            signature = (headers or {}).get(SIGNATURE_HEADER)
            if not signature:
                self._refuse(subject, data, "unsigned")
                return
            if not self.verifier.verify(command_message(subject, data), signature):
                self._refuse(subject, data, "signature does not verify")
                return
        try:
            command = COMMAND_ADAPTER.validate_json(data)
        except ValidationError as exc:
            log.warning("ignoring a malformed command on %s: %s", subject, exc)
            return
        if command.job_id != self.identity.job_id:
            self._refuse(subject, data, f"a command of job {command.job_id}")
            return
        if not isinstance(command, Stop):
            # A genuine command of an older generation (replayed, or re-sent late) is
            # superseded: neither members nor the launcher's fencing act on it.
            if command.generation < self._newest_generation:
                log.info("ignoring generation %d's command: generation %d is newer",
                         command.generation, self._newest_generation)  # fmt: skip
                return
            self._newest_generation = command.generation
        key = str(command.command_id)
        if key in self._seen_commands:
            return  # re-published: applied once
        self._seen_commands.add(key)
        self.stats.commands += 1
        self._commands.put(command)
        hook = self.on_command
        if hook is not None:
            try:
                hook(command)
            except Exception:  # the command is queued all the same: the member still follows it
                log.exception("the command hook failed")

    def _refuse(self, subject: str, data: bytes, reason: str) -> None:
        """Drop a command that did not verify, log it, and report it (``command.refused``,
        at most ``_REFUSALS_PER_MINUTE`` a minute; the rest are counted into the next)."""
        digest = hashlib.blake2b(subject.encode() + b"\0" + data, digest_size=16).digest()
        if digest in self._refused:
            return  # the same message, read again
        self._refused[digest] = None
        if len(self._refused) > _REFUSED_KEPT:
            self._refused.popitem(last=False)
        self.stats.refused += 1
        command_id = _claimed_id(data)
        log.warning("refused a command on %s (%s)%s", subject, reason,
                    f", claiming to be {command_id}" if command_id else "")  # fmt: skip
        now = time.monotonic()
        times = self._refusal_times
        while times and now - times[0] > 60.0:
            times.popleft()
        if len(times) >= _REFUSALS_PER_MINUTE:
            self._unreported += 1
            return
        times.append(now)
        payload: dict[str, Any] = {"subject": subject[:256], "reason": reason[:256],
                                   "suppressed": self._unreported}  # fmt: skip
        if command_id:
            payload["command_id"] = command_id
        self._unreported = 0
        try:
            self.publish("command.refused", payload)
        except ValueError as exc:  # a subject or reason the schema does not take
            log.warning("could not report the refused command: %s", exc)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
            # The client's own tasks (nats-py's) end with the loop.
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        finally:
            self._loop = None
            loop.close()

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        self._started.set()
        backoff = 0.1
        nc: Client | None = None
        while not self._closing.is_set():
            try:
                nc = await self._connect()
                break
            except (nats.errors.NoServersError, OSError, TimeoutError) as exc:
                log.debug("NATS not reachable yet (%s); events stay buffered", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), backoff)
                self._wake.clear()
                backoff = min(backoff * 2, 2.0)
        if nc is None:
            return
        self._nc = nc
        try:
            if self._follow_commands:
                await self._subscribe(nc)
            await self._follow_beacon(nc)
            # Its own task: a send waits seconds for acknowledgements on a cut-off server.
            watching = asyncio.ensure_future(self._watch_beacon(nc))
            while not self._closing.is_set():
                if self._follow_commands and not self._commands_current:
                    self._commands_current = await self._read_commands(nc)
                await self._send(nc)
                if self._closing.is_set():
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.5)
                self._wake.clear()
            await self._send(nc)  # a last flush
            watching.cancel()
        finally:
            self._connected.clear()
            self._nc = None
            with contextlib.suppress(Exception):
                await nc.close()

    async def _connect(self) -> Client:
        identity = self.identity
        try:
            auth = auth_options(identity.nats_creds, identity.nats_user, identity.nats_password)
        except OSError as exc:  # retried like an unreachable server; said once
            if not self._credential_warned:
                self._credential_warned = True
                log.warning("cannot read the NATS credential %s: %s", identity.nats_creds, exc)
            raise

        async def disconnected() -> None:
            self._connected.clear()

        async def reconnected() -> None:
            self._connected.set()
            self.stats.connects += 1
            self._failover.connected()
            self._beacon_at = time.monotonic()  # (judged afresh on this server)
            # What was published while away: read the command in force again.
            self._commands_current = False
            self._poke()

        async def error(exc: Exception) -> None:
            log.debug("NATS: %s", exc)

        nc = await nats.connect(
            servers=[s.strip() for s in identity.nats_url.split(",")],
            name=f"elastic-member-{identity.member}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            connect_timeout=2,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
            reconnect_to_server_handler=self._failover,
            **auth,
        )
        self._connected.set()
        self.stats.connects += 1
        return nc

    async def _follow_beacon(self, nc: Client) -> None:
        """Hear the control plane's beacon (NATS core; credentials issued before it existed
        may not allow it: then it is never heard, and nothing follows from its absence)."""

        async def heard(_msg: Any) -> None:
            self._beacon_at = time.monotonic()
            self._beacon_heard = True
            self._leave_after = BEACON_TIMEOUT_S

        await nc.subscribe(BEACON_SUBJECT, cb=heard)
        self._beacon_at = time.monotonic()

    async def _watch_beacon(self, nc: Client) -> None:
        while not self._closing.is_set():
            await asyncio.sleep(BEACON_INTERVAL_S / 2)
            try:
                await self._check_beacon(nc)
            except Exception as exc:  # a reconnection under way, say: look again later
                log.debug("checking the beacon: %s", exc)

    async def _check_beacon(self, nc: Client) -> None:
        """Leave a server on which the control plane's beacon stopped: it is cut off from the
        control plane's side of the cluster (what this process publishes there reaches no
        one, and its events are never acknowledged). Only after a beacon was heard (the
        control plane is up); then again every ``BEACON_RETRY_S`` (drawn each time) while
        none comes anywhere: the control plane itself may be away (its stream not answering,
        a restart), and when it beacons again, a connection left on a server cut off
        meanwhile must be heard within the control plane's settling (``bus.EVENTS_SETTLE_S``),
        or its healthy members would be taken for silent ones."""
        at = self._beacon_at
        now = time.monotonic()
        if not self._beacon_heard or at is None or not nc.is_connected:
            return
        if now - at < self._leave_after or now - self._left_at < self._leave_after:
            return
        self._left_at = now
        # Not in step with the job's other connections: a job's members do not all
        # reconnect at once while the control plane is away.
        self._leave_after = random.uniform(*BEACON_RETRY_S)
        self.stats.failovers += 1
        await self._failover.move(nc, f"no beacon from the control plane for {now - at:.1f} s")

    async def _subscribe(self, nc: Client) -> None:
        """Follow this job's commands from now on (NATS core; nats-py subscribes again after
        a reconnection by itself)."""
        for subject in self._command_subjects():
            await nc.subscribe(subject, cb=self._on_command)

    def _command_subjects(self) -> list[str]:
        job_id, member = self.identity.job_id, self.identity.member
        return [command_subject(job_id, BROADCAST), command_subject(job_id, member)]

    async def _read_commands(self, nc: Client) -> bool:
        """Read the last command of each of this member's command subjects from the commands
        stream (the one in force when it was published before the subscription, or while
        the connection was away); False while the stream cannot be read yet (it does not
        exist, the server does not answer): the next round tries again."""
        js = nc.jetstream(timeout=2.0)
        try:
            subjects = self._command_subjects()
            stream = await js.find_stream_name_by_subject(subjects[0])
            for subject in subjects:
                try:
                    last = await js.get_last_msg(stream, subject, direct=True)
                except nats.js.errors.NotFoundError:
                    continue  # no command on this subject yet
                self._take_command(last.subject or subject, last.data or b"", last.headers)
        except (nats.js.errors.NotFoundError, nats.errors.Error, TimeoutError) as exc:
            log.debug("cannot read the commands in force yet (%s); trying again", exc)
            return False
        return True

    async def _send(self, nc: Client) -> None:
        """Publish the buffer in windows; keep what was not acknowledged."""
        js = nc.jetstream()
        while self._connected.is_set():
            with self._lock:
                batch = [self._buffer.popleft() for _ in range(min(_WINDOW, len(self._buffer)))]
                self._in_flight = len(batch)
            if not batch:
                return
            try:
                failed = await self._send_batch(js, batch)
            finally:
                with self._lock:
                    self._in_flight = 0
            if failed:
                with self._lock:
                    # First in line again; a retried event may land after later ones of this
                    # member: the control plane accepts it into the gap it left. A full
                    # buffer drops its newest to make room.
                    limit = self._buffer.maxlen or 0
                    self.stats.dropped += max(0, len(self._buffer) + len(failed) - limit)
                    self._buffer.extendleft(reversed(failed))
                await asyncio.sleep(0.1)
                return

    async def _send_batch(
        self, js: Any, batch: list[tuple[str, str, bytes]]
    ) -> list[tuple[str, str, bytes]]:
        """Publish one window and wait for its acknowledgements; return what failed."""
        futures = []
        failed: list[tuple[str, str, bytes]] = []
        for item in batch:
            subject, event_id, data = item
            try:
                ack = await js.publish_async(subject, data, headers={MSG_ID_HEADER: event_id})
                futures.append((item, ack))
            except Exception as exc:
                log.debug("publish failed: %s", exc)
                failed.append(item)
        if futures:
            # Up to the ack timeout, but no longer than the connection stays where it sent
            # them: acknowledgements do not follow it to another server (sent again at once).
            # (``stats.connects`` counts the connections made: a reconnection changes it.)
            connects, deadline = self.stats.connects, time.monotonic() + self._ack_timeout_s
            waiting = {f for _, f in futures}
            while (
                waiting
                and self.stats.connects == connects
                and (left := deadline - time.monotonic()) > 0
            ):
                _, waiting = await asyncio.wait(waiting, timeout=min(left, 0.25))
        for item, future in futures:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.stats.acked += 1
            else:
                future.cancel()
                failed.append(item)
        return failed


def _claimed_id(data: bytes) -> str | None:
    """The ``command_id`` refused bytes claim, when they hold a readable one."""
    try:
        claimed = json.loads(data).get("command_id")
        return str(uuid.UUID(claimed)) if isinstance(claimed, str) else None
    except (ValueError, AttributeError, TypeError):
        return None
