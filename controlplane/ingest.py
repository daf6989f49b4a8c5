"""The ingest's parts: fetch from JetStream and validate (``Fetcher``), append a batch with
what the store refuses isolated down to one message (``commit``). The service loop
(``service.Session``) appends the batches in fetch order and acknowledges one (its last
message, ack-all) only after its commit, so whatever the server forgets is durable in
PostgreSQL; the fetcher decodes the next batch meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from controlplane.backoff import Backoff
from controlplane.bus import Delivery, EventConsumer, delivery
from controlplane.core.records import DeadLetter
from controlplane.decode import decode, printable, storable
from controlplane.errors import BusUnavailable, StoreError, StoreRefused, StoreUnavailable
from controlplane.store.port import Appender, AppendResult, EventStore, JobHead
from schemas.common import MAX_EVENT_BYTES
from schemas.events import EnvelopeBase
from schemas.logjson import about

log = logging.getLogger(__name__)

#: Messages decoded between two yields to the event loop (well under a millisecond of work).
#: The writer's COPY goes out in 128 KiB chunks, each waiting for the socket to drain: every
#: slice decoded meanwhile is time PostgreSQL may sit idle. At 256 a slice took ~9 ms and
#: commits ran at half PostgreSQL's speed; ``elasticctl bench ingest``: 17k -> 19-25k events/s.
_SLICE = 16
#: After this long without messages, ask the server whether the subscription went deaf.
_WATCHDOG_S = 5.0
#: A fetch is committed in parts of at most this many bytes of messages (a part holds at
#: least one). Counted in messages alone, a batch of oversized input (64 KiB kept per dead
#: letter) held ~0.6 GB and its commit seconds; ``elasticctl bench fuzz``.
_MAX_BATCH_BYTES = 8 << 20


def bounded(msgs: list[Delivery], limit: int, count: int | None = None) -> list[list[Delivery]]:
    """``msgs`` cut, in order, into runs of at most ``limit`` bytes of data and, with
    ``count``, at most ``count`` messages (each run at least one message); one run, ``msgs``
    itself, when all of it fits."""
    parts: list[list[Delivery]] = []
    start, size = 0, 0
    for i, msg in enumerate(msgs):
        size += len(msg.data)
        if i > start and (size > limit or (count is not None and i - start >= count)):
            parts.append(msgs[start:i])
            start, size = i, len(msg.data)
    parts.append(msgs[start:] if start else msgs)
    return parts


@dataclass(slots=True)
class Batch:
    """One fetched batch, decoded."""

    events: list[EnvelopeBase]
    #: The events pre-encoded for the store, parallel to ``events`` (None: not needed).
    encoded: list[bytes] | None
    #: The message of each event, parallel to ``events`` (what a refused one is kept as).
    origins: list[Delivery]
    dead_letters: list[DeadLetter]
    last: Delivery
    size: int
    #: The consumer epoch the messages were delivered in.
    epoch: int


@dataclass(slots=True)
class IngestStats:
    """Counters since start."""

    batches: int = 0
    messages: int = 0
    #: The most messages one appended batch (a part of a fetch) held.
    largest: int = 0
    stored: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    gaps: int = 0
    #: Events that arrived after later ones of their source and filled a gap.
    late: int = 0
    store_retries: int = 0
    bus_retries: int = 0
    last_position: int = 0
    last_commit_monotonic: float = field(default_factory=time.monotonic)


def decode_into(
    msgs: Sequence[Delivery],
    events: list[EnvelopeBase],
    letters: list[DeadLetter],
    origins: list[Delivery] | None = None,
) -> None:
    """Decode messages onto ``events`` (and each one's message onto ``origins``); bad ones
    become dead letters keyed by stream sequence."""
    for msg in msgs:
        decoded = decode(msg.subject, msg.data)
        if isinstance(decoded, DeadLetter):
            letters.append(dataclasses.replace(decoded, stream_seq=delivery(msg.reply)[0]))
        else:
            events.append(decoded)
            if origins is not None:
                origins.append(msg)


class SyncAppender:
    """Adapts a synchronous store to the ``Appender`` port (unit tests, in-memory store)."""

    def __init__(self, store: EventStore) -> None:
        self._store = store

    async def append(
        self,
        events: Sequence[EnvelopeBase],
        dead_letters: Sequence[DeadLetter] = (),
        *,
        expected: JobHead | None = None,
        encoded: Sequence[bytes] | None = None,
    ) -> AppendResult:
        return self._store.append(events, dead_letters, expected=expected, encoded=encoded)

    def encode(self, events: Sequence[EnvelopeBase]) -> list[bytes] | None:
        return None


async def commit(
    appender: Appender,
    events: Sequence[EnvelopeBase],
    letters: Sequence[DeadLetter],
    encoded: Sequence[bytes] | None = None,
    origins: Sequence[Delivery] | None = None,
) -> AppendResult:
    """Append a batch; whatever the database refuses is isolated down to one message.

    When the store refuses the batch (``StoreRefused``: the input's fault), the events and
    the dead letters are committed apart, each halved until the refused ones stand alone: a
    refused event becomes a dead letter (keeping, from ``origins``, parallel to ``events``,
    its subject, stream sequence and bytes), a refused dead letter is replaced by a minimal
    one. ``StoreUnavailable`` propagates (the caller retries the whole batch later; what
    was committed comes again as duplicates), and so does it when even a minimal dead letter
    is refused: that is the database's fault, not the input's.
    """
    try:
        return await appender.append(events, letters, encoded=encoded)
    except StoreRefused as exc:
        if not events or not letters:
            if events:
                return await _events_apart(appender, events, encoded, origins, exc)
            return await _letters_apart(appender, letters, exc)
    result = AppendResult()
    if events:
        _merge(result, await _events_apart(appender, events, encoded, origins, None))
    _merge(result, await _letters_apart(appender, letters, None))
    return result


async def _events_apart(
    appender: Appender,
    events: Sequence[EnvelopeBase],
    encoded: Sequence[bytes] | None,
    origins: Sequence[Delivery] | None,
    refused: StoreRefused | None,
) -> AppendResult:
    """Commit events alone; ``refused``: the store already refused exactly these."""
    if refused is None:
        try:
            return await appender.append(events, (), encoded=encoded)
        except StoreRefused as exc:
            refused = exc
    if len(events) == 1:
        letter = refused_letter(events[0], refused, None if origins is None else origins[0])
        log.warning(
            "event %s refused by the store: %s", events[0].event_id, refused,
            extra=about(job=events[0].job_id),
        )  # fmt: skip
        return await _letters_apart(appender, [letter], None)
    mid = len(events) // 2
    result = AppendResult()
    for part in (slice(0, mid), slice(mid, None)):
        _merge(
            result,
            await _events_apart(
                appender,
                events[part],
                None if encoded is None else encoded[part],
                None if origins is None else origins[part],
                None,
            ),
        )
    return result


async def _letters_apart(
    appender: Appender, letters: Sequence[DeadLetter], refused: StoreRefused | None
) -> AppendResult:
    """Commit dead letters alone; ``refused``: the store already refused exactly these."""
    if not letters:
        return AppendResult()
    if refused is None:
        try:
            return await appender.append((), letters)
        except StoreRefused as exc:
            refused = exc
    if len(letters) > 1:
        mid = len(letters) // 2
        result = await _letters_apart(appender, letters[:mid], None)
        _merge(result, await _letters_apart(appender, letters[mid:], None))
        return result
    letter = letters[0]
    log.warning("a dead letter on %r refused by the store: %s", letter.subject[:256], refused)
    minimal = DeadLetter(
        reason=printable(f"dead letter refused by the store: {refused}"),
        raw=b"",
        stream_seq=letter.stream_seq,
        event_id=letter.event_id,
    )
    try:
        return await appender.append((), [storable(minimal)])
    except StoreRefused as exc:
        raise StoreUnavailable(f"the store refuses even a minimal dead letter: {exc}") from exc


def refused_letter(
    event: EnvelopeBase, exc: StoreError, origin: Delivery | None = None
) -> DeadLetter:
    """The dead letter of an event the store refused (its message's, when known)."""
    if origin is not None:
        raw, subject, stream_seq = origin.data, origin.subject, delivery(origin.reply)[0]
    else:
        raw, subject, stream_seq = event.model_dump_json().encode(), "", None
    return DeadLetter(
        reason=printable(f"refused by the store: {exc}"),
        raw=raw[:MAX_EVENT_BYTES],
        subject=subject,
        stream_seq=stream_seq,
        job_id=event.job_id,
        event_id=event.event_id,
    )


def _merge(into: AppendResult, part: AppendResult) -> None:
    into.stored.extend(part.stored)
    into.duplicates += part.duplicates
    into.rejected.extend(part.rejected)
    into.dead_letters += part.dead_letters
    into.gaps.extend(part.gaps)
    into.late += part.late


class Fetcher:
    """Pulls batches from JetStream, decodes and pre-encodes them for the store, and hands
    them to the service loop (``service.Session``); survives NATS restarts. It decodes a batch
    in slices, yielding to the event loop in between, so the loop's round trips to PostgreSQL
    are answered promptly meanwhile; it pauses between slices while the decider has its turn
    (``paused``).

    A fetch (``batch`` messages at most, one round trip to the server) is handed over in
    parts of at most ``part`` messages, each appended, folded and acknowledged on its own:
    the service loop gives the decider its turn between two parts, so a turn that a deadline
    or a fault wants waits for one part's work (tens of milliseconds), never for a whole
    fetch (a backup of 16,384 ranks is 16,384 reports: at ten thousand to a batch, a hang
    whose timeout expired meanwhile waited half a second for its detection)."""

    def __init__(
        self,
        appender: Appender,
        consumer: EventConsumer,
        *,
        batch: int = 10_000,
        part: int = 512,
        fetch_wait_s: float = 0.5,
        retry_max_s: float = 5.0,
    ) -> None:
        self._appender = appender
        self._consumer = consumer
        self._batch = batch
        self._part = part
        self._fetch_wait_s = fetch_wait_s
        self._retry_max_s = retry_max_s
        self._free = asyncio.Event()
        self._free.set()
        self.stats = IngestStats()

    async def run(self, batches: asyncio.Queue[Batch], done: asyncio.Event) -> None:
        """Fetch into ``batches`` until ``done`` is set."""
        backoff = Backoff(max_s=self._retry_max_s)
        idle_since = time.monotonic()
        while not done.is_set():
            try:
                msgs = await self._consumer.fetch(self._batch, self._fetch_wait_s)
            except BusUnavailable as exc:
                self.stats.bus_retries += 1
                log.warning("NATS unavailable (%s); retrying", exc)
                await backoff.sleep(done)
                continue
            backoff.reset()
            if not msgs:
                if time.monotonic() - idle_since > _WATCHDOG_S:
                    idle_since = time.monotonic()
                    await self._watchdog()
                continue
            idle_since = time.monotonic()
            for part in bounded(msgs, _MAX_BATCH_BYTES, self._part):
                await batches.put(await self._prepare(part))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Decode nothing meanwhile (at most the slice under way finishes)."""
        self._free.clear()
        try:
            yield
        finally:
            self._free.set()

    async def ack(self, batch: Batch) -> bool:
        """Acknowledge ``batch`` (appended) and everything delivered before it."""
        return await self._consumer.ack_through(batch.last, batch.epoch)

    async def _prepare(self, msgs: list[Delivery]) -> Batch:
        epoch = self._consumer.epoch
        events: list[EnvelopeBase] = []
        letters: list[DeadLetter] = []
        origins: list[Delivery] = []
        encoded: list[bytes] | None = []
        for start in range(0, len(msgs), _SLICE):
            first = len(events)
            decode_into(msgs[start : start + _SLICE], events, letters, origins)
            rows = self._encode(events, origins, letters, first)
            if rows is None or encoded is None:
                encoded = None
            else:
                encoded.extend(rows)
            await asyncio.sleep(0)
            await self._free.wait()
        return Batch(events, encoded, origins, letters, last=msgs[-1], size=len(msgs), epoch=epoch)

    def _encode(
        self,
        events: list[EnvelopeBase],
        origins: list[Delivery],
        letters: list[DeadLetter],
        first: int,
    ) -> list[bytes] | None:
        """Pre-encode ``events[first:]``; one that cannot be encoded (a value the schema let
        through by mistake) becomes a dead letter instead of stopping the fetcher."""
        try:
            return self._appender.encode(events[first:])
        except Exception:
            log.exception("encoding a slice failed; encoding its events one at a time")
        rows: list[bytes] = []
        kept = first
        for event, origin in zip(events[first:], origins[first:], strict=True):
            try:
                row = self._appender.encode([event])
            except Exception as exc:
                letters.append(refused_letter(event, StoreRefused(f"unencodable: {exc}"), origin))
                continue
            events[kept], origins[kept] = event, origin
            kept += 1
            if row is not None:
                rows.extend(row)
        del events[kept:], origins[kept:]
        return rows if len(rows) == kept - first else None

    async def _watchdog(self) -> None:
        # A pull subscription can go deaf after a server restart (nats.py #504).
        try:
            pending = await self._consumer.pending()
        except Exception as exc:
            log.debug("watchdog could not read consumer info: %s", exc)
            return
        if pending:
            log.warning("%d messages pending but none fetched; re-subscribing", pending)
            await self._consumer.reset()

    def count(self, batch: Batch, result: AppendResult) -> None:
        """Count an appended batch (``stats``), and log its sequence gaps."""
        stats = self.stats
        stats.batches += 1
        stats.messages += batch.size
        stats.largest = max(stats.largest, batch.size)
        stats.stored += len(result.stored)
        stats.duplicates += result.duplicates
        stats.dead_letters += result.dead_letters
        stats.gaps += len(result.gaps)
        stats.late += result.late
        if result.stored:
            stats.last_position = result.stored[-1].position
        stats.last_commit_monotonic = time.monotonic()
        for gap in result.gaps:
            log.warning(
                "sequence gap from %s (incarnation %s): %d events after seq %d not received",
                gap.source, gap.incarnation, gap.missing, gap.after_seq,
                extra=about(job=gap.job_id),
            )  # fmt: skip
