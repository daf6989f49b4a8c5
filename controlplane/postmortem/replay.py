"""Replay a log file with no server: fold it into a job's view up to a point, or re-decide
it under another policy (the pure part is ``controlplane.core.replay.counterfactual``). A big
file is read by two processes taking turns where there are two CPUs (``replay_file``)."""

from __future__ import annotations

import io
import itertools
import logging
import multiprocessing
import operator
import os
import pickle
import queue
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controlplane import gctune
from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView
from controlplane.postmortem.logfile import LogFormatError, decode_line, read_blocks
from schemas.overrides import parse_overrides as policy_overrides

#: Events folded at a time: the fold copies a view's top-level containers once per call.
FOLD_CHUNK = 4096

log = logging.getLogger(__name__)


class ReplayError(ValueError):
    """A replay that cannot be done as asked (no such job, several jobs, a bad --until)."""


Until = int | datetime


def parse_until(text: str) -> Until:
    """``--until``: a position (an integer), or a time (ISO 8601; UTC when it has no offset)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ReplayError(
            f"--until {text!r}: expected a position (an integer) or an ISO 8601 time,"
            " e.g. 2026-01-01T12:00:05Z"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def parse_overrides(text: str) -> dict[str, object]:
    """``--policy``: ``key=value,...`` (``schemas.overrides``); ReplayError when malformed."""
    try:
        return policy_overrides(text)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None


def _one_job(events: Iterable[StoredEvent], job_id: str | None) -> Iterator[StoredEvent]:
    """The events of ``job_id``, or of the only job of the log (an error at the first event
    of a second job)."""
    if job_id is not None:
        for stored in events:
            if stored.event.job_id == job_id:
                yield stored
        return
    first: str | None = None
    for stored in events:
        job = stored.event.job_id
        if first is None:
            first = job
        elif job != first:
            raise _several_jobs(first, job)
        yield stored


def _several_jobs(first: str, other: str) -> ReplayError:
    return ReplayError(f"the log holds several jobs ({first}, {other}, ...): choose one with --job")


@dataclass(slots=True)
class Replayed:
    """A job's view folded from a log up to a point."""

    job_id: str
    view: JobView
    #: Events of the job folded (those after the point are not).
    events: int
    #: True when the log went on after the point (``--until``).
    stopped: bool = False
    #: Times a replay in two processes handed the view from one to the other.
    handovers: int = 0


_job_of = operator.attrgetter("event.job_id")
_position_of = operator.attrgetter("position")
_recorded_at_of = operator.attrgetter("recorded_at")


class _Replay:
    """``replay_log`` between two lists of events: what was folded so far and what waits to
    be. Picklable once ``flush``ed (``replay_file`` hands it between processes)."""

    __slots__ = ("chunk", "count", "first_job", "job_id", "pending", "stopped", "until", "view")

    def __init__(self, job_id: str | None, until: Until | None, chunk: int) -> None:
        self.job_id = job_id
        self.until = until
        self.chunk = chunk
        self.view: JobView | None = None
        self.count = 0
        self.stopped = False
        #: The log's job (``job_id`` None): a second one is an error.
        self.first_job: str | None = None
        self.pending: list[StoredEvent] = []

    def __getstate__(self) -> dict[str, object]:
        assert not self.pending, "flush before handing on"
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def feed(self, events: list[StoredEvent]) -> bool:
        """Take the next events of the log (in order); False once past the point (``until``):
        the events after it are not for this replay. Each step is what ``_one_job`` and the
        loop of ``replay_log`` do event by event, with C-level loops over the list."""
        if not events:
            return True
        jobs = list(map(_job_of, events))
        if self.job_id is not None:
            if jobs.count(self.job_id) != len(jobs):
                events = list(itertools.compress(events, map(self.job_id.__eq__, jobs)))
            other = len(events)  # none: other jobs' events are skipped
        else:
            if self.first_job is None:
                self.first_job = jobs[0]
            other = len(events)
            if jobs.count(self.first_job) != len(jobs):
                # The first event of a second job: an error, unless the point comes first.
                other = list(map(self.first_job.__ne__, jobs)).index(True)
        cut = len(events)
        until = self.until
        if until is not None:
            key = _position_of if isinstance(until, int) else _recorded_at_of
            later = list(map(until.__lt__, map(key, events)))
            if True in later:
                cut = later.index(True)
        if other < len(events) and other < cut:
            assert self.first_job is not None
            raise _several_jobs(self.first_job, jobs[other])
        if cut < len(events):
            events = events[:cut]
            self.stopped = True
        self.pending += events
        if len(self.pending) >= self.chunk:
            self.flush()
        return not self.stopped

    def flush(self) -> None:
        """Fold what is pending."""
        pending = self.pending
        for at in range(0, len(pending), self.chunk):
            part = pending[at : at + self.chunk]
            self.view = fold(self.view, part)
            self.count += len(part)
        self.pending = []

    def result(self) -> Replayed:
        self.flush()
        if self.view is None:
            what = f"job {self.job_id!r}" if self.job_id is not None else "any job"
            where = f" up to {_until_text(self.until)}" if self.until is not None else ""
            raise ReplayError(f"the log holds no event of {what}{where}")
        return Replayed(self.view.job_id, self.view, self.count, self.stopped)


