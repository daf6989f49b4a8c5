"""The NATS JetStream adapter: the events stream, the ingest's durable pull consumer, commands."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple, cast

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ClusterInfo,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    StorageType,
    StreamConfig,
)

from controlplane.core.liveness import Beats, on_the_ms
from controlplane.decode import decode_heartbeats
from controlplane.errors import BusUnavailable
from controlplane.settings import Settings
from schemas.nats import Failover, auth_options
from schemas.subjects import (
    BEACON_INTERVAL_S,
    BEACON_SUBJECT,
    COMMAND_PREFIX,
    EVENT_ACK_TIMEOUT_S,
    EVENTS_WILDCARD,
    HEARTBEATS_WILDCARD,
)

log = logging.getLogger(__name__)

#: NATS errors after which the subscription is re-created (nats.py #504).
_TRANSIENT = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoServersError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.APIError,
    ConnectionError,
    OSError,
)


class Delivery(NamedTuple):
    """One message delivered to the ingest: what it needs and nothing more."""

    subject: str
    reply: str
    data: bytes


#: Warnings logged once per process (a connection without credentials).
_warned = {"unauthenticated": False, "beacon": False}


async def connect(
    settings: Settings,
    *,
    name: str = "elastic-controlplane",
    failover: Failover | None = None,
    on_reconnect: Callable[[], None] | None = None,
    **options: Any,
) -> Client:
    """Connect with reconnection forever; raise ``BusUnavailable`` if the first connect fails.

    ``failover`` picks the server a reconnection goes to (``Beacon`` leaves a server cut off
    from the rest of the cluster through it); ``on_reconnect`` is called on each reconnection
    (the heartbeats sent meanwhile were not heard)."""
    failover = failover or Failover()
    auth = auth_options(settings.nats_creds, settings.nats_user, settings.nats_password)
    if not auth and not _warned["unauthenticated"]:
        _warned["unauthenticated"] = True
        log.warning(
            "NATS without credentials: whoever reaches the server may publish as any member "
            "and read every event (issue identities with `elasticctl creds`, then set "
            "ELASTIC_NATS_CREDS; docs/security.md)"
        )

    async def _disconnected() -> None:
        if not nc.is_closed:  # closing on purpose disconnects too
            log.warning("NATS disconnected; reconnecting")

    async def _reconnected() -> None:
        log.info("NATS reconnected")
        failover.connected()
        if on_reconnect is not None:
            on_reconnect()

    async def _error(exc: Exception) -> None:
        if BEACON_SUBJECT in str(exc) and not _warned["beacon"]:
            _warned["beacon"] = True
            log.warning(
                "NATS refuses the beacon (%s): this credential predates it; issue the"
                " credentials again (elasticctl creds) so that members leave a NATS server cut"
                " off from the control plane (docs/operations.md)",
                exc,
            )
        log.debug("NATS: %s", exc)

    nc = Client()
    try:
        await nc.connect(
            servers=[s.strip() for s in settings.nats_url.split(",")],
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,  # type: ignore[arg-type]  # annotated int, used as seconds
            connect_timeout=2,
            disconnected_cb=_disconnected,
            reconnected_cb=_reconnected,
            error_cb=_error,
            reconnect_to_server_handler=failover,
            **auth,
            **options,
        )
    except (nats.errors.NoServersError, OSError, TimeoutError) as exc:
        raise BusUnavailable(f"cannot reach NATS at {settings.nats_url}: {exc}") from exc
    return nc


async def ensure_stream(js: JetStreamContext, settings: Settings) -> None:
    """Create the events stream, or bring an existing one to this configuration."""
    await _ensure(
        js,
        StreamConfig(
            name=settings.stream,
            subjects=[EVENTS_WILDCARD],
            storage=StorageType.FILE,
            max_age=settings.stream_max_age_s,
            duplicate_window=settings.stream_duplicate_window_s,
            num_replicas=settings.stream_replicas,
        ),
    )


async def ensure_command_stream(js: JetStreamContext, settings: Settings) -> None:
    """Create the commands stream (the last few commands per subject are kept, so a member
    that subscribes late, or was away, reads the command in force by its subject)."""
    await _ensure(
        js,
        StreamConfig(
            name=settings.command_stream,
            subjects=[f"{COMMAND_PREFIX}.>"],
            storage=StorageType.FILE,
            max_msgs_per_subject=settings.command_history,
            max_age=settings.stream_max_age_s,
            duplicate_window=settings.stream_duplicate_window_s,
            num_replicas=settings.stream_replicas,
            # Members read the command in force by its subject (JetStream's direct get).
            allow_direct=True,
        ),
    )


async def _ensure(js: JetStreamContext, config: StreamConfig) -> None:
    assert config.name is not None
    try:
        await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(config)
        log.info("created stream %s", config.name)
        return
    await js.update_stream(config)


def consumer_config(settings: Settings, *, start_seq: int = 1) -> ConsumerConfig:
    """The ingest's durable pull consumer, acked a batch at a time (ack-all)."""
    return ConsumerConfig(
        durable_name=settings.ingest_durable,
        deliver_policy=DeliverPolicy.ALL if start_seq <= 1 else DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=None if start_seq <= 1 else start_seq,
        ack_policy=AckPolicy.ALL,
        ack_wait=settings.ingest_ack_wait_s,
        max_ack_pending=settings.ingest_max_ack_pending,
        max_waiting=16,
        filter_subject=EVENTS_WILDCARD,
    )


