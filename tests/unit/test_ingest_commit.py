"""``ingest.commit`` isolates what the store refuses down to one message (issue 20)."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
import pytest

from controlplane.core.records import DeadLetter
from controlplane.errors import SchemaNotMigrated, StoreRefused, StoreUnavailable
from controlplane.ingest import SyncAppender, commit
from controlplane.store.memory import InMemoryEventStore
from controlplane.store.port import AppendResult, JobHead
from controlplane.store.postgres import classify
from schemas.events import EnvelopeBase
from tests.factories import Events


def poisoned(event: EnvelopeBase, detail: str = "bad\u0000nul") -> EnvelopeBase:
    """``event`` turned into a member.fault holding what the schemas refuse (built past them,
    as a schema bug would let it through)."""
    ev = Events(job_id=event.job_id)
    fault = ev.make("member.fault", {"kind": "exception", "detail": "x"}, source=event.source,
                    seq=event.seq, incarnation=event.incarnation)  # fmt: skip
    return fault.model_copy(update={"payload": fault.payload.model_copy(update={"detail": detail})})


def letter(n: int, reason: str = "not JSON") -> DeadLetter:
    return DeadLetter(reason=reason, raw=b"{", subject="elastic.evt.j.n.m.t", stream_seq=n)


class Refusing(SyncAppender):
    """The in-memory store, plus dead letters refused when their reason says so; counts calls."""

    def __init__(self, store: InMemoryEventStore, refuse_letters: str | None = None) -> None:
        super().__init__(store)
        self.calls = 0
        self.refuse_letters = refuse_letters

    async def append(
        self,
        events: Sequence[EnvelopeBase],
        dead_letters: Sequence[DeadLetter] = (),
        *,
        expected: JobHead | None = None,
        encoded: Sequence[bytes] | None = None,
    ) -> AppendResult:
        self.calls += 1
        marker = self.refuse_letters
        if marker is not None and any(marker in d.reason for d in dead_letters):
            raise StoreRefused("letter refused")
        return await super().append(events, dead_letters, expected=expected, encoded=encoded)


async def test_one_refused_event_and_one_dead_letter_are_committed_apart():
    """The batch that recursed without end: one event the store refuses plus one letter."""
    store = InMemoryEventStore()
    bad = poisoned(Events().heartbeat("m0"))
    result = await commit(Refusing(store), [bad], [letter(1)])
    assert result.stored == []
    assert result.dead_letters == 2
    reasons = sorted(d.letter.reason for d in store.dead_letters())
    assert reasons[0] == "not JSON" and reasons[1].startswith("refused by the store:")


async def test_a_refused_event_is_isolated_among_many_and_order_is_kept():
    ev = Events()
    events = [ev.heartbeat("m0") for _ in range(64)]
    events[37] = poisoned(events[37])
    appender = Refusing(InMemoryEventStore())
    result = await commit(appender, events, [letter(i) for i in range(5)])
    assert [s.event for s in result.stored] == events[:37] + events[38:]
    assert [s.position for s in result.stored] == list(range(1, 64))
    assert result.dead_letters == 6
    assert len(result.gaps) == 1  # seq 38 never arrived as an event: a gap, truthfully
    # Halving: about log2(64) appends per refused event, not one per event.
    assert appender.calls <= 2 + 2 * 7


async def test_every_refused_event_becomes_a_dead_letter():
    ev = Events()
    events = [ev.heartbeat("m0") for _ in range(20)]
    bad = {3, 4, 11, 19}
    for i in bad:
        events[i] = poisoned(events[i])
    store = InMemoryEventStore()
    result = await commit(Refusing(store), events, [])
    assert len(result.stored) == 16
    assert {d.letter.event_id for d in store.dead_letters()} == {events[i].event_id for i in bad}


async def test_a_refused_dead_letter_is_replaced_by_a_minimal_one():
    store = InMemoryEventStore()
    letters = [letter(1), letter(2, "poison"), letter(3)]
    result = await commit(Refusing(store, refuse_letters="poison"), [], letters)
    assert result.dead_letters == 3
    kept = {d.letter.stream_seq: d.letter for d in store.dead_letters()}
    assert kept[2].reason.startswith("dead letter refused by the store") and kept[2].raw == b""
    assert kept[1].reason == kept[3].reason == "not JSON"


async def test_a_store_refusing_everything_is_unavailable_not_a_loop():
    store = InMemoryEventStore()
    appender = Refusing(store, refuse_letters="")  # every letter refused, even minimal ones
    with pytest.raises(StoreUnavailable):
        await commit(appender, [], [letter(1)])
    assert appender.calls == 2  # the letter, then its minimal stand-in


def _error(sqlstate: str | None, cls: type[psycopg.Error] = psycopg.Error) -> psycopg.Error:
    if sqlstate is None:
        return cls("client side")
    return psycopg.errors.lookup(sqlstate)("server side")


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [
        ("22P05", StoreRefused),  # untranslatable character: \u0000 in jsonb
        ("22003", StoreRefused),  # numeric value out of range: bigint
        ("22021", StoreRefused),  # character not in repertoire
        ("23505", StoreRefused),  # unique violation
        ("54000", StoreRefused),  # program limit exceeded (an OperationalError in psycopg)
        ("42804", StoreRefused),
        ("XX000", StoreRefused),
        ("08006", StoreUnavailable),  # connection failure
        ("57P01", StoreUnavailable),  # admin shutdown
        ("57P03", StoreUnavailable),  # cannot connect now
        ("53100", StoreUnavailable),  # disk full
        ("53300", StoreUnavailable),  # too many connections
        ("40001", StoreUnavailable),  # serialization failure
        ("55P03", StoreUnavailable),  # lock not available
        ("25P02", StoreUnavailable),  # in failed transaction: a new connection clears it
        ("42P01", SchemaNotMigrated),
    ],
)
def test_driver_errors_are_classified_by_sqlstate(sqlstate: str, expected: type) -> None:
    assert type(classify(_error(sqlstate))) is expected


def test_client_side_errors_are_unavailable_unless_the_data_is_at_fault() -> None:
    assert type(classify(_error(None, psycopg.OperationalError))) is StoreUnavailable
    assert type(classify(_error(None, psycopg.InterfaceError))) is StoreUnavailable
    assert type(classify(_error(None, psycopg.DataError))) is StoreRefused
    assert type(classify(_error(None, psycopg.ProgrammingError))) is StoreRefused
    busy = psycopg.OperationalError("sending query failed: cannot exit pipeline mode while busy")
    assert type(classify(busy)) is StoreUnavailable


def test_a_fetch_is_committed_in_parts_bounded_in_bytes():
    from controlplane.bus import Delivery
    from controlplane.ingest import bounded

    msgs = [Delivery("s", f"r{i}", b"x" * n) for i, n in enumerate([10, 10, 70, 5, 5, 100, 1])]
    assert bounded(msgs, 1000) == [msgs]
    parts = bounded(msgs, 30)
    assert [len(p) for p in parts] == [2, 1, 2, 1, 1]  # a message over the limit stands alone
    assert [m for p in parts for m in p] == msgs  # in order, nothing lost
    assert all(sum(len(m.data) for m in p) <= 30 or len(p) == 1 for p in parts)


def test_a_fetch_is_committed_in_parts_bounded_in_messages():
    from controlplane.bus import Delivery
    from controlplane.ingest import bounded

    msgs = [Delivery("s", f"r{i}", b"x" * n) for i, n in enumerate([1, 1, 1, 1, 1, 40, 1])]
    assert bounded(msgs, 1000, 7) == [msgs]
    parts = bounded(msgs, 1000, 2)
    assert [len(p) for p in parts] == [2, 2, 2, 1]
    assert [m for p in parts for m in p] == msgs
    # Both bounds at once: whichever a run reaches first ends it.
    assert [len(p) for p in bounded(msgs, 30, 3)] == [3, 2, 1, 1]