def replay_blocks(
    blocks: Iterable[list[StoredEvent]],
    *,
    job_id: str | None = None,
    until: Until | None = None,
    chunk: int = FOLD_CHUNK,
) -> Replayed:
    """``replay_log`` of a log given as lists of events (``logfile.read_blocks``)."""
    replay = _Replay(job_id, until, chunk)
    for block in blocks:
        if not replay.feed(block):
            break
    return replay.result()


def _batches(events: Iterable[StoredEvent], size: int) -> Iterator[list[StoredEvent]]:
    """``events`` in lists of ``size``; when ``events`` raises, the events before it come
    first (the point of a replay may lie among them, and then there is no error)."""
    batch: list[StoredEvent] = []
    try:
        for stored in events:
            batch.append(stored)
            if len(batch) >= size:
                yield batch
                batch = []
    except Exception:
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def replay_log(
    events: Iterable[StoredEvent],
    *,
    job_id: str | None = None,
    until: Until | None = None,
    chunk: int = FOLD_CHUNK,
) -> Replayed:
    """Fold one job's events (``job_id``, or the log's only job) up to position or time
    ``until`` inclusive (None: all of them): the view the control plane had then."""
    return replay_blocks(_batches(events, chunk), job_id=job_id, until=until, chunk=chunk)


#: Parts of a file each process of a two-process replay reads and folds in turn.
PART_BYTES = 4 << 20
#: A process of a two-process replay goes on alone once the view it received took longer to
#: come than this many times its part took to read (``_TwoProcesses``).
HANDOVER_SHARE = 1.0
#: Seconds between looks at whether the other process of a replay is still there.
_POLL_S = 0.5


def replay_file(
    path: str | Path,
    *,
    job_id: str | None = None,
    until: Until | None = None,
    source: str = "",
    progress: Callable[[int], None] | None = None,
    processes: int | None = None,
    part_bytes: int = PART_BYTES,
) -> Replayed:
    """``replay_log`` of a log file (what ``elasticctl replay`` runs); ``progress`` is called
    with the bytes read since its last call.

    With two CPUs (``processes``: None to use two where there are, 1 for one) and a file of
    several ``part_bytes`` parts, two processes take turns: the file is cut into parts at line
    ends, each process reads and validates its next part (every other one) while the other
    folds, then folds it once the other hands it the view so far (a pickled ``_Replay``:
    what crosses is one view per part, never the events). The result, and the first error
    (with its line number), are the ones reading the file in one go gives.
    """
    path = Path(path)
    size = path.stat().st_size
    if replay_processes(size, processes, part_bytes) < 2:
        with path.open("rb") as stream:
            blocks = read_blocks(stream, source=source, progress=progress)
            return replay_blocks(blocks, job_id=job_id, until=until)
    parts = _cut(path, size, part_bytes)
    return _TwoProcesses(path, source, parts, _Replay(job_id, until, FOLD_CHUNK), progress).run()


def replay_processes(size: int, processes: int | None = None, part_bytes: int = PART_BYTES) -> int:
    """How many processes ``replay_file`` replays a file of ``size`` bytes with."""
    if processes is None:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux: the CPUs this may use
        processes = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    if size < 2 * part_bytes or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return min(processes, 2)


@dataclass(frozen=True, slots=True)
class _Part:
    start: int
    end: int
    #: The position of the last line before the part, as far as it reads (else 0): the
    #: ``previous`` its lines are read against before the turn comes; read again if wrong.
    previous: int