def delivery(reply: str) -> tuple[int, int]:
    """(stream sequence, consumer delivery sequence) from a JetStream message's reply subject."""
    tokens = reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(tokens[5]), int(tokens[6])
    return int(tokens[Msg.Ack.StreamSeq]), int(tokens[Msg.Ack.ConsumerSeq])


#: How long the ingest's consumer waits for JetStream's API (consumer info, add, delete).
_JS_API_TIMEOUT_S = 2.0
#: How soon a pull request that found no responders is asked again.
_NO_RESPONDERS_RETRY_S = 0.25
#: How long past a pull request's expiry the event stream may stay quiet before it counts as
#: not answering (the decider then leaves silences for later: ``Decider.events_current``).
STREAM_ANSWER_GRACE_S = 1.0
#: How long after the stream answers again events members sent while it did not may still
#: be on their way (each is sent again once its acknowledgement times out), with a margin.
EVENTS_SETTLE_S = EVENT_ACK_TIMEOUT_S + 1.0
#: A peer of the consumer's group counts towards its leader's quorum when the leader heard it
#: this recently (JetStream's replicas are heard about every second), and how long the
#: control plane waits for the leader's answer when it asks (``EventConsumer.check_quorum``).
QUORUM_ACTIVE_S = 2.5
QUORUM_ASK_TIMEOUT_S = 0.5
#: A partly filled batch is handed over once this long passes without _WAKE_EVERY more.
_LINGER_S = 0.005
_WAKE_EVERY = 256
#: Events that report a failure: a batch holding one is handed over without the linger (the
#: decider waits for it). They are rare, so batches stay as full as before.
URGENT_TYPES = frozenset({"member.exited", "member.fault"})
#: Their subjects' ends (``elastic.evt.<job>.<node>.<role>.<type>``).
_URGENT_ENDS = tuple(f".{t}" for t in sorted(URGENT_TYPES))


def unacknowledged(info: ConsumerInfo) -> int:
    """Messages of a consumer not yet acknowledged: not delivered yet, or delivered and
    waiting for their ack (the ingest acks after the commit)."""
    return int(info.num_pending or 0) + int(info.num_ack_pending or 0)


