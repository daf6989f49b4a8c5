"""The decider service: runs the pure ``decide`` over the live views, records, then publishes.

Each turn (given by the service loop between two commits, ``service.Session``) it reads the
clock once, asks the core what is due for every job, appends each job's decisions as one
batch with the job's last position as the expected head (a writer it did not see makes the
append fail: the view is refreshed from the log and the next turn decides again), folds what
was stored into the views, and only then hands the commands owed by the new views to the
publisher (which builds only those due, and which the turn gives a moment to get them out).
A turn is wanted after every commit that stored something that may make a decision due (not
heartbeats, nor steps of a job without an open incident: ``core.decide.wakes``), and at the
earliest deadline any job has (a heartbeat timeout, a recovery deadline), so a timeout is
acted on when it expires, not at the next poll.

Heartbeats are soft state (``core/liveness.py``): with a ``LivenessTable``, each turn asks
whether anything is due of the job's probe (its view with the table's heartbeats; the view
itself stays the log's), records a ``liveness.summary`` before any decision and decides on
the view that folded it (so the log holds what the decision read, and a replay decides the
same), and records one every ``liveness_summary_interval_s`` otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import nats.errors
from nats.js import JetStreamContext

from controlplane.core.commands import Owed, owing
from controlplane.core.compact import compacted
from controlplane.core.decide import Context, Decided, decide, envelope, next_deadline, wakes
from controlplane.core.fold import fold
from controlplane.core.liveness import LivenessTable
from controlplane.core.records import StoredEvent
from controlplane.core.statemachine import TERMINAL
from controlplane.core.view import JobView
from controlplane.errors import ConcurrencyError, StoreUnavailable
from controlplane.store.port import Appender, AppendResult, JobHead
from schemas.auth import SIGNATURE_HEADER, CommandSigner, command_message
from schemas.common import CONTROLPLANE_SOURCE, FaultReason
from schemas.events import EnvelopeBase, LivenessSummaryEvent
from schemas.ids import new_event_id
from schemas.logjson import about
from schemas.subjects import MSG_ID_HEADER, command_subject

log = logging.getLogger(__name__)

#: A decision taking longer than this is logged as a warning (else at INFO) with where its
#: time went.
SLOW_TURN_S = 0.1
#: How long a turn waits for the commands it published to be acknowledged by JetStream.
SETTLE_S = 0.25
#: A silence found while the event stream does not answer is looked at again this soon.
POSTPONE_S = 0.25


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(slots=True)
class DeciderStats:
    """What the decider did since start."""

    turns: int = 0
    #: Decision batches appended, and events in them.
    batches: int = 0
    decisions: int = 0
    conflicts: int = 0
    commands_published: int = 0
    #: ``liveness.summary`` events appended.
    summaries: int = 0
    #: Decisions that found a silence, judged again once the queued heartbeats were taken.
    hearings: int = 0
    #: Silences left for a later turn because the event stream was not answering.
    postponed: int = 0


class CommandPublisher:
    """Publishes owed commands to JetStream and re-publishes what stays owed.

    A command is (re)sent when it was never sent, or when it is still owed ``retry_s`` after
    its last send (a member that missed it, a stream that lost it). ``Nats-Msg-Id`` is the
    command id: JetStream drops a copy inside its duplicate window, members drop the rest.
    """

    def __init__(
        self, js: JetStreamContext, retry_s: float, *, signer: CommandSigner | None = None
    ) -> None:
        self._js = js
        self._retry_s = retry_s
        #: Signs every command (``Elastic-Signature``); None: commands go unsigned.
        self._signer = signer
        if signer is None:
            log.warning(
                "commands are published unsigned: ELASTIC_SECRET is unset, so members cannot"
                " tell the control plane's commands from anyone else's"
            )
        self._sent: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.published = 0

    def offer(self, job_id: str, commands: list[Owed]) -> None:
        """Send each of ``commands`` that is due; one sent less than ``retry_s`` ago is not
        even built."""
        now = time.monotonic()
        for command in commands:
            key = command.command_id
            last = self._sent.get(key)
            if last is not None and now - last < self._retry_s:
                continue
            self._sent[key] = now
            data = command.build().model_dump_json()
            task = asyncio.ensure_future(self._send(job_id, key, data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def settle(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the sends in flight to be acknowledged."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    async def _send(self, job_id: str, key: str, data: str) -> None:
        subject = command_subject(job_id)
        body = data.encode()
        headers = {MSG_ID_HEADER: key}
        if self._signer is not None:
            headers[SIGNATURE_HEADER] = self._signer.sign(command_message(subject, body))
        try:
            await self._js.publish(subject, body, headers=headers)
            self.published += 1
        except nats.errors.MaxPayloadError:
            # Sent again it fails again: say what to change (deploy/nats/nats.conf).
            log.error("command %s for %s is %d bytes, over the NATS server's max_payload: raise"
                      " it (max_payload: 8MB takes a job of 16,384 ranks); it will be sent"
                      " again", key, job_id, len(body), extra=about(job=job_id))  # fmt: skip
            self._sent.pop(key, None)
        except Exception as exc:
            log.warning(
                "publishing command %s failed (%s); it will be sent again", key, exc,
                extra=about(job=job_id),
            )  # fmt: skip
            self._sent.pop(key, None)

    def forget(self, keep: set[str]) -> None:
        """Drop the send times of commands no longer owed."""
        for key in [k for k in self._sent if k not in keep]:
            del self._sent[key]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


#: The status a process leaves with at an injected control-plane fault (a kill's 128 + 9).
FAULT_EXIT_STATUS = 137


class ControlFault:
    """``ELASTIC_CONTROL_FAULT`` (chaos runs and tests): the process exits, as a kill would
    (no clean-up: its lock, NATS and PostgreSQL connections end with it), at a point on the
    way out of the decision that starts a generation: once it is recorded (``record``), or
    once JetStream acknowledged its commands (``publish``), before any member acks them."""

    def __init__(self, spec: str) -> None:
        point, _, generation = spec.removeprefix("exit-after-").partition(":")
        if point not in ("record", "publish") or not generation.isdigit():
            raise ValueError(f"a control fault is exit-after-record:G or -publish:G, not {spec!r}")
        self.point = point
        self.generation = int(generation)
        self._published: str | None = None

    def recorded(self, job_id: str, decided: Sequence[Decided]) -> None:
        """``decided`` of ``job_id`` is in the log: exit now (``record``), or once its
        commands are acknowledged (``publish``)."""
        if not any(d.type == "generation.started" and d.generation == self.generation
                   for d in decided):  # fmt: skip
            return
        if self.point == "record":
            self._exit(f"recorded {job_id}'s decision that starts generation {self.generation}")
        self._published = job_id

    def published(self) -> None:
        """The turn's commands were acknowledged by JetStream (or the wait for them ended)."""
        if self._published is not None:
            self._exit(f"published {self._published}'s commands of generation {self.generation}")

    @staticmethod
    def _exit(what: str) -> None:
        log.critical("control fault (ELASTIC_CONTROL_FAULT): exiting, having %s", what)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(FAULT_EXIT_STATUS)


