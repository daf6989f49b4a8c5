"""Backup reports packed into one record per run, and read back one report at a time.

Every rank reports each backup (``backup.snapshot``): at 16,384 ranks and a backup every ten
seconds that was a row, with its envelope and five index entries, per rank per backup, most
of the log's bytes. The reports of one backup reach the ingest together, so the store packs
each *run* of them into one ``backup.catalog``: consecutive accepted reports of one job, one
generation and one step, with no other event of that job between them (version 2: the
columns packed into one string, ``schemas.catalog``; logs recorded before hold version 1,
JSON lists, read the same way). Nothing of the job's
order changes (a run holds only reports, and what came before or after each of them in the
job still does), so folding the catalogs is folding the reports (a unit test folds both).

Packing runs after the sequence rules and the de-duplication, so every packed report was
checked and bound to its sender like any event; its (source, incarnation, seq) stay in the
catalog, and a report delivered again later is recognised by its seq (``is_repeated_report``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, NamedTuple

from controlplane.core.records import StoredEvent
from schemas.catalog import CatalogColumns
from schemas.common import CONTROLPLANE_SOURCE
from schemas.events import (
    CATALOG_ENTRIES,
    BackupCatalog,
    BackupCatalogEvent,
    BackupSnapshot,
    BackupSnapshotEvent,
    EnvelopeBase,
    PackedCatalog,
)

#: The event type packed, and the record it is packed into.
PACKED: Final = "backup.snapshot"
CATALOG: Final = "backup.catalog"
#: A catalog's envelope names no process of its own: it is never sequenced (the store makes
#: it from reports it sequenced, and an import unpacks it first).
CATALOG_INCARNATION = "store"
#: Catalog event ids are derived from their first report's, and unpacked reports' from
#: their catalog's (uuid5 in this namespace): the same input packs and unpacks the same way.
_NAMESPACE = uuid.UUID("5b0f4a52-3c1e-4d8e-9a53-7f6d2c1b8e01")


def pack(events: Sequence[EnvelopeBase]) -> list[tuple[EnvelopeBase, int]]:
    """``events`` (accepted, in order) with each run of two or more backup reports replaced
    by one catalog: pairs of (event, its index in ``events``; a catalog's is the index of
    its first report, and its type ``CATALOG``). A run ends at the job's next event of
    another kind, generation or step, at ``CATALOG_ENTRIES`` reports, or at the batch's
    end; its catalog takes the place where the run ended (other jobs' events may move past
    it, which no job's fold can see)."""
    out: list[tuple[EnvelopeBase, int]] = []
    runs: dict[str, tuple[int, int, list[int]]] = {}  # job -> (generation, step, indices)

    def close(job_id: str) -> None:
        _, _, run = runs.pop(job_id)
        if len(run) == 1:
            out.append((events[run[0]], run[0]))
        else:
            out.append((catalog([events[i] for i in run]), run[0]))

    for i, event in enumerate(events):
        job_id = event.job_id
        if event.type == PACKED:
            key = (event.generation, event.payload.step)
            run = runs.get(job_id)
            if run is not None and run[:2] == key and len(run[2]) < CATALOG_ENTRIES:
                run[2].append(i)
                continue
            if run is not None:
                close(job_id)
            runs[job_id] = (*key, [i])
            continue
        if job_id in runs:
            close(job_id)
        out.append((event, i))
    for job_id in list(runs):
        close(job_id)
    return out


def catalog(reports: Sequence[EnvelopeBase]) -> BackupCatalogEvent:
    """One record of ``reports`` (validated ``backup.snapshot`` events of one job, generation
    and step), in the packed form (version 2), built without validating again."""
    first = reports[0]
    payloads: list[BackupSnapshot] = [r.payload for r in reports]
    columns = CatalogColumns(
        sources=[r.source for r in reports],
        incarnations=[r.incarnation for r in reports],
        seqs=[r.seq for r in reports],
        shards=[p.shard for p in payloads],
        nbytes=[p.nbytes for p in payloads],
        checksums=[p.checksum for p in payloads],
        seconds=[p.seconds for p in payloads],
        holders=[list(p.holders) for p in payloads],
    )
    return BackupCatalogEvent.model_construct(
        event_id=str(uuid.uuid5(_NAMESPACE, first.event_id)),
        job_id=first.job_id,
        type=CATALOG,
        v=2,
        source=CONTROLPLANE_SOURCE,
        incarnation=CATALOG_INCARNATION,
        seq=1,
        generation=first.generation,
        emitted_at=first.emitted_at,
        payload=PackedCatalog.of(payloads[0].step, columns),
    )


def reports(event: EnvelopeBase) -> Iterator[BackupSnapshotEvent]:
    """The ``backup.snapshot`` reports a catalog holds (either version), each as the event it
    was but for its event_id (derived) and emission time (the catalog's)."""
    body: BackupCatalog | PackedCatalog = event.payload
    base = uuid.UUID(event.event_id)
    c = body.columns()
    columns = zip(
        c.sources, c.incarnations, c.seqs, c.shards, c.nbytes, c.checksums, c.seconds,
        c.holders, strict=True,
    )  # fmt: skip
    step = body.step
    for i, (source, incarnation, seq, shard, nbytes, checksum, seconds, holders) in enumerate(
        columns
    ):
        yield BackupSnapshotEvent.model_construct(
            event_id=str(uuid.uuid5(base, str(i))),
            job_id=event.job_id,
            type=PACKED,
            v=1,
            source=source,
            incarnation=incarnation,
            seq=seq,
            generation=event.generation,
            emitted_at=event.emitted_at,
            payload=BackupSnapshot.model_construct(
                step=step,
                shard=shard,
                nbytes=nbytes,
                checksum=checksum,
                seconds=seconds,
                holders=holders,
            ),
        )


class Sender(NamedTuple):
    """What a packed report's envelope says of who sent it (``Entry.event``)."""

    source: str
    incarnation: str
    seq: int
    generation: int
    type: str = PACKED


class Entry(NamedTuple):
    """One report of a stored catalog as the fold reads it: its position (the catalog's),
    its sender (``event``, as a stored event's envelope) and its values (as a
    ``backup.snapshot``'s payload). ``reports`` makes the whole event of each, with an
    event_id derived for it; a fold needs none of that, and at 16,384 reports a backup the
    events took half the fold's time. Tuples: made in C, in a quarter of a frozen
    dataclass's time, 16,384 of each a backup."""

    position: int
    event: Sender
    step: int
    shard: int
    nbytes: int
    checksum: str
    seconds: float
    holders: list[str]


def entries(stored: StoredEvent) -> Iterator[Entry]:
    """The reports of the catalog ``stored`` (either version), in order, as ``Entry``s."""
    event = stored.event
    body: BackupCatalog | PackedCatalog = event.payload
    c = body.columns()
    columns = zip(
        c.sources, c.incarnations, c.seqs, c.shards, c.nbytes, c.checksums, c.seconds,
        c.holders, strict=True,
    )  # fmt: skip
    position, generation, step = stored.position, event.generation, body.step
    for source, incarnation, seq, shard, nbytes, checksum, seconds, holders in columns:
        sender = Sender(source, incarnation, seq, generation)
        yield Entry(position, sender, step, shard, nbytes, checksum, seconds, holders)


def is_catalog(event: EnvelopeBase) -> bool:
    """Whether ``event`` is a catalog the store recorded (a member cannot publish one)."""
    return event.type == CATALOG and event.source == CONTROLPLANE_SOURCE


def unpacked(log: Iterable[StoredEvent]) -> Iterator[StoredEvent]:
    """``log`` with every catalog replaced by its reports (each at the catalog's position and
    recording time): the log as the members sent it."""
    for stored in log:
        if is_catalog(stored.event):
            for report in reports(stored.event):
                yield StoredEvent(stored.position, stored.recorded_at, report)
        else:
            yield stored


def is_repeated_report(event: EnvelopeBase, repeated: set[str]) -> bool:
    """Whether ``event``, refused by the sequence rules as at or below its source's highest
    seq and in no hole (``repeated``), is a backup report delivered again: one was accepted
    under that seq already and packed, so its event_id is not in the log to find. It is a
    duplicate, not a dead letter (a report out of order is lost either way)."""
    return event.type == PACKED and event.event_id in repeated