def _cut(path: Path, size: int, part_bytes: int) -> list[_Part]:
    """``path`` in parts of about ``part_bytes``, each starting at the start of a line."""
    starts = [0]
    with path.open("rb") as stream:
        while starts[-1] + part_bytes < size:
            stream.seek(starts[-1] + part_bytes - 1)
            stream.readline()  # to the end of the line holding that byte
            if stream.tell() >= size:
                break
            starts.append(stream.tell())
        parts = []
        for start, end in itertools.pairwise([*starts, size]):
            previous = 0
            if start:
                stream.seek(max(start - (64 << 10), 0))
                before = stream.read(start - stream.tell()).splitlines()
                last = next((line for line in reversed(before) if line.strip()), b"")
                with suppress(ValueError):
                    previous = decode_line(last).position
            parts.append(_Part(start, end, previous))
    return parts


@dataclass(slots=True)
class _Read:
    """A part read and validated, before its turn."""

    blocks: list[list[StoredEvent]]
    #: The first bad line (numbered from the part's first line), after ``blocks``.
    error: LogFormatError | None
    lines: int
    #: The ``previous`` it was read against.
    previous: int


@dataclass(slots=True)
class _Baton:
    """What the process whose turn it is holds."""

    replay: _Replay
    #: The position of the last event read (of any job), and the lines before the next part.
    previous: int = 0
    lines: int = 0
    #: When it was last handed on (``time.monotonic``: the same clock in both processes),
    #: and how long that took, from before it was pickled to after it was unpickled.
    handed_at: float = 0.0
    handover_s: float = 0.0
    handovers: int = 0


