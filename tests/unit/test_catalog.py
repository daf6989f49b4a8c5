"""Backup reports packed into catalogs: what is packed, and that folding them is folding the
reports they hold (the view, and so every decision taken on it, is the same)."""

from __future__ import annotations

import json

import pytest

from controlplane.core import catalog as catalog_module
from controlplane.core.catalog import pack, unpacked
from controlplane.core.decide import decide
from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.decode import decode
from controlplane.store.memory import InMemoryEventStore
from schemas.events import BackupCatalog
from schemas.subjects import event_subject
from tests.factories import Events
from tests.scenario import Scenario


def _report(ev: Events, rank: int, step: int = 10, generation: int = 1, job: str = "job1"):
    return ev.make(
        "backup.snapshot",
        {"step": step, "shard": rank, "nbytes": 64, "checksum": "sha256:ab", "seconds": 0.01},
        source=f"n{rank}/m{rank}", generation=generation, job_id=job,
    )  # fmt: skip


def _kinds(events) -> list[str]:
    return [
        f"catalog*{len(e.payload.sources)}" if e.type == "backup.catalog" else e.type
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
    assert [(e.job_id, len(e.payload.sources)) for e in packed] == [("job1", 2), ("job2", 2)]


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


def test_sha256_digests_are_kept_in_base64_and_read_back_as_sent():
    import hashlib

    ev = Events()
    sent = []
    for rank in range(3):
        report = _report(ev, rank)
        digest = "sha256:" + hashlib.sha256(bytes([rank])).hexdigest()
        sent.append(report.model_copy(update={"payload": report.payload.model_copy(
            update={"checksum": digest})}))  # fmt: skip
    [(catalog, _)] = pack(sent)
    assert catalog.payload.checksums is None and len(catalog.payload.sha256[0]) == 43
    stored = [StoredEvent(1, sent[0].emitted_at, catalog)]
    assert [s.event.payload.checksum for s in unpacked(stored)] == [
        r.payload.checksum for r in sent
    ]
    # Any other checksum in the run: every one kept as sent.
    mixed = [*sent, _report(ev, 3)]
    [(catalog, _)] = pack(mixed)
    assert catalog.payload.sha256 is None
    assert catalog.payload.checksums == [r.payload.checksum for r in mixed]
    # Validated (an import reads it from a file): the digests' forms cannot be mixed up.
    body = catalog.payload.model_dump()
    BackupCatalog.model_validate(body)
    with pytest.raises(ValueError, match="either checksums or sha256"):
        BackupCatalog.model_validate({**body, "sha256": ["A" * 43] * 4})
