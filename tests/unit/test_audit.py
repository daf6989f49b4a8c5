"""``postmortem.audit``: a job's log against what its members numbered; and the control
plane's injected fault (``ELASTIC_CONTROL_FAULT``) is parsed and checked."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from controlplane.core.catalog import pack
from controlplane.core.records import StoredEvent
from controlplane.decider import ControlFault
from controlplane.postmortem.audit import audit
from controlplane.settings import Settings
from tests.factories import T0, Events


def _report(ev: Events, rank: int, **kw):
    return ev.make(
        "backup.snapshot",
        {"step": 10, "shard": rank, "nbytes": 64, "checksum": "sha256:ab", "seconds": 0.01},
        source=f"n{rank}/m{rank}", generation=1, **kw,
    )  # fmt: skip


def _stored(events) -> list[StoredEvent]:
    return [StoredEvent(i, T0, e) for i, e in enumerate(events, start=1)]


def test_a_whole_log_counts_a_catalog_s_reports_one_by_one():
    ev = Events()
    events = [ev.joined(f"m{r}", node=f"n{r}") for r in range(3)] + [
        _report(ev, r) for r in range(3)
    ]
    packed = [event for event, _ in pack(events)]
    assert len(packed) < len(events)
    found = audit(_stored(packed))
    assert found.whole and found.events == 6 and found.processes == 3
    assert found.summary()["whole"] is True


def test_a_number_missing_or_twice_is_found_and_named():
    ev = Events()
    first, second, third = (ev.joined("m0") for _ in range(3))
    lost = audit(_stored([first, third]))
    assert (lost.missing, lost.duplicated, lost.whole) == (1, 0, False)
    assert lost.examples == ("n0/m0 (inc1): 1 missing, 0 twice",)
    twice = audit(_stored([first, second, second.model_copy(update={"event_id": "other"})]))
    assert (twice.missing, twice.duplicated) == (0, 1)
    same_id = audit(_stored([first, second, third, third]))
    assert same_id.duplicated == 2  # the id twice, and its number twice


def test_another_process_numbers_from_one_again():
    ev = Events()
    events = [ev.joined("m0"), ev.joined("m0", incarnation="inc2")]
    assert audit(_stored(events)).whole


@pytest.mark.parametrize("spec", ["exit-after-record:2", "exit-after-publish:17"])
def test_a_control_fault_is_read_from_the_settings(spec):
    fault = ControlFault(Settings(control_fault=spec).control_fault or "")
    assert (fault.point, fault.generation) == (spec.split("-")[2].split(":")[0],
                                               int(spec.rsplit(":", 1)[1]))  # fmt: skip


@pytest.mark.parametrize("spec", ["exit-after-ack:2", "exit-after-record:0", "record:2", " "])
def test_a_control_fault_that_is_not_one_is_refused(spec):
    with pytest.raises(ValidationError, match="control_fault"):
        Settings(control_fault=spec)
