"""The JSONL log file: one stored event per line, in position order.

A line is a JSON object: ``position`` and ``recorded_at`` (what the store added: the event's
place in the log and when it was committed, UTC), then the envelope as published
(``event_id``, ``job_id``, ``type``, ``v``, ``source``, ``incarnation``, ``seq``,
``generation``, ``emitted_at``, ``payload``)::

    {"position":7,"recorded_at":"2026-01-01T00:00:01.5Z","event_id":"…","job_id":"job1",
     "type":"member.heartbeat","v":1,"source":"n0/m0","incarnation":"i1","seq":3,
     "generation":1,"emitted_at":"2026-01-01T00:00:01.49Z","payload":{"step":3,"phase":"train"}}

(one line in the file). The writer puts ``position`` and ``recorded_at`` first; the reader
accepts the keys in any order. Every envelope is validated by the schemas exactly as the
ingest validates what members publish (``schemas.events``, strict JSON mode), so a bad line is
an error naming its line number, never an event half understood. Blank lines are skipped.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any, BinaryIO, cast

from pydantic import ValidationError

from controlplane.core.records import StoredEvent
from controlplane.decode import explain
from schemas.events import EVENT_ADAPTER

#: What the writer puts in front of the envelope's own fields (the reader's fast path).
_PREFIX = re.compile(rb'\{"position":(\d{1,19}),"recorded_at":"([^"\\]{1,64})",')
#: Progress is reported after this many lines (and at the end).
PROGRESS_EVERY = 4096
#: Bytes read from a file at a time; its whole lines are decoded together (see ``read_log``).
BLOCK_BYTES = 1 << 18
_VALIDATE = EVENT_ADAPTER.validator.validate_json


class LogFormatError(ValueError):
    """A line of a log file that is not a stored event, with where it is."""

    def __init__(self, message: str, *, line: int, source: str = "") -> None:
        self.message = message
        self.line = line
        self.source = source
        where = f"{source}:{line}" if source else f"line {line}"
        super().__init__(f"{where}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (keyword-only arguments): a replay worker process hands it on.
        return _log_format_error, (self.message, self.line, self.source)

    def moved(self, lines: int) -> LogFormatError:
        """The same error ``lines`` further down (a part of a file read on its own)."""
        return LogFormatError(self.message, line=self.line + lines, source=self.source)


def _log_format_error(message: str, line: int, source: str) -> LogFormatError:
    return LogFormatError(message, line=line, source=source)


def _iso(moment: datetime) -> str:
    text = moment.astimezone(UTC).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def encode_line(stored: StoredEvent) -> bytes:
    """One line of the file (newline included) for a stored event."""
    body = stored.event.model_dump_json()
    return b'{"position":%d,"recorded_at":"%s",%s\n' % (
        stored.position,
        _iso(stored.recorded_at).encode(),
        body[1:].encode(),
    )


def write_log(stream: BinaryIO, events: Iterable[StoredEvent]) -> int:
    """Write ``events`` as lines; return how many."""
    count = 0
    write = stream.write
    for stored in events:
        write(encode_line(stored))
        count += 1
    return count


def _recorded_at(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"recorded_at {text!r} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        raise ValueError(f"recorded_at {text!r} has no UTC offset")
    return moment


def _position(value: Any) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"position must be an integer >= 1, not {value!r}")
    return value


def _slow(line: bytes) -> StoredEvent:
    """Any key order: take position and recorded_at out, validate the rest as the envelope."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    for key in ("position", "recorded_at"):
        if key not in obj:
            raise ValueError(f"missing {key} (a line is a stored event: the envelope plus "
                             "position and recorded_at)")  # fmt: skip
    position = _position(obj.pop("position"))
    recorded = obj.pop("recorded_at")
    if not isinstance(recorded, str):
        raise ValueError(f"recorded_at must be a string, not {recorded!r}")
    at = _recorded_at(recorded)
    try:
        event = EVENT_ADAPTER.validate_json(json.dumps(obj))
    except ValidationError as exc:
        raise ValueError(explain(exc)) from None
    return StoredEvent(position, at, event)


def decode_line(line: bytes) -> StoredEvent:
    """A stored event from one line; ``ValueError`` saying what is wrong otherwise."""
    match = _PREFIX.match(line)
    if match is None:
        return _slow(line)
    try:
        event = EVENT_ADAPTER.validate_json(b"{" + line[match.end() :])
    except ValidationError as exc:
        raise ValueError(explain(exc)) from None
    return StoredEvent(
        _position(int(match[1])), _recorded_at(match[2].decode("ascii", "replace")), event
    )


def _new_stored(count: int) -> list[StoredEvent]:
    """``count`` blank stored events, their fields to be set by ``_set_*`` (see below)."""
    return list(map(object.__new__, itertools.repeat(StoredEvent, count)))


# A block's stored events are built field by field with C-level loops (``map`` over the slots'
# setters): a frozen dataclass's ``__init__`` costs about twice as much. This is only valid
# while StoredEvent is exactly these three slots, with nothing else done on construction.
assert [f.name for f in fields(StoredEvent)] == ["position", "recorded_at", "event"]
assert not hasattr(StoredEvent, "__post_init__")
_set_position = StoredEvent.__dict__["position"].__set__
_set_recorded_at = StoredEvent.__dict__["recorded_at"].__set__
_set_event = StoredEvent.__dict__["event"].__set__
_ascii = operator.methodcaller("decode", "ascii")
_tzinfo = operator.attrgetter("tzinfo")
_first = operator.itemgetter(1)
_second = operator.itemgetter(2)
_end = operator.methodcaller("end")