class EventConsumer:
    """Pulls batches from the durable consumer over one inbox subscription; acks a batch at once.

    nats-py's ``fetch`` awaits each message with its own timeout, which costs more than the
    rest of the ingest together; this keeps one pull request outstanding, lets the server
    stream into a buffer (the subscription's callback), and hands over a batch when it is full
    or the stream pauses.

    Ack-all acknowledges every pending message up to a stream sequence, including messages
    delivered to someone else. It is safe here because (1) one ingest runs at a time (the
    caller holds the ingest lock), (2) a consumer found with pending deliveries (of a
    predecessor that died) is re-created at its ack floor, and (3) the delivery sequence is
    checked for continuity, so a delivery lost in transit (a server restart, a reconnect)
    re-creates the consumer at its ack floor instead of being acknowledged unseen. Re-reading
    is harmless: the store skips event_ids it holds.
    """

    def __init__(self, nc: Client, settings: Settings) -> None:
        self._nc = nc
        # Short: while a clustered stream elects a leader its API does not answer, and the
        # ingest's retry asks again sooner than nats-py's default of 5 s would.
        self._js = nc.jetstream(timeout=_JS_API_TIMEOUT_S)
        self._settings = settings
        self._sub: Subscription | None = None
        self._inbox = ""
        self._buffer: list[Delivery] = []
        self._arrived = asyncio.Event()
        #: A failure report is in the buffer: hand the batch over now.
        self._urgent = False
        self._request_until = 0.0  # monotonic deadline of the outstanding pull request
        self._request_left = 0  # messages the outstanding request may still deliver
        self._expected = 1  # next consumer delivery sequence
        #: When the oldest request the server has not answered yet was sent (None: every
        #: one was answered, by messages or a status); see ``answering``.
        self._asked_at: float | None = None
        #: How long a request may go unanswered past its expiry before the stream counts as
        #: not answering, and when it last answered again after such a time (see ``answering``).
        self._answer_s = settings.ingest_fetch_timeout_s + STREAM_ANSWER_GRACE_S
        self._answered_again_at: float | None = None
        #: Since when the consumer's leader has not heard a majority of its group (None: it
        #: has, or the group is of one): its answers are a cut-off server's (``check_quorum``).
        self._quorum_lost_at: float | None = None
        #: The ack floor a re-creation read before it deleted the consumer, while the
        #: consumer is not added again (the server did not answer): the next attempt starts
        #: after it, not at the stream's first message.
        self._floor: int | None = None
        self._broken: str | None = None
        #: Bumped whenever the consumer is re-created; acks of older epochs are dropped.
        self.epoch = 0

    async def _consumer_info(self) -> ConsumerInfo | None:
        try:
            info: ConsumerInfo = await self._js.consumer_info(
                self._settings.stream, self._settings.ingest_durable
            )
        except nats.js.errors.NotFoundError:
            return None
        return info

    async def _restart_consumer(self, reason: str) -> None:
        """Re-create the consumer at its ack floor: everything unacknowledged comes again."""
        info = await self._consumer_info()
        if info is not None:
            floor = int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0
            self._floor = max(floor, self._floor or 0)
            await self._js.delete_consumer(self._settings.stream, self._settings.ingest_durable)
        start = await self._add_consumer()
        self.epoch += 1
        log.warning("re-reading the stream from sequence %d: %s", start, reason)

    async def _add_consumer(self) -> int:
        """Add the consumer after the floor a re-creation read (from the stream's first
        message without one); the stream sequence it starts at."""
        start = (self._floor or 0) + 1
        await self._js.add_consumer(
            self._settings.stream, consumer_config(self._settings, start_seq=start)
        )
        self._floor = None
        self._expected = 1
        return start

    async def _subscribe(self) -> None:
        await ensure_stream(self._js, self._settings)
        info = await self._consumer_info()
        if info is None:
            # (Deleted by a re-creation the server did not finish: from its floor.)
            await self._add_consumer()
        elif info.config.ack_policy != AckPolicy.ALL:
            await self._restart_consumer("the consumer had another ack policy")
        elif info.num_ack_pending:
            await self._restart_consumer(
                f"{info.num_ack_pending} messages were delivered to a previous ingest"
            )
        else:
            delivered = info.delivered.consumer_seq if info.delivered else 0
            self._expected = int(delivered or 0) + 1
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(
            self._inbox,
            cb=self._on_message,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )
        self._request_until = 0.0
        self._broken = None

    async def _on_message(self, msg: Msg) -> None:
        # A status (no messages, expired, refused) comes as headers without data.
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            if msg.subject.endswith(_URGENT_ENDS):
                self._urgent = True
            self._on_delivery(Delivery(msg.subject, msg.reply, msg.data))
        else:
            self._on_status(status, (msg.headers or {}).get("Description", ""))

    def _on_delivery(self, delivery: Delivery) -> None:
        if self._asked_at is not None:
            self._answered()
        self._request_left -= 1
        buffer = self._buffer
        buffer.append(delivery)
        if self._request_left <= 0:
            self._request_until = 0.0  # the request is complete
        elif len(buffer) % _WAKE_EVERY != 1 and not self._urgent:
            return  # wake the fetcher on the first message and every _WAKE_EVERY after
        self._arrived.set()

    def _on_status(self, status: str, description: str) -> None:
        if status == "503":
            # No responders: nothing serves the stream through this server (it lost its
            # cluster's quorum, say). Not an answer: the request is asked again, shortly.
            self._request_until = time.monotonic() + _NO_RESPONDERS_RETRY_S
            if self._asked_at is None:
                self._asked_at = time.monotonic()
            return
        if self._asked_at is not None:
            self._answered()
        if status in ("404", "408", "409"):
            # The pull request ended (no messages, expired, or refused).
            self._request_until = 0.0
            if status == "409" and "Consumer Deleted" in description:
                self._broken = "the consumer was deleted"
        self._arrived.set()

    async def reset(self) -> None:
        """Drop the subscription and what it buffered (unacked, so redelivered)."""
        sub, self._sub = self._sub, None
        self._buffer = []
        self._urgent = False
        self._request_until = 0.0
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # best effort: the connection may be gone
                log.debug("unsubscribe failed: %s", exc)

    async def _request(self, batch: int, wait_s: float) -> None:
        expires_ns = int(wait_s * 1e9)
        request = json.dumps({"batch": batch, "expires": expires_ns}).encode()
        subject = (
            f"$JS.API.CONSUMER.MSG.NEXT.{self._settings.stream}.{self._settings.ingest_durable}"
        )
        await self._nc.publish(subject, request, reply=self._inbox)
        if self._asked_at is None:
            self._asked_at = time.monotonic()
        self._request_left = batch
        # A request the server forgot (it restarted) is treated as ended after its expiry.
        self._request_until = time.monotonic() + wait_s + 0.5

    async def fetch(self, batch: int, wait_s: float) -> list[Delivery]:
        """Up to ``batch`` messages; [] when none arrived within ``wait_s`` seconds.

        Raises ``BusUnavailable`` when NATS is unreachable (the caller backs off and retries).
        """
        try:
            if self._broken is not None:
                reason = self._broken
                await self.reset()
                await self._restart_consumer(reason)
            if self._sub is None:
                await self._subscribe()
            deadline = time.monotonic() + wait_s
            while len(self._buffer) < batch and self._broken is None and not self._urgent:
                now = time.monotonic()
                if now >= self._request_until:
                    if self._buffer:
                        break
                    await self._request(batch, max(wait_s, 0.05))
                timeout = _LINGER_S if self._buffer else deadline - now
                if timeout <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout)
                except TimeoutError:
                    break
            taken, self._buffer = self._buffer[:batch], self._buffer[batch:]
            # Still set while the buffer holds more (one that came too late for this batch,
            # or rarer, more than a batch): the next fetch then hands it over without waiting.
            self._urgent = self._urgent and bool(self._buffer)
            if taken and not self._continuous(taken):
                return []
            if time.monotonic() >= self._request_until and len(self._buffer) < batch:
                # Let the next batch stream in while this one is decoded and committed.
                await self._request(batch, max(wait_s, 0.05))
        except _TRANSIENT as exc:
            if self._asked_at is None:  # the server could not be asked: as good as no answer
                self._asked_at = time.monotonic()
            await self.reset()
            raise BusUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return taken

    def _answered(self) -> None:
        """The server answered the oldest request outstanding (``_asked_at``)."""
        now = time.monotonic()
        if now - cast("float", self._asked_at) > self._answer_s:
            self._answered_again_at = now
        self._asked_at = None

    def unanswered_s(self) -> float:
        """How long the oldest request of this consumer has gone unanswered (0: none), or
        its leader has gone without a quorum, whichever is longer."""
        now = time.monotonic()
        asked, lost = self._asked_at, self._quorum_lost_at
        unanswered = 0.0 if asked is None else now - asked
        return unanswered if lost is None else max(unanswered, now - lost)

    def stream_answers(self) -> bool:
        """Whether no request has gone unanswered past its expiry and a grace, and the
        consumer's leader hears its group (``answering`` without the settling after an
        outage)."""
        return self._quorum_lost_at is None and self.unanswered_s() <= self._answer_s

    async def check_quorum(self) -> None:
        """Ask the consumer's leader whom of its group it hears. A leader left on a server cut
        off from the rest of the cluster still answers pull requests (expired, with no
        messages) until it steps down, though nothing reaches it: while it hears less than a
        majority, the stream counts as not answering (so no silence is judged on what the
        control plane cannot hear, and the control plane leaves the server), and once it
        hears one again, as answering again (the settling follows). No answer, or an error,
        changes nothing: the pull requests' answers judge that."""
        try:
            info = await self._js.consumer_info(
                self._settings.stream, self._settings.ingest_durable, timeout=QUORUM_ASK_TIMEOUT_S
            )
        except Exception as exc:  # not known now
            log.debug("consumer info: %s", exc)
            return
        now = time.monotonic()
        if not has_quorum(info.cluster):
            if self._quorum_lost_at is None:
                self._quorum_lost_at = now
                leader = info.cluster.leader if info.cluster is not None else None
                log.warning(
                    "the events consumer's leader (%s) hears no majority of its group: the"
                    " stream counts as not answering",
                    leader or "none known",
                )
        elif self._quorum_lost_at is not None:
            self._quorum_lost_at = None
            self._answered_again_at = now
            log.info("the events consumer's leader hears its group again")

    def answering(self) -> bool:
        """Whether the stream answers, and has for long enough that what members sent while
        it did not is in it: no request of this consumer has gone unanswered for more than
        ``answer_s`` (a healthy server answers every pull request by its expiry, with
        messages or a status; one whose stream or consumer leader is failing over, or that
        lost its JetStream quorum, does not), nor was, in the last ``EVENTS_SETTLE_S`` (a
        member's publication sent while the stream did not answer is sent again only when
        its acknowledgement times out: ``EVENT_ACK_TIMEOUT_S``)."""
        again = self._answered_again_at
        if not self.stream_answers():
            return False
        return again is None or time.monotonic() - again >= EVENTS_SETTLE_S

    def _continuous(self, msgs: list[Delivery]) -> bool:
        """Check that no delivery went missing before or inside ``msgs`` (one inbox, in order)."""
        first = delivery(msgs[0].reply)[1]
        last = delivery(msgs[-1].reply)[1]
        if first == self._expected and last - first + 1 == len(msgs):
            self._expected = last + 1
            return True
        self._broken = (
            f"deliveries {first}..{last} ({len(msgs)} messages) arrived where {self._expected} "
            "was due"
        )
        self._buffer = []
        self._urgent = False
        return False

    async def ack_through(self, delivery: Delivery, epoch: int) -> bool:
        """Acknowledge ``delivery`` and all delivered before it; False if the epoch passed."""
        if epoch != self.epoch:
            return False  # the consumer was re-created: these messages come again
        await self._nc.publish(delivery.reply, b"+ACK")
        return True

    async def pending(self) -> int:
        """Messages the server holds for this consumer that are not yet acknowledged."""
        info = await self._consumer_info()
        return unacknowledged(info) if info is not None else 0