class Decider:
    """Decides for every job in ``views`` (a mapping the owner keeps current)."""

    def __init__(
        self,
        *,
        views: Callable[[], Mapping[str, JobView]],
        apply: Callable[[AppendResult], None],
        refresh: Callable[[str], Awaitable[None]] | None,
        appender: Appender,
        publisher: CommandPublisher | None,
        context: Context,
        clock: Callable[[], datetime] = utcnow,
        liveness: LivenessTable | None = None,
        hear: Callable[[], Awaitable[None]] | None = None,
        hold: Callable[[], AbstractContextManager[None]] | None = None,
        events_current: Callable[[], bool] | None = None,
        fault: ControlFault | None = None,
    ) -> None:
        self._views = views
        self._apply = apply
        self._refresh = refresh
        self._appender = appender
        self._publisher = publisher
        self.context = context
        self._clock = clock
        #: The heartbeats heard (soft state, core/liveness.py); None: heartbeats are events
        #: in the log (``member.heartbeat``), and only the log is read.
        self.liveness = liveness
        #: Takes into the table every heartbeat that reached NATS before the call
        #: (``HeartbeatListener.catch_up``): a silence is judged only on what could be heard.
        self._hear = hear
        #: Keeps the heartbeats arriving meanwhile for after (``HeartbeatListener.held``):
        #: around a decision's append and command, once the summary is taken.
        self._hold = hold
        #: Whether the event stream answers the ingest (``EventConsumer.answering``): while it does
        #: not (its leader failing over, JetStream without a quorum), and for a few seconds after
        #: (what members sent meanwhile is sent again), a member's last events (its exit, its
        #: backup's reports) may be on their way, and a silence is not judged.
        self._events_current = events_current
        self._postponed_since: float | None = None
        #: An injected fault (``ELASTIC_CONTROL_FAULT``), None in service.
        self._fault = fault
        #: One run of this decider: the ``incarnation`` of its events.
        self.incarnation = uuid.uuid4().hex[:16]
        self._seq: dict[str, int] = {}
        self.wanted = asyncio.Event()
        self.wanted.set()  # the first turn republishes what the log says is owed
        self.next_wake: datetime | None = None
        #: Job -> its next deadline, as this turn's probe of it found (absent: probe again).
        self._deadlines: dict[str, datetime | None] = {}
        #: The log's last position as far as this process saw (None: not yet known).
        self._head: int | None = None
        self.rescheduled = asyncio.Event()
        self.stats = DeciderStats()

    def on_commit(self, result: AppendResult) -> None:
        """Ask for a turn when a commit stored something a decision may depend on (the
        views are those before its fold, whose state and incidents members' events do not
        change)."""
        self._saw(result)
        views = self._views()
        for stored in result.stored:
            event = stored.event
            if wakes(views.get(event.job_id), event.type):
                self.wanted.set()
                return

    async def turn(self) -> None:
        """Decide for every job, record, fold, publish (between two commits of the loop).

        With a liveness table, whether anything is due is asked of the job's *probe* (its
        view with the table's heartbeats, ``LivenessTable.probe``), one round of ``decide``
        deep; only when something is, the table is summarized, the summary folded onto the
        job's view at the positions it is to take in the log, and ``decide`` runs, once, on
        that view: the log's own view once the summary and the decisions are appended, in
        one transaction (``JobHead.log``), so what is recorded is what a replay of the log
        decides. A job's commands are handed to the
        publisher as soon as its decisions are recorded and folded, before the next job is
        decided; what else is owed (a command to send again, another job's) follows once
        every job is decided."""
        self.stats.turns += 1
        now = self._clock()
        liveness = self.liveness
        self._deadlines.clear()
        for job_id, seen in list(self._views().items()):
            if seen.state in TERMINAL:
                continue
            began, cpu = time.perf_counter(), time.thread_time()
            view = seen
            checked = summarized = began
            summary: list[EnvelopeBase] = []
            head = 0
            if liveness is None:
                decided = decide(view, now, self.context)
            else:
                probe = liveness.probe(view)
                decided = decide(probe, now, self.context, rounds=1)
                if decided and _silences(decided):
                    # A silence may be this process's own: a stall (a long fold, a
                    # collection) keeps heartbeats queued unread, and every member then
                    # looks silent. Take in what reached NATS before now, then judge again.
                    if self._hear is not None:
                        await self._hear()
                        self.stats.hearings += 1
                        view = self._views().get(job_id, view)
                        probe = liveness.probe(view)
                        decided = decide(probe, now, self.context, rounds=1)
                    silent = _silent(decided)
                    if silent and not liveness.exact_for(view, probe, silent):
                        # The quick probe errs only towards silence (an earlier process's
                        # heartbeat): judge those on an exact one.
                        probe = liveness.probe(view, exact=True)
                        decided = decide(probe, now, self.context, rounds=1)
                if decided and _detects(decided) and self._stream_silent(job_id, now):
                    # While the stream does not answer, or answered again only lately, what
                    # members sent meanwhile may be on its way: their exits and completions,
                    # which tell a silence apart, and their last backups' reports, which the
                    # restore step is chosen on. A fault is judged once it is here.
                    continue
                checked = time.perf_counter()
                if not decided:
                    self._deadlines[job_id] = next_deadline(probe)
                    if now >= liveness.summary_due(
                        job_id, view.effective_policy.liveness_summary_interval_s
                    ):
                        await self._summarize(job_id, view, now, "interval")
                    continue
                # What the decision reads of the heartbeats goes into the log before it, in
                # the same append: the summary is folded here at the positions it will take
                # (right after the log's head: ``JobHead.log``), and the decision is taken
                # on the view that folded it, which is what a replay folds.
                summary = self._summary_events(job_id, view, now, "decision")
                heard = view
                if summary:
                    head = self._log_head()
                    heard = fold(
                        view, [StoredEvent(head + i, now, e) for i, e in enumerate(summary, 1)]
                    )
                summarized = time.perf_counter()
                decided = decide(heard, now, self.context)
                if not decided and summary:
                    # Nothing after all on the log's view: the summary alone is recorded.
                    if await self._summary_only(job_id, view, summary, now):
                        liveness.summarized(job_id, now, "decision")
                    continue
            if not decided:
                continue
            thought, cpu = time.perf_counter(), time.thread_time() - cpu
            # The heartbeats that arrive from here on wait until the command is handed over
            # (the summary is taken; the next turn reads them).
            with self._hold() if self._hold is not None else contextlib.nullcontext():
                appended = await self._record(
                    job_id, view, decided, now, summary=summary, head=head
                )
                if appended is None:
                    continue
                if self._fault is not None:
                    self._fault.recorded(job_id, decided)
                if summary and liveness is not None:
                    liveness.summarized(job_id, now, "decision")
                folded = time.perf_counter()
                self._offer(job_id)
                done = time.perf_counter()
            level = logging.WARNING if done - began > SLOW_TURN_S else logging.INFO
            log.log(
                level,
                "decision for %s in %.0f ms: check %.1f ms, summary %.1f ms, decide %.1f ms"
                " (%.1f ms of CPU in all three), append %.1f ms, fold %.1f ms, command %.1f ms"
                " (%d events)",
                job_id, (done - began) * 1e3, (checked - began) * 1e3,
                (summarized - checked) * 1e3, (thought - summarized) * 1e3, cpu * 1e3,
                (appended - thought) * 1e3, (folded - appended) * 1e3, (done - folded) * 1e3,
                len(decided),
            )  # fmt: skip
        self._publish()
        if self._publisher is not None:
            # The commands leave inside the turn, before the ingest (and whatever collection
            # it sets off) has the loop again.
            await self._publisher.settle(SETTLE_S)
        if self._fault is not None:
            self._fault.published()
        self._reschedule()

    def _stream_silent(self, job_id: str, now: datetime) -> bool:
        """True (and the job probed again shortly) when the event stream does not answer, or
        did not lately: the fault is judged once what members sent before it reached the log."""
        current = self._events_current
        if current is None or current():
            if self._postponed_since is not None:
                log.warning(
                    "the event stream answers again after %.1f s: silences are judged",
                    time.monotonic() - self._postponed_since,
                )
                self._postponed_since = None
            return False
        self.stats.postponed += 1
        self._deadlines[job_id] = now + timedelta(seconds=POSTPONE_S)
        if self._postponed_since is None:
            self._postponed_since = time.monotonic()
            log.warning(
                "a fault in %s waits: the event stream does not answer (a NATS node lost,"
                " say), or did not lately, and the members' last events may be on their way",
                job_id,
            )
        return True

    async def _record(
        self,
        job_id: str,
        view: JobView,
        decided: list[Decided],
        now: datetime,
        *,
        summary: Sequence[EnvelopeBase] = (),
        head: int = 0,
    ) -> float | None:
        """Append ``decided`` behind ``view`` (with ``summary`` before it, at the positions
        after the log's ``head``, in one transaction) and fold what was stored; the moment
        the append returned, or None when nothing was recorded."""
        seq = self._seq.get(job_id, 0) + len(summary)
        # Each list written against the world in force, where shorter (``core.compact``).
        events = [
            *summary,
            *(
                envelope(job_id, d, now, seq + i, self.incarnation)
                for i, d in enumerate(compacted(view, decided), start=1)
            ),
        ]
        result = await self._append(
            job_id, view, events, "decision", log_head=head if summary else None
        )
        if result is None:
            return None
        appended = time.perf_counter()
        summaries = sum(1 for s in result.stored if s.event.type == "liveness.summary")
        self.stats.summaries += summaries
        self.stats.batches += 1
        self.stats.decisions += len(result.stored) - summaries
        self._apply(result)
        for stored in result.stored:
            _log_decision(stored)
        return appended

    async def _append(
        self,
        job_id: str,
        view: JobView,
        events: Sequence[EnvelopeBase],
        what: str,
        *,
        log_head: int | None = None,
    ) -> AppendResult | None:
        """Append the control plane's ``events`` for ``job_id`` with the view's last position
        as the expected head (and ``log_head`` as the log's, when given), and advance the job's
        sequence; None when they were not recorded (another writer came first: the view is
        refreshed and a turn wanted; or the store is down: the next turn tries again)."""
        try:
            result = await self._appender.append(
                events, expected=JobHead(job_id, view.last_position, log_head)
            )
        except ConcurrencyError as exc:
            self.stats.conflicts += 1
            if exc.log_head is not None:
                # Only the log's head was not where this process last saw it (an append it
                # did not see the result of): decide again behind the head it is at.
                self._head = exc.log_head
                log.info(
                    "%s for %s not recorded: %s; deciding again", what, job_id, exc,
                    extra=about(job=job_id),
                )  # fmt: skip
            else:
                log.warning(
                    "%s for %s not recorded: %s; refreshing the view", what, job_id, exc,
                    extra=about(job=job_id),
                )  # fmt: skip
                if self._refresh is not None:
                    await self._refresh(job_id)
            self.wanted.set()
            return None
        except StoreUnavailable as exc:
            log.warning(
                "%s for %s not recorded (%s); later", what, job_id, exc, extra=about(job=job_id)
            )
            return None
        self._seq[job_id] = self._seq.get(job_id, 0) + len(events)
        self._saw(result)
        return result

    def _saw(self, result: AppendResult) -> None:
        """Follow the log's head through an append's result."""
        if result.stored:
            last = result.stored[-1].position
            if self._head is None or last > self._head:
                self._head = last

    def _log_head(self) -> int:
        """The log's last position as this process knows it: its own appends' and the
        ingest's (``on_commit``), else the views' newest (a wrong guess only costs a turn:
        the store says where the head is, ``JobHead.log``)."""
        if self._head is None:
            self._head = max((v.last_position for v in self._views().values()), default=0)
        return self._head

    def _summary_events(
        self, job_id: str, view: JobView, now: datetime, reason: str
    ) -> list[EnvelopeBase]:
        """The job's ``liveness.summary`` at ``now`` as events of this decider, numbered
        after its last (empty: nothing to summarize)."""
        assert self.liveness is not None
        parts = self.liveness.summarize(view, now, reason)
        seq = self._seq.get(job_id, 0)
        return [
            LivenessSummaryEvent(
                event_id=new_event_id(),
                job_id=job_id,
                type="liveness.summary",
                v=1,
                source=CONTROLPLANE_SOURCE,
                incarnation=self.incarnation,
                seq=seq + i,
                generation=view.generation,
                emitted_at=now,
                payload=part,
            )
            for i, part in enumerate(parts, start=1)
        ]

    async def _summary_only(
        self, job_id: str, view: JobView, events: list[EnvelopeBase], now: datetime
    ) -> bool:
        """Append the summary ``events`` alone behind ``view`` and fold them."""
        result = await self._append(job_id, view, events, "liveness")
        if result is None:
            return False
        self.stats.summaries += len(result.stored)
        self._apply(result)
        return True

    async def _summarize(self, job_id: str, view: JobView, now: datetime, reason: str) -> bool:
        """Append the job's ``liveness.summary`` at ``now`` behind ``view`` and fold it;
        True when it was recorded (or there was nothing to record)."""
        assert self.liveness is not None
        events = self._summary_events(job_id, view, now, reason)
        if events and not await self._summary_only(job_id, view, events, now):
            return False
        self.liveness.summarized(job_id, now, reason)
        return True

    def _offer(self, job_id: str) -> None:
        """Hand the commands ``job_id``'s view owes to the publisher (built only if due)."""
        view = self._views().get(job_id)
        if self._publisher is not None and view is not None:
            commands = owing(view)
            if commands:
                self._publisher.offer(job_id, commands)

    def _publish(self) -> None:
        publisher = self._publisher
        if publisher is None:
            return
        keep: set[str] = set()
        for job_id, view in self._views().items():
            commands = owing(view)
            if commands:
                keep.update(c.command_id for c in commands)
                publisher.offer(job_id, commands)
        publisher.forget(keep)

    def _reschedule(self) -> None:
        """The next wake: the earliest deadline of any job (on its probe: the table's
        liveness; a job decided in this turn is probed again) and its next summary."""
        views = self._views()
        liveness = self.liveness
        deadlines: list[datetime] = []
        for job_id, view in views.items():
            if view.state in TERMINAL:
                continue
            if job_id in self._deadlines:
                deadline = self._deadlines[job_id]
            else:
                deadline = next_deadline(liveness.probe(view) if liveness is not None else view)
            if deadline is not None:
                deadlines.append(deadline)
            if liveness is not None and view.members:
                interval = view.effective_policy.liveness_summary_interval_s
                deadlines.append(liveness.summary_due(job_id, interval))
        self.next_wake = min(deadlines, default=None)
        self.rescheduled.set()

    async def tick(self, stop: asyncio.Event, interval_s: float) -> None:
        """Want a turn at the earliest deadline, and at least every ``interval_s``."""
        while not stop.is_set():
            self.rescheduled.clear()
            delay = interval_s
            if self.next_wake is not None:
                until = (self.next_wake - self._clock()).total_seconds()
                # Just after the deadline: detection compares "silent > timeout".
                delay = min(interval_s, max(0.0, until) + 0.001)
            waiters = [asyncio.ensure_future(e.wait()) for e in (stop, self.rescheduled)]
            try:
                await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
            if self.rescheduled.is_set() and not stop.is_set():
                continue  # a new deadline: wait for it instead
            self.wanted.set()