class _TwoProcesses:
    """``replay_file`` with two processes; ``run`` in the parent. The child (forked) takes
    the even parts, the parent the odd ones; each turn is ``_turn``.

    Two processes gain only while handing the view over costs less than reading a part:
    the hand-over (pickling the view, sending it, unpickling it) stands between two folds,
    the reading does not. A large job's view (16,384 members: some 25 MB pickled, over a
    second to hand over) costs more than a part of its log takes to read, so the process
    that finds, after a turn, that the view it received took longer to come than its part
    took to read goes on alone with every part left (the other's read-ahead is dropped)."""

    def __init__(
        self,
        path: Path,
        source: str,
        parts: list[_Part],
        replay: _Replay,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.path = path
        self.source = source
        self.parts = parts
        self.replay = replay
        self.progress = progress
        #: Bytes ``progress`` was told of.
        self.reported = 0

    def _read(self, part: _Part, previous: int) -> _Read:
        with self.path.open("rb") as stream:
            stream.seek(part.start)
            data = stream.read(part.end - part.start)
        lines = data.count(b"\n") + (not data.endswith(b"\n"))
        blocks: list[list[StoredEvent]] = []
        error = None
        try:
            blocks.extend(read_blocks(io.BytesIO(data), source=self.source, previous=previous))
        except LogFormatError as exc:
            error = exc
        return _Read(blocks, error, lines, previous)

    def _turn(self, baton: _Baton, part: _Part, read: _Read) -> bool:
        """Fold ``read`` into ``baton``; False when the replay ends here (the point)."""
        if read.previous != baton.previous:
            read = self._read(part, baton.previous)
        for block in read.blocks:
            if not baton.replay.feed(block):
                return False
            if block:
                baton.previous = block[-1].position
        if read.error is not None:
            raise read.error.moved(baton.lines)
        baton.lines += read.lines
        return True

    def _take_turns(self, mine: range, receive: Callable[[int], _Baton | None],
                    hand_on: Callable[[_Baton], None]) -> _Baton | None:  # fmt: skip
        """Play the parts ``mine`` as their turns come; the baton when the replay ended in
        one of them (or went on alone to its end), None when the other process has it."""
        last = len(self.parts) - 1
        for index in mine:
            part = self.parts[index]
            reading = time.monotonic()
            read = self._read(part, part.previous)
            read_s = time.monotonic() - reading
            baton = _Baton(self.replay) if index == 0 else receive(index)
            if baton is None:
                return None  # the replay ended in the other process
            if not self._turn(baton, part, read) or index == last:
                return baton
            baton.replay.flush()
            self._report(part.end)
            if baton.handover_s > HANDOVER_SHARE * read_s:
                log.info(
                    "replay: the view took %.2f s to hand over, a part %.2f s to read: one"
                    " process from part %d of %d", baton.handover_s, read_s, index + 2,
                    len(self.parts),
                )  # fmt: skip
                del read
                return self._alone(baton, index + 1)
            baton.handovers += 1
            baton.handed_at = time.monotonic()
            hand_on(baton)
            # Freed now, not once the next part is read too, and a block at a time: ``put``
            # leaves the sending to the queue's feeder thread, which needs the GIL, and one
            # ``clear()`` of a part (some 30 ms of deallocation in one C call) kept the other
            # process waiting for the baton as long, at every turn.
            blocks = read.blocks
            while blocks:
                blocks.pop()
        return None

    def _alone(self, baton: _Baton, first: int) -> _Baton:
        """Read and fold the parts from ``first`` on in this process."""
        for part in self.parts[first:]:
            if not self._turn(baton, part, self._read(part, baton.previous)):
                break
            self._report(part.end)
        return baton

    @staticmethod
    def _received(baton: _Baton) -> _Baton:
        """``baton`` as it arrives: how long it took to come."""
        baton.handover_s = time.monotonic() - baton.handed_at
        return baton

    def run(self) -> Replayed:
        # No collections (in the child too): a part read ahead keeps its events, some
        # hundred thousand tracked objects, alive until its turn (gctune.held_off).
        with gctune.held_off():
            return self._run()

    def _run(self) -> Replayed:
        context = multiprocessing.get_context("fork")
        to_child: Any = context.Queue()
        to_parent: Any = context.Queue()
        child = context.Process(target=self._child, args=(to_child, to_parent), daemon=True)
        child.start()
        try:

            def receive(index: int) -> _Baton:
                kind, value = self._receive(to_parent, child)
                if kind != "baton":
                    raise _Ended(kind, value)
                assert isinstance(value, _Baton)
                self._report(self.parts[index - 1].end)
                return self._received(value)

            try:
                baton = self._take_turns(
                    range(1, len(self.parts), 2), receive, lambda b: to_child.put(_dumps(b))
                )
                if baton is None:
                    raise _Ended(*self._receive(to_parent, child))
            except _Ended as ended:
                if isinstance(ended.value, BaseException):
                    raise ended.value from None
                assert isinstance(ended.value, _Baton)
                baton = ended.value
            self._report(self.parts[-1].end)
            result = baton.replay.result()
            result.handovers = baton.handovers
            return result
        finally:
            if child.is_alive():
                child.kill()
            child.join()
            for channel in (to_child, to_parent):
                channel.close()
                channel.cancel_join_thread()

    def _child(self, inbox: Any, outbox: Any) -> None:
        """The child: the even parts; the batons, and how the replay ended, to the parent."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it (Ctrl-C included)
        self.progress = None

        parent = os.getppid()

        def receive(index: int) -> _Baton:
            while True:
                try:
                    baton = pickle.loads(inbox.get(timeout=_POLL_S))
                except queue.Empty:
                    if os.getppid() != parent:  # the parent is gone (killed): so is the replay
                        os._exit(1)
                    continue
                assert isinstance(baton, _Baton)
                return self._received(baton)

        try:
            baton = self._take_turns(
                range(0, len(self.parts), 2), receive, lambda b: outbox.put(_dumps(("baton", b)))
            )
            if baton is not None:
                baton.replay.flush()
                outbox.put(_dumps(("end", baton)))
        except Exception as exc:  # the parent raises it
            try:
                message = _dumps(("error", exc))
            except Exception:
                message = _dumps(("error", RuntimeError(f"replay: {exc!r}")))
            outbox.put(message)
        outbox.close()
        outbox.join_thread()

    def _receive(self, inbox: Any, child: Any) -> tuple[str, object]:
        while True:
            try:
                kind, value = pickle.loads(inbox.get(timeout=_POLL_S))
            except queue.Empty:
                if not child.is_alive():
                    raise RuntimeError(
                        f"the replay's second process exited ({child.exitcode})"
                    ) from None
                continue
            return str(kind), value

    def _report(self, end: int) -> None:
        if self.progress is not None and end > self.reported:
            self.progress(end - self.reported)
            self.reported = end


class _Ended(Exception):
    def __init__(self, kind: str, value: object) -> None:
        self.kind = kind
        self.value = value


def _dumps(value: object) -> bytes:
    return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)


def job_events(events: Iterable[StoredEvent], job_id: str | None = None) -> list[StoredEvent]:
    """Every event of one job (``job_id``, or the log's only job), for a counterfactual."""
    out = list(_one_job(events, job_id))
    if not out:
        what = f"job {job_id!r}" if job_id is not None else "any job"
        raise ReplayError(f"the log holds no event of {what}")
    return out


def _until_text(until: Until) -> str:
    return f"position {until}" if isinstance(until, int) else until.isoformat()


__all__ = [
    "ReplayError",
    "Replayed",
    "job_events",
    "parse_overrides",
    "parse_until",
    "replay_blocks",
    "replay_file",
    "replay_log",
    "replay_processes",
]
