"""The event store contract: one test class, run against every adapter."""

from __future__ import annotations

import threading
import uuid

import pytest

from controlplane.core.records import DeadLetter
from controlplane.errors import ConcurrencyError
from controlplane.store.port import JobHead
from tests.factories import Events


class EventStoreContract:
    """Subclass per adapter and provide a ``store`` fixture with an empty log."""

    @pytest.fixture
    def store(self):  # pragma: no cover - replaced by subclasses
        raise NotImplementedError

    def test_empty_log(self, store):
        assert store.last_position() == 0
        assert store.read() == []
        assert store.job_ids() == []
        assert store.count_dead_letters() == 0

    def test_positions_are_gap_free_and_in_batch_order(self, store):
        ev = Events()
        first = [ev.heartbeat("m0", step=i) for i in range(3)]
        second = [ev.heartbeat("m0", step=i) for i in range(3, 5)]
        r1 = store.append(first)
        r2 = store.append(second)
        assert [s.position for s in r1.stored] == [1, 2, 3]
        assert [s.position for s in r2.stored] == [4, 5]
        got = store.read()
        assert [s.position for s in got] == [1, 2, 3, 4, 5]
        assert [s.event for s in got] == first + second
        assert store.last_position() == 5

    def test_repeated_event_id_is_skipped_not_an_error(self, store):
        ev = Events()
        a, b = ev.heartbeat("m0", step=1), ev.heartbeat("m0", step=2)
        store.append([a])
        result = store.append([a, b, b])
        assert result.duplicates == 2
        assert [s.event for s in result.stored] == [b]
        assert [s.event.event_id for s in store.read()] == [a.event_id, b.event_id]
        assert store.count_dead_letters() == 0

    def test_out_of_order_seq_is_dead_lettered_with_reason(self, store):
        ev = Events()
        store.append([ev.heartbeat("m0", seq=4), ev.heartbeat("m0", seq=5)])
        late = ev.heartbeat("m0", seq=4)  # another event reusing a seq already taken
        result = store.append([late])
        assert result.stored == []
        assert result.dead_letters == 1
        [letter] = store.dead_letters()
        assert "out-of-order seq: 4 after 5" in letter.letter.reason
        assert letter.letter.event_id == late.event_id
        # The same refused event arriving again adds no second dead letter.
        assert store.append([late]).dead_letters == 0
        assert store.count_dead_letters() == 1

    def test_gap_is_recorded_and_the_event_kept(self, store):
        ev = Events()
        store.append([ev.heartbeat("m0", seq=1)])
        result = store.append([ev.heartbeat("m0", seq=4)])
        assert len(result.stored) == 1
        [gap] = result.gaps
        assert (gap.after_seq, gap.next_seq, gap.missing) == (1, 4, 2)
        assert store.seq_gaps() == [gap]

    def test_late_event_fills_its_gap_once(self, store):
        """A producer retrying a failed publish delivers it after later events: accepted."""
        ev = Events()
        first, lost, third = (ev.heartbeat("m0", seq=s) for s in (1, 2, 3))
        store.append([first, third])
        result = store.append([lost])
        assert [s.event for s in result.stored] == [lost]
        assert result.late == 1 and result.dead_letters == 0
        impostor = ev.heartbeat("m0", seq=2)  # same seq, another event: out of order now
        assert store.append([impostor]).dead_letters == 1
        assert [s.event.seq for s in store.read()] == [1, 3, 2]

    def test_new_incarnation_restarts_the_sequence(self, store):
        ev = Events()
        store.append([ev.heartbeat("m0", seq=1), ev.heartbeat("m0", seq=2)])
        restarted = ev.heartbeat("m0", seq=1, incarnation="inc2")
        result = store.append([restarted])
        assert [s.event for s in result.stored] == [restarted]
        assert result.gaps == [] and result.dead_letters == 0

    def test_dead_letters_commit_with_the_batch_and_are_idempotent_by_stream_seq(self, store):
        ev = Events()
        letter = DeadLetter(
            reason="not JSON", raw=b"{", subject="elastic.evt.j.n.m.x", stream_seq=42
        )
        result = store.append([ev.heartbeat("m0")], [letter])
        assert result.dead_letters == 1 and len(result.stored) == 1
        assert store.append([], [letter]).dead_letters == 0
        [kept] = store.dead_letters()
        assert kept.letter.raw == b"{" and kept.letter.reason == "not JSON"
        assert kept.letter.stream_seq == 42

    def test_expected_job_head_guards_concurrent_decisions(self, store):
        ev, other = Events(), Events("job2")
        store.append([ev.heartbeat("m0")])
        store.append([other.heartbeat("m0")])  # another job's events do not conflict
        store.append([ev.cp("job.stopped", {"reason": "test"})], expected=JobHead("job1", 1))
        with pytest.raises(ConcurrencyError, match="job job1 is at 3, writer expected 1"):
            store.append([ev.cp("job.stopped", {"reason": "late"})], expected=JobHead("job1", 1))
        assert store.last_position() == 3
        store.append([other.cp("job.stopped", {"reason": "x"})], expected=JobHead("job2", 2))
        fresh = Events("job3")
        store.append([fresh.cp("job.stopped", {"reason": "x"})], expected=JobHead("job3", 0))

    def test_expected_log_head_places_a_batch_where_its_writer_said(self, store):
        ev, other = Events(), Events("job2")
        store.append([ev.heartbeat("m0")])
        store.append([other.heartbeat("m0")])
        # The job is where the writer saw it, but another job's event moved the log.
        with pytest.raises(ConcurrencyError, match="the log is at 2, writer expected 1") as err:
            store.append([ev.cp("job.stopped", {"reason": "x"})], expected=JobHead("job1", 1, 1))
        assert err.value.log_head == 2
        assert store.last_position() == 2
        events = [ev.cp("job.state_changed", {"from": "RUNNING", "to": "DEGRADED", "reason": "a"}),
                  ev.cp("job.stopped", {"reason": "b"})]  # fmt: skip
        result = store.append(events, expected=JobHead("job1", 1, 2))
        assert [s.position for s in result.stored] == [3, 4]

    def test_read_filters_by_job_type_and_position(self, store):
        a, b = Events("jobA"), Events("jobB")
        store.append([a.joined("m0"), b.joined("m0"), a.heartbeat("m0"), b.heartbeat("m0")])
        assert [s.position for s in store.read(job_id="jobA")] == [1, 3]
        assert [s.position for s in store.read(types=["member.heartbeat"])] == [3, 4]
        assert [s.position for s in store.read(after=2, limit=1)] == [3]
        assert [s.position for s in store.iter_events(job_id="jobB", batch=1)] == [2, 4]
        assert store.job_ids() == ["jobA", "jobB"]

    def test_stored_events_round_trip_exactly(self, store):
        ev = Events()
        originals = [
            ev.joined("m0"),
            ev.cp("job.registered", {"name": "x", "policy": {"min_world": 2, "redundancy": 1}}),
            ev.cp("job.state_changed", {"from": "PENDING", "to": "RUNNING", "reason": "started"}),
            ev.make("train.step", {"step": 3, "loss": 0.125, "step_seconds": 0.5, "samples": 8}),
        ]
        store.append(originals)
        assert [s.event for s in store.read()] == originals

    def test_concurrent_writers_never_let_a_tailing_reader_skip(self, store):
        """Writers race; a reader tailing by position sees every event exactly once, in order."""
        writers, per_writer, batch = 4, 60, 5
        done = threading.Event()
        seen: list[int] = []
        errors: list[BaseException] = []

        def write(w: int) -> None:
            try:
                ev = Events(incarnation=f"w{w}")
                for _ in range(per_writer // batch):
                    store.append([ev.heartbeat(f"m{w}", node=f"n{w}") for _ in range(batch)])
            except BaseException as exc:
                errors.append(exc)

        def tail() -> None:
            after = 0
            while True:
                finished = done.is_set()
                page = store.read(after=after, limit=7)
                for stored in page:
                    seen.append(stored.position)
                    after = stored.position
                if finished and not page:
                    return

        reader = threading.Thread(target=tail)
        reader.start()
        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        reader.join(timeout=30)
        assert not errors
        total = writers * per_writer
        assert seen == list(range(1, total + 1))
        ids = [s.event.event_id for s in store.read()]
        assert len(ids) == len(set(ids)) == total
        assert uuid.UUID(ids[0]).version == 4

    # ------------------------------------------------------------------ import (export files)

    def test_import_keeps_recorded_at_and_takes_the_next_positions(self, store):
        from datetime import timedelta

        from controlplane.core.records import StoredEvent
        from tests.factories import T0

        ev = Events()
        exported = [
            StoredEvent(
                10 + i, T0 + timedelta(seconds=i, microseconds=123), ev.heartbeat("m0", step=i)
            )
            for i in range(3)
        ]
        result = store.import_events(exported)
        assert [s.position for s in result.stored] == [1, 2, 3]
        got = store.read()
        assert [s.position for s in got] == [1, 2, 3]
        assert [s.recorded_at for s in got] == [s.recorded_at for s in exported]
        assert [s.event for s in got] == [s.event for s in exported]
        # After ordinary appends, an import goes on from the head, times still its own.
        store.append([ev.heartbeat("m1")])
        late = StoredEvent(1, T0 - timedelta(days=1), ev.heartbeat("m0", step=9))
        [stored] = store.import_events([late]).stored
        assert stored.position == 5 and stored.recorded_at == late.recorded_at
        assert store.read(after=4)[0].recorded_at == T0 - timedelta(days=1)

    def test_importing_twice_stores_nothing_twice(self, store):
        from controlplane.core.records import StoredEvent
        from tests.factories import T0

        ev = Events()
        exported = [StoredEvent(i, T0, ev.heartbeat("m0", step=i)) for i in range(1, 5)]
        store.import_events(exported[:2])
        again = store.import_events(exported)  # overlaps: two known, two new
        assert again.duplicates == 2 and len(again.stored) == 2
        third = store.import_events(exported)
        assert third.duplicates == 4 and third.stored == []
        assert [s.event.event_id for s in store.read()] == [s.event.event_id for s in exported]
        assert store.count_dead_letters() == 0

    def test_import_applies_the_sequence_rules(self, store):
        """A log where a late event filled its gap imports the same way: kept, gap recorded."""
        from controlplane.core.records import StoredEvent
        from tests.factories import T0

        ev = Events()
        first, lost, third = (ev.heartbeat("m0", seq=s) for s in (1, 2, 3))
        result = store.import_events(
            [StoredEvent(p, T0, e) for p, e in ((1, first), (2, third), (3, lost))]
        )
        assert [s.event.seq for s in result.stored] == [1, 3, 2]
        assert result.late == 1 and [g.missing for g in result.gaps] == [1]
        impostor = ev.heartbeat("m0", seq=2)  # another event under a taken seq: refused
        refused = store.import_events([StoredEvent(4, T0, impostor)])
        assert refused.stored == [] and len(refused.rejected) == 1
        assert store.count_dead_letters() == 1

    # ------------------------------------------------------------------ backup catalogs

    @staticmethod
    def _reports(ev: Events, step: int, ranks: int, *, generation: int = 1) -> list:
        return [
            ev.make(
                "backup.snapshot",
                {
                    "step": step,
                    "shard": r,
                    "nbytes": 100 + r,
                    "checksum": f"sha256:{r:04x}",
                    "seconds": 0.01 * r,
                    "holders": [f"m{(r + 1) % ranks}"],
                },
                source=f"n{r}/m{r}",
                generation=generation,
            )
            for r in range(ranks)
        ]

    def test_a_run_of_backup_reports_is_stored_as_one_catalog(self, store):
        from controlplane.core.catalog import unpacked

        ev = Events()
        reports = self._reports(ev, 10, 5)
        step = ev.make(
            "train.step", {"step": 10, "loss": 1.0, "step_seconds": 0.1, "samples": 8},
            source="n0/m0", generation=1,
        )  # fmt: skip
        other_job = Events("job2").heartbeat("m9")
        # The job's train.step ends the first run; another job's event does not.
        result = store.append([*reports[:3], other_job, *reports[3:4], step, reports[4]])
        types = [(s.event.job_id, s.event.type) for s in result.stored]
        assert types == [
            ("job2", "member.heartbeat"),
            ("job1", "backup.catalog"),
            ("job1", "train.step"),
            ("job1", "backup.snapshot"),
        ]
        assert [s.position for s in store.read()] == [1, 2, 3, 4]
        [catalog] = store.read(types=["backup.catalog"])
        assert catalog.event.source == "controlplane"
        assert catalog.event.v == 2 and catalog.event.payload.count == 4
        assert catalog.event.payload.columns().sources == ["n0/m0", "n1/m1", "n2/m2", "n3/m3"]
        # Unpacked, every report is what its member sent, but for event_id and emitted_at.
        back = [s.event for s in unpacked(store.read(job_id="job1"))]
        assert [e.type for e in back] == ["backup.snapshot"] * 4 + ["train.step", "backup.snapshot"]
        for sent, got in zip([*reports[:4], step, reports[4]], back, strict=True):
            assert (got.source, got.incarnation, got.seq, got.generation, got.payload) == (
                sent.source, sent.incarnation, sent.seq, sent.generation, sent.payload,
            )  # fmt: skip

    def test_a_backup_report_delivered_again_is_a_duplicate_not_a_dead_letter(self, store):
        ev = Events()
        reports = self._reports(ev, 10, 4)
        store.append(reports)
        # Redelivered after a commit whose ack was lost: its event_ids are not in the log
        # (packed), its seqs are: duplicates, nothing stored, nothing dead-lettered.
        again = store.append(reports)
        assert again.duplicates == 4 and again.stored == []
        assert store.count_dead_letters() == 0
        assert len(store.read()) == 1

    def test_a_catalog_imports_as_its_reports_packed_again(self, store):
        from controlplane.core.catalog import unpacked
        from controlplane.core.records import StoredEvent
        from tests.factories import T0

        ev = Events()
        reports = self._reports(ev, 20, 3)
        exported = [StoredEvent(7, T0, e) for e in InMemoryExport.catalogs(reports)]
        result = store.import_events(exported)
        [stored] = result.stored
        assert stored.event.type == "backup.catalog" and stored.recorded_at == T0
        assert [e.event.payload for e in unpacked(store.read())] == [r.payload for r in reports]
        twice = store.import_events(exported)
        assert twice.stored == [] and twice.duplicates == 3
        assert store.count_dead_letters() == 0


class InMemoryExport:
    """What an export of a log holds for a run of backup reports."""

    @staticmethod
    def catalogs(reports: list) -> list:
        from controlplane.core.catalog import pack

        return [event for event, _ in pack(reports)]