def _log_decision(stored: StoredEvent) -> None:
    event = stored.event
    if event.type in ("member.heartbeat", "liveness.summary"):
        return
    payload = event.payload
    detail = getattr(payload, "reason", None) or getattr(payload, "detail", None) or ""
    concerns = about(
        job=event.job_id,
        member=getattr(payload, "member", None),
        incident=getattr(payload, "incident_id", None),
    )
    log.info(
        "#%d %s %s: %s", stored.position, event.job_id, event.type, str(detail)[:200],
        extra=concerns,
    )  # fmt: skip


def _silences(decided: Sequence[Decided]) -> bool:
    """Whether ``decided`` finds a member failed by its silence (a heartbeat timeout, or a
    peer's report that silence corroborates), not by an exit or its own report alone."""
    return bool(_silent(decided))


def _detects(decided: Sequence[Decided]) -> bool:
    """Whether ``decided`` finds a fault (whatever the evidence)."""
    return any(d.type == "fault.detected" for d in decided)


def _silent(decided: Sequence[Decided]) -> list[str]:
    """The members ``decided`` finds failed by a heartbeat timeout or a peer's report (which
    their silence may corroborate)."""
    return [
        member
        for d in decided
        if d.type == "fault.detected"
        and getattr(d.payload, "reason", None)
        in (FaultReason.HEARTBEAT_TIMEOUT, FaultReason.REPORTED)
        for member in getattr(d.payload, "members", ())
    ]
