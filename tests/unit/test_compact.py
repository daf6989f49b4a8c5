"""A decision's lists written against the world in force (``core.compact``): the log records
a few items where a large world's names were, and folds and re-decides as the whole lists."""

from __future__ import annotations

from dataclasses import replace

from controlplane.core.commands import owed
from controlplane.core.compact import changes, compacted, expand, placed, spans
from controlplane.core.decide import Decided
from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.core.replay import decision_batches, redecide
from schemas.events import EVENT_ADAPTER
from tests.scenario import Scenario


def test_spans_write_a_list_against_a_base_and_expand_back():
    base = [f"m{i}" for i in range(10)]
    replaced = [*base[:3], "spare0", *base[4:]]
    assert spans(replaced, base) == [(0, 3), "spare0", (4, 10)]
    shrunk = [*base[:3], *base[4:]]
    assert spans(shrunk, base) == [(0, 3), (4, 10)]
    for items in (replaced, shrunk, [*base[5:], *base[:5]]):
        written = spans(items, base)
        assert written is not None and expand(written, base) == items
    assert spans(list(reversed(base)), base) is None  # not shorter: the list is recorded
    assert spans(base, []) is None
    holders = [(f"m{(i + 1) % 10}",) for i in range(10)]
    previous = dict(zip(base, holders, strict=True))
    moved = [*holders[:3], ("m9",), *holders[4:]]
    assert changes(replaced, moved, previous) == [(3, ["m9"])]
    assert placed(replaced, [(3, ["m9"])], previous) == tuple(moved)


def _compact_log(log: list[StoredEvent]) -> list[StoredEvent]:
    """``log`` as the decider records it: each batch of decisions written by ``compacted``
    against the view it was decided on."""
    out: list[StoredEvent] = []
    view = None
    done = 0
    for start, end in decision_batches(log):
        if start > done:
            view = fold(view, log[done:start])
            out += log[done:start]
        batch = log[start:end]
        decided = [Decided(s.event.event_id, s.event.type, s.event.generation, s.event.payload)
                   for s in batch]  # fmt: skip
        written = compacted(view, decided) if view is not None else decided
        out += [
            replace(s, event=s.event.model_copy(update={"payload": d.payload}))
            for s, d in zip(batch, written, strict=True)
        ]
        view = fold(view, batch)
        done = end
    return out + log[done:]


def test_a_decision_written_against_the_world_folds_and_re_decides_as_the_whole_lists():
    s = Scenario("job1", world_size=16, min_world=2, redundancy=2)
    s.cluster(4, 4, spares=1)
    s.decide()
    s.at(1)
    s.heartbeat_all()
    for step in (10, 20):
        s.step(step)
        s.backup(step)
    s.step(23)
    s.at(2)
    s.exited("w01")
    assert any(d.type == "reallocation.issued" for d in s.decide())
    s.at(3)
    s.heartbeat_all()
    s.recover()
    s.decide()
    s.step(25)
    s.at(4)
    s.exited("w12")  # no spare left: the world shrinks
    assert any(d.type == "reallocation.issued" for d in s.decide())
    log = _compact_log(s.log)
    written = [e.event.payload for e in log if e.event.type in
               ("reallocation.issued", "generation.started")]  # fmt: skip
    assert sum(p.world_spans is not None for p in written) == 4, written
    assert all(not p.world for p in written if p.world_spans is not None)
    # Through JSON, as the store keeps them.
    log = [
        replace(e, event=EVENT_ADAPTER.validate_json(e.event.model_dump_json(by_alias=True)))
        for e in log
    ]
    compact, whole = fold(None, log), fold(None, s.log)
    assert compact.world == whole.world and compact.placement == whole.placement
    assert compact.lineage == whole.lineage
    for incident_id, incident in whole.incidents.items():
        for a, b in zip(compact.incidents[incident_id].decisions, incident.decisions, strict=True):
            assert (a.world, a.plan, a.digests) == (b.world, b.plan, b.digests)
            assert b.digests
    assert owed(compact) == owed(whole)
    assert all(r.matches for r in redecide(log))