@dataclass(slots=True)
class HeartbeatStats:
    """What the heartbeat listener received since start."""

    received: int = 0
    accepted: int = 0
    #: Refused by reason (its first words: ``forged source``, ``schema violation``, ...).
    refused: dict[str, int] = field(default_factory=dict)


#: A refused heartbeat is logged at most this often (the rest are counted).
_REFUSAL_LOG_S = 10.0


def has_quorum(cluster: ClusterInfo | None, active_s: float = QUORUM_ACTIVE_S) -> bool:
    """Whether the leader that gave ``cluster`` (a stream's or a consumer's info) hears a
    majority of its group: itself and the peers it heard from within ``active_s``, not
    offline. Without a cluster, or a group of one, it does."""
    if cluster is None or not cluster.replicas:
        return True
    limit = active_s * 1e9  # the server gives ``active`` in nanoseconds
    heard = sum(
        1 for p in cluster.replicas if not p.offline and p.active is not None and p.active < limit
    )
    return 2 * (1 + heard) > 1 + len(cluster.replicas)


class Beacon:
    """The control plane's beacon, and its connection's way off a server cut off from the
    cluster.

    Every ``BEACON_INTERVAL_S``, while the event stream answers its consumer, it publishes
    ``elastic.beacon`` (NATS core): a member's or a launcher's connection that stops hearing it
    is on a server cut off from this one's side of the cluster, and moves
    (``rank_runtime.client``). This connection moves when the event
    stream has not answered its consumer for ``LEAVE_AFTER_S`` (a server without JetStream's
    quorum answers no pull request), then every ``2 * LEAVE_AFTER_S`` while it still does not
    (not longer: while it does not answer, nothing is judged and no member hears a beacon;
    a move may land on the server cut off, and the next one must not be long in coming)."""

    LEAVE_AFTER_S = 5.0

    def __init__(self, nc: Client, consumer: EventConsumer, failover: Failover) -> None:
        self._nc = nc
        self._failover = failover
        self._consumer = consumer
        self._leave_after = self.LEAVE_AFTER_S
        self._left_at = 0.0
        #: Times this connection left its server.
        self.failovers = 0

    async def run(self, stop: asyncio.Event) -> None:
        nc = self._nc
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), BEACON_INTERVAL_S)
            if stop.is_set() or not nc.is_connected:
                continue
            try:
                await self._consumer.check_quorum()
                # Only from a server whose stream answers: members that hear it stay where
                # they are, so a server cut off from the cluster must not send it.
                if self._consumer.stream_answers():
                    await nc.publish(BEACON_SUBJECT, b"")
                await self._maybe_leave()
            except Exception as exc:  # a reconnection under way, say: on the next round
                log.debug("beacon: %s", exc)

    async def _maybe_leave(self) -> None:
        nc = self._nc
        silent = self._consumer.unanswered_s()
        now = time.monotonic()
        if silent < self.LEAVE_AFTER_S:
            self._leave_after = self.LEAVE_AFTER_S
            return
        if silent < self._leave_after or now - self._left_at < self._leave_after:
            return
        self._left_at = now
        self._leave_after = 2 * self.LEAVE_AFTER_S
        self.failovers += 1
        await self._failover.move(nc, f"the event stream has not answered for {silent:.1f} s")


