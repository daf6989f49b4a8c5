"""Backup reports packed into catalogs: what is packed, and that folding them is folding the
reports they hold (the view, and so every decision taken on it, is the same)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import zlib

import pytest

from controlplane.core import catalog as catalog_module
from controlplane.core.catalog import pack, unpacked
from controlplane.core.decide import decide
from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.decode import decode
from controlplane.store.memory import InMemoryEventStore
from schemas.catalog import CatalogColumns, encode
from schemas.events import EVENT_ADAPTER, BackupCatalog, PackedCatalog
from schemas.subjects import event_subject
from tests.factories import T0, Events
from tests.scenario import Scenario


def _report(ev: Events, rank: int, step: int = 10, generation: int = 1, job: str = "job1"):
    return ev.make(
        "backup.snapshot",
        {"step": step, "shard": rank, "nbytes": 64, "checksum": "sha256:ab", "seconds": 0.01},
        source=f"n{rank}/m{rank}", generation=generation, job_id=job,
    )  # fmt: skip


def _kinds(events) -> list[str]:
    return [
        f"catalog*{e.payload.count}" if e.type == "backup.catalog" else e.type
        for e, _ in pack(events)
    ]


def test_a_run_ends_at_a_new_step_or_generation_and_a_single_report_stays_as_it_was():
    ev = Events()
    events = [
        _report(ev, 0), _report(ev, 1),
        _report(ev, 2, step=20), _report(ev, 3, step=20), _report(ev, 4, step=20),
        _report(ev, 5, step=20, generation=2),
    ]  # fmt: skip
    assert _kinds(events) == ["catalog*2", "catalog*3", "backup.snapshot"]


def test_a_run_is_capped(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(catalog_module, "CATALOG_ENTRIES", 3)
    ev = Events()
    assert _kinds([_report(ev, r) for r in range(7)]) == [
        "catalog*3",
        "catalog*3",
        "backup.snapshot",
    ]


def test_runs_of_two_jobs_are_packed_apart_and_each_keeps_its_order():
    a, b = Events("job1"), Events("job2")
    events = [_report(a, 0), _report(b, 0, job="job2"), _report(a, 1), _report(b, 1, job="job2")]
    packed = [e for e, _ in pack(events)]
    assert [(e.job_id, e.payload.count) for e in packed] == [("job1", 2), ("job2", 2)]


def test_a_member_cannot_publish_a_catalog():
    ev = Events()
    [(catalog, _)] = pack([_report(ev, 0), _report(ev, 1)])
    forged = json.loads(catalog.model_dump_json())
    forged["source"] = "n0/m0"
    letter = decode(
        event_subject("job1", "n0", "m0", "backup.catalog"), json.dumps(forged).encode()
    )
    assert getattr(letter, "reason", "") == (
        "forged: backup.catalog is recorded only by the control plane"
    )


def _trained(s: Scenario) -> list[StoredEvent]:
    """Members' events of a job that trains and backs up twice, each report naming the
    holders of the placement, then loses a rank; the log as the members sent it."""
    s.cluster(2, 2, spares=1)
    s.decide()
    s.at(1)
    s.heartbeat_all()
    for step in (10, 20):
        s.step(step)
        s.backup(step, named=True)
    s.step(23)
    s.at(2)
    s.exited(s.v.world[1])
    return s.log


def test_folding_the_stored_catalogs_is_folding_the_reports_and_decides_the_same():
    s = Scenario("job1", world_size=4, min_world=2, redundancy=1)
    log = _trained(s)
    store = InMemoryEventStore()
    store.import_events(log)  # one batch: each backup's reports become one catalog
    stored = store.read()
    assert sum(e.event.type == "backup.catalog" for e in stored) == 2
    assert not any(e.event.type == "backup.snapshot" for e in stored)
    packed_view = fold(None, stored)
    reports_view = fold(None, list(unpacked(stored)))
    assert packed_view.backups == reports_view.backups
    assert packed_view.members == reports_view.members
    assert sorted(packed_view.backups) == [10, 20]
    assert all(b.is_complete(1) for b in packed_view.backups.values())
    # The decision on the lost rank restores from the same copies either way.
    decided = decide(packed_view, s.now, s.context)
    assert decided and decided == decide(reports_view, s.now, s.context)
    # And the same as on the log as it was sent, event by event, but for the positions
    # its evidence cites (a catalog takes one position for several reports).
    assert _positionless(decided) == _positionless(decide(fold(None, log), s.now, s.context))


def _positionless(decided) -> list:
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "position"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return [(d.type, strip(d.payload.model_dump(mode="json"))) for d in decided]


def _sent(ev: Events, rank: int, checksum: str, **payload) -> object:
    report = _report(ev, rank)
    return report.model_copy(update={"payload": report.payload.model_copy(
        update={"checksum": checksum, **payload})})  # fmt: skip


def test_every_value_of_every_report_is_kept_exactly_and_validated_on_the_way_back():
    ev = Events()
    sent = [
        _sent(ev, rank, "sha256:" + hashlib.sha256(bytes([rank])).hexdigest(),
              seconds=0.1 + rank / 3, nbytes=(1 << 40) + rank, holders=[f"m{rank + 1}", "x-9"])
        for rank in range(5)
    ]  # fmt: skip
    sent.append(_sent(ev, 5, "crc32:0bad", holders=[]))  # not a sha256: kept as sent
    [(catalog, _)] = pack(sent)
    assert catalog.v == 2 and catalog.payload.count == 6
    stored = [StoredEvent(1, sent[0].emitted_at, catalog)]
    back = [s.event for s in unpacked(stored)]
    assert [(e.source, e.incarnation, e.seq, e.generation, e.payload) for e in back] == [
        (e.source, e.incarnation, e.seq, e.generation, e.payload) for e in sent
    ]
    # Read back from its JSON (a row, an export line): validated, decoded, the same reports.
    line = catalog.model_dump_json()
    again = EVENT_ADAPTER.validate_json(line)
    assert [s.event.payload for s in unpacked([StoredEvent(1, T0, again)])] == [
        e.payload for e in sent
    ]
    # Each digest is its 32 bytes: the row is far smaller than the reports' JSON.
    assert len(catalog.payload.packed) < sum(len(e.payload.model_dump_json()) for e in sent) / 2


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _packed_body(columns: CatalogColumns) -> dict:
    return {"step": 10, "count": len(columns), "packed": encode(columns)}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"sources": ["controlplane"]}, "from a member, not the control plane"),
        ({"sources": ["n0/m 0"]}, "a source is not valid"),
        ({"incarnations": ["inc\u00e9"]}, "an incarnation is not valid"),
        ({"holders": [["m1"] * 9]}, "holders is not valid"),
        ({"holders": [["m1", "m 2"]]}, "holders is not valid"),
        ({"checksums": ["SHA256:00"]}, "a checksum is not valid"),
        ({"seqs": [0]}, "a seq below 1"),
        ({"seconds": [float("inf")]}, "not finite"),
        ({"seconds": [-1.0]}, "seconds below 0"),
    ],
)
def test_a_packed_catalog_holding_what_no_report_could_is_refused(change, why):
    good = CatalogColumns(["n0/m0"], ["inc1"], [3], [0], [64], ["sha256:" + "ab" * 32], [0.5],
                          [["m1"]])  # fmt: skip
    PackedCatalog.model_validate(_packed_body(good))
    bad = dataclasses.replace(good, **change)
    with pytest.raises(ValueError, match=why):
        PackedCatalog.model_validate(_packed_body(bad))


def test_a_packed_catalog_that_does_not_decode_or_lies_about_its_count_is_refused():
    good = CatalogColumns(["n0/m0", "n1/m1"], ["a", "b"], [3, 4], [0, 1], [64, 64],
                          ["sha256:" + "ab" * 32, "md5:00"], [0.5, 0.5], [[], []])  # fmt: skip
    body = _packed_body(good)
    assert PackedCatalog.model_validate(body).columns() == good
    for wrong in (
        {**body, "count": 3},
        {**body, "packed": body["packed"][:-4]},
        {**body, "packed": "AAAA" + body["packed"]},
        {**body, "packed": _b64(zlib.compress(b"\0" * 10**6))},  # a bomb
    ):
        with pytest.raises(ValueError, match="packed catalog"):
            PackedCatalog.model_validate(wrong)
    # The version says the form: a packed body under version 1 is refused, and the reverse.
    [(catalog, _)] = pack([_report(Events(), 0), _report(Events(), 1)])
    envelope = json.loads(catalog.model_dump_json())
    with pytest.raises(ValueError, match="other version's form"):
        EVENT_ADAPTER.validate_json(json.dumps({**envelope, "v": 1}))


#: A catalog as the store recorded it before version 2 (its JSON lists), from a log kept then.
_VERSION_1 = {
    "step": 10, "sources": ["n0/m0", "n1/m1"], "incarnations": ["inc1", "inc1"],
    "seqs": [2, 2], "shards": [0, 1], "nbytes": [64, 64],
    "sha256": [base64.urlsafe_b64encode(bytes([k]) * 32).rstrip(b"=").decode() for k in (1, 2)],
    "seconds": [0.01, 0.02], "holders": [["m1"], ["m0"]],
}  # fmt: skip


def test_a_version_1_catalog_of_an_older_log_still_reads_and_folds_as_its_reports():
    event = EVENT_ADAPTER.validate_python({
        "event_id": "5b0f4a52-3c1e-4d8e-9a53-7f6d2c1b8e02", "job_id": "job1",
        "type": "backup.catalog", "v": 1, "source": "controlplane", "incarnation": "store",
        "seq": 1, "generation": 1, "emitted_at": T0, "payload": _VERSION_1,
    })  # fmt: skip
    assert isinstance(event.payload, BackupCatalog)
    back = [s.event for s in unpacked([StoredEvent(5, T0, event)])]
    assert [(e.source, e.payload.shard, e.payload.checksum, e.payload.holders) for e in back] == [
        ("n0/m0", 0, "sha256:" + "01" * 32, ["m1"]),
        ("n1/m1", 1, "sha256:" + "02" * 32, ["m0"]),
    ]
    # Packed again (an import), it is the same reports in version 2.
    [(repacked, _)] = pack(back)
    assert repacked.v == 2
    assert [s.event.payload for s in unpacked([StoredEvent(5, T0, repacked)])] == [
        e.payload for e in back
    ]
    with pytest.raises(ValueError, match="either checksums or sha256"):
        BackupCatalog.model_validate({**_VERSION_1, "checksums": ["md5:00", "md5:01"]})


def test_reports_the_fold_does_not_believe_are_noted_as_their_events_would_be():
    """The fold reads a catalog's reports as columns (``catalog.entries``), not as events:
    what it notes of the ones it does not believe (a sender that never joined, another
    process of the member, a shard outside the world) is what it noted of the events."""
    s = Scenario("job1", world_size=4, min_world=2, redundancy=1)
    log = _trained(s)
    good = [
        e.event for e in log if e.event.type == "backup.snapshot" and e.event.payload.step == 20
    ]
    head = fold(
        None,
        [e for e in log if not (e.event.type == "backup.snapshot" and e.event.payload.step == 20)],
    )

    def changed(report, **envelope):
        payload = envelope.pop("payload", {})
        return report.model_copy(
            update={**envelope, "payload": report.payload.model_copy(update=payload)}
        )

    sent = [
        *good[:2],
        changed(good[2], source="n9/ghost"),
        changed(good[2], incarnation="another"),
        changed(good[3], payload={"shard": 40}),
        *good[2:],
    ]
    packed = [e for e, _ in pack(sent)]
    assert [e.type for e in packed] == ["backup.catalog"]
    at = head.last_position + 1
    as_catalog = fold(head, [StoredEvent(at, T0, packed[0])])
    as_events = fold(head, [StoredEvent(at, T0, e) for e in sent])
    assert as_catalog.discounts == as_events.discounts and as_catalog.discounts
    assert as_catalog.discount_counts == as_events.discount_counts
    assert as_catalog.anomalies == as_events.anomalies and as_catalog.anomalies
    assert as_catalog.backups == as_events.backups
    assert as_catalog.last_complete_backup == as_events.last_complete_backup == 20