def _decode_block(lines: list[bytes], previous: int) -> list[StoredEvent] | None:
    """The stored events of a block of ``lines``, decoded together with C-level loops
    (``map``): the same steps as ``_decode_lines`` without a Python loop around them. Each
    envelope is still validated on its own. None when any line is not of the writer's form or
    not valid (blank, keys in another order, a bad line...): the caller then goes line by
    line, which finds the first bad line and says what is wrong with it.
    """
    found = list(map(_PREFIX.match, lines))
    if not found or None in found:
        return None
    matches = cast("list[re.Match[bytes]]", found)
    try:
        positions = list(map(int, map(_first, matches)))
        if positions[0] <= previous or not all(
            map(operator.lt, positions, itertools.islice(positions, 1, None))
        ):
            return None
        times = list(map(datetime.fromisoformat, map(_ascii, map(_second, matches))))
        if None in map(_tzinfo, times):
            return None
        # "{" + the envelope's own fields, as _decode_lines validates them.
        starts = map(slice, map(_end, matches), itertools.repeat(None))
        rests = cast("Iterator[bytes]", map(operator.getitem, lines, starts))
        events = list(map(_VALIDATE, map(b"{".__add__, rests)))
    except ValueError:  # ValidationError and UnicodeDecodeError are ValueErrors
        return None
    stored = _new_stored(len(events))
    deque(map(_set_position, stored, positions), maxlen=0)
    deque(map(_set_recorded_at, stored, times), maxlen=0)
    deque(map(_set_event, stored, events), maxlen=0)
    return stored


def read_blocks(
    stream: BinaryIO,
    *,
    source: str = "",
    progress: Callable[[int], None] | None = None,
    first: int = 1,
    previous: int = 0,
) -> Iterator[list[StoredEvent]]:
    """``read_log`` of a binary file, a list of stored events at a time (one per
    ``BLOCK_BYTES`` or so read; possibly empty). ``first`` is the number of the file's first
    line and ``previous`` the position before it (a part of a file read on its own)."""
    readlines = stream.readlines
    number = first - 1  # lines before this block
    while lines := readlines(BLOCK_BYTES):
        stored = _decode_block(lines, previous)
        if stored is None:
            # Line by line: the events before a bad line, then the error naming it.
            stored = []
            try:
                stored.extend(
                    _decode_lines(lines, source=source, first=number + 1, previous=previous)
                )
            except LogFormatError:
                if stored:
                    yield stored
                raise
        number += len(lines)
        if stored:
            previous = stored[-1].position
        if progress is not None:
            progress(sum(map(len, lines)))
        yield stored


def read_log(
    lines: Iterable[bytes],
    *,
    source: str = "",
    progress: Callable[[int], None] | None = None,
) -> Iterator[StoredEvent]:
    """The stored events of a log file's lines (an open binary file is such an iterable), in
    order; streaming.

    Raises ``LogFormatError`` (with the line number) on the first line that is not a stored
    event, or whose position is not above the previous line's: a log file is in position
    order; the events before that line come first. ``progress`` is called now and then with
    the bytes read since its last call.

    A binary file (anything with ``readlines``) is read ``BLOCK_BYTES`` or so at a time and the
    lines of a block are decoded together (``bench replay`` measures this); any other
    iterable, one line at a time. Either way each line is validated on its own, as the
    ingest validates an envelope.
    """
    if callable(getattr(lines, "readlines", None)):
        stream = cast("BinaryIO", lines)
        return itertools.chain.from_iterable(read_blocks(stream, source=source, progress=progress))
    return _decode_lines(lines, source=source, progress=progress)


def _decode_lines(
    lines: Iterable[bytes],
    *,
    source: str,
    first: int = 1,
    previous: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Iterator[StoredEvent]:
    """``read_log`` one line at a time; ``first`` is the number of the first line and
    ``previous`` the position before it."""
    pending = 0
    validate = _VALIDATE
    prefix = _PREFIX.match
    # Events committed together share their recorded_at: parse each time once.
    last_raw, last_at = b"", datetime.min
    for number, line in enumerate(lines, start=first):
        pending += len(line)
        # decode_line's fast path, inlined.
        match = prefix(line)
        try:
            if match is not None:
                try:
                    event = validate(b"{" + line[match.end() :])
                except ValidationError as exc:
                    raise ValueError(explain(exc)) from None
                position = int(match[1])
                raw = match[2]
                if raw != last_raw:
                    last_at = _recorded_at(raw.decode("ascii", "replace"))
                    last_raw = raw
                stored = StoredEvent(position, last_at, event)
            elif line.strip():
                stored = _slow(line)
                position = stored.position
            else:
                continue
        except ValueError as exc:
            raise LogFormatError(str(exc), line=number, source=source) from None
        if position <= previous:
            raise LogFormatError(
                f"position {position} after {previous}: a log file is in position order"
                " (one log, each event once)",
                line=number,
                source=source,
            )
        previous = position
        if progress is not None and number % PROGRESS_EVERY == 0:
            progress(pending)
            pending = 0
        yield stored
    if progress is not None and pending:
        progress(pending)


__all__ = [
    "LogFormatError",
    "decode_line",
    "encode_line",
    "read_blocks",
    "read_log",
    "write_log",
]