class HeartbeatListener:
    """Receives heartbeats on the NATS core subjects ``elastic.hb.>`` (not stored).

    Each message, a member's own heartbeat or its node's launcher's relay of its members', is
    validated and bound to its subject (``decode_heartbeats``); the beats it carries are handed
    to ``on_beats`` with the time the message arrived (on the millisecond; each beat was heard
    its ``age_ms`` earlier). One bad message or beat (or a failing ``on_beats``) is counted
    and dropped: it never stops the subscription or the loop.
    """

    def __init__(
        self,
        nc: Client,
        on_beats: Callable[[Beats, datetime], list[str]],
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self._nc = nc
        #: (beats, when their message arrived) -> why each beat not taken was not.
        self._on_beats = on_beats
        self._clock = clock or (lambda: datetime.now(UTC))
        self._sub: Subscription | None = None
        self._logged = 0.0
        self.stats = HeartbeatStats()
        #: Messages received while ``held`` (subject, data, when it arrived), taken after.
        self._held: list[tuple[str, bytes, datetime]] | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(
            HEARTBEATS_WILDCARD,
            cb=self._on_message,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )

    async def catch_up(self, timeout_s: float = 5.0) -> None:
        """Take every heartbeat that reached NATS before this call: a PING's PONG comes back
        behind every message the server sent before it, and nats-py's queue for this
        subscription is then drained. A connection that does not answer within
        ``timeout_s`` is given up on (what was heard is what there is)."""
        try:
            await self._nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # seconds
            sub = self._sub
            deadline = time.monotonic() + timeout_s
            # nats-py signals nothing when a subscription's queue drains: yield to its task.
            while sub is not None and sub.pending_msgs and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0)
        except Exception as exc:  # unreachable NATS, a timeout: judge on what was heard
            log.warning("heartbeats not caught up before a decision: %s", exc)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the heartbeats that arrive meanwhile, each with the time it arrived, and take
        them into the table on the way out: a decision's append (its round trips to
        PostgreSQL, where the loop would take every message that came in) waits for none of
        them, and the table holds the same beats at the same times after."""
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            # Taken once what is ready runs (a command's send just handed over); what
            # arrives until then is kept behind them, in order.
            asyncio.get_running_loop().call_soon(self._take_held)

    def _take_held(self) -> None:
        held, self._held = self._held, None
        for subject, data, at in held or ():
            self.receive(subject, data, at)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_message(self, msg: Msg) -> None:
        self.receive(msg.subject, msg.data)

    def receive(self, subject: str, data: bytes, at: datetime | None = None) -> None:
        """Take one message, a member's heartbeat or its node's, that arrived ``at`` (now
        when not given; never raises)."""
        if at is None:
            at = on_the_ms(self._clock())
            if self._held is not None:
                self._held.append((subject, data, at))
                return
        self.stats.received += 1
        beats = decode_heartbeats(subject, data)
        if isinstance(beats, str):
            self._refuse(subject, beats)
            return
        try:
            refused = self._on_beats(beats, at)
        except Exception as exc:
            log.exception("heartbeats of %s could not be taken", beats.node)
            refused = [f"undecodable: {type(exc).__name__}"] * len(beats.members)
        for why in refused:
            self._refuse(subject, why)
        self.stats.accepted += len(beats.members) - len(refused)

    def _refuse(self, subject: str, reason: str) -> None:
        key = reason.split(":", 1)[0][:64]
        refused = self.stats.refused
        refused[key] = refused.get(key, 0) + 1
        now = time.monotonic()
        if now - self._logged >= _REFUSAL_LOG_S:
            self._logged = now
            log.warning("refused a heartbeat on %r: %s (%d refused so far)",
                        subject[:256], reason[:256], sum(refused.values()))  # fmt: skip
