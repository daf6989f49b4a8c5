"""The API's parts that need no database: tokens, examples, views kept by tailing, pages."""

from __future__ import annotations

from datetime import timedelta
from typing import get_args

import httpx
import pytest

from controlplane.api import examples
from controlplane.api.app import EventType, create_app
from controlplane.api.auth import Denied, TokenAuth, TokenSpecError, parse_tokens
from controlplane.api.views import LiveViews, store_reader
from controlplane.core.steps import StepLoss
from controlplane.settings import Settings
from controlplane.store.memory import InMemoryEventStore
from schemas.api import (
    Cluster,
    EventPage,
    GoodputOut,
    Health,
    IncidentSummary,
    IncidentTimeline,
    JobDetail,
    JobList,
    LossCurve,
    Problem,
)
from schemas.events import SCHEMA_VERSIONS
from tests.factories import T0, Events
from tests.recorded import JOB, two_incidents


def test_token_spec_parses_scopes_and_never_quotes_a_token():
    assert parse_tokens(" a:read , b:read+admin,,c:x ") == {
        "a": frozenset({"read"}),
        "b": frozenset({"read", "admin"}),
        "c": frozenset({"x"}),
    }
    for spec in ("s3cret", "s3cret:", "s3cret:+", ":read", "s3 cret:read", " , "):
        with pytest.raises(TokenSpecError) as caught:
            parse_tokens(spec)
        assert "s3" not in str(caught.value)


def test_token_checks_answer_401_or_403():
    auth = TokenAuth(parse_tokens("good:read,other:write"))
    auth.check("Bearer good")
    auth.check("bearer   good ")
    for header, status in [
        (None, 401),
        ("", 401),
        ("Bearer", 401),
        ("Basic good", 401),
        ("Bearer bad", 401),
        ("Bearer other", 403),
    ]:
        with pytest.raises(Denied) as caught:
            auth.check(header)
        assert caught.value.status == status, header
        assert caught.value.challenge.startswith("Bearer")
        assert "good" not in caught.value.detail
    assert TokenAuth.from_setting(None) is None


def test_the_event_type_parameter_knows_every_type():
    assert set(get_args(EventType)) == set(SCHEMA_VERSIONS)


@pytest.mark.parametrize(
    ("model", "example"),
    [
        (JobList, examples.JOB_LIST),
        (JobDetail, examples.JOB_DETAIL),
        (EventPage, examples.EVENT_PAGE),
        (IncidentSummary, examples.INCIDENT),
        (IncidentTimeline, examples.TIMELINE),
        (Cluster, examples.CLUSTER),
        (LossCurve, examples.LOSS),
        (Health, examples.HEALTH),
        (Problem, examples.PROBLEM_NOT_FOUND),
        (GoodputOut, examples.GOODPUT),
    ],
)
def test_the_openapi_examples_are_valid_answers(model, example):
    model.model_validate(example)


def test_the_newest_generation_reports_the_loss_of_a_step():
    at = T0
    step = StepLoss(1, 2.0, 1, at)
    step.add(1, 4.0, at + timedelta(seconds=1))
    assert (step.total / step.count, step.at) == (3.0, at + timedelta(seconds=1))
    step.add(0, 100.0, at + timedelta(seconds=2))  # an older generation, late: ignored
    assert step.total / step.count == 3.0
    step.add(2, 1.0, at + timedelta(seconds=3))  # after a roll-back: replaces
    assert (step.generation, step.total, step.count) == (2, 1.0, 1)


def _filled_store() -> InMemoryEventStore:
    store = InMemoryEventStore(clock=lambda: T0)
    store.append([s.event for s in two_incidents()])
    return store


def test_views_tail_the_log_and_check_it_at_most_every_refresh():
    store = _filled_store()
    reads: list[int] = []
    read = store_reader(store)

    def reader(after: int, limit: int):
        reads.append(after)
        return read(after, limit)

    views = LiveViews(reader, store.last_position, refresh_s=3600, batch=100)
    assert views.catch_up() == store.last_position()
    assert reads == list(range(0, store.last_position(), 100))
    assert views.jobs[JOB].view.events == store.last_position()
    store.append([Events("other").joined("m9")])
    assert views.catch_up() == store.last_position() - 1, "checked within refresh_s: not again"
    reads.clear()
    assert views.catch_up(force=True) == store.last_position()
    assert reads == [store.last_position() - 1]
    assert list(views.jobs) == [JOB, "other"]


@pytest.mark.parametrize("freeze", [False, True])
def test_a_server_freezes_its_heap_at_start_up_and_after_the_warm_up(freeze):
    """With ``freeze_heap`` (``elasticctl api``'s own views) what lives at start-up and the
    folded views leave the collected generations: a full collection no longer walks them."""
    import gc

    store = _filled_store()
    gc.unfreeze()
    try:
        views = LiveViews(store_reader(store), store.last_position, freeze_heap=freeze)
        views.warm_up()
        views.close()
        assert views.position == store.last_position()
        frozen = gc.get_freeze_count()
        assert (frozen > 0) is freeze
        if freeze:
            entry = views.jobs[JOB]
            assert not any(o is entry for o in gc.get_objects()), "the views are frozen"
    finally:
        gc.unfreeze()


async def test_event_pages_from_any_store_filter_like_postgres():
    """The generic (non-PostgreSQL) page: same filters, same cursor rule."""
    store = _filled_store()
    app = create_app(Settings(api_refresh_s=0), store)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
        url = f"/api/v1/jobs/{JOB}/events"
        page = EventPage.model_validate(
            (await api.get(url, params={"member": "w10", "type": "train.step", "limit": 3})).json()
        )
        expected = [
            s.position
            for s in store.read(job_id=JOB, types=["train.step"])
            if s.event.member == "w10"
        ]
        assert [e.position for e in page.events] == expected[:3]
        assert page.next_after == expected[2]
        empty = (await api.get(url, params={"since": "2030-01-01T00:00:00Z"})).json()
        assert empty == {"events": [], "next_after": None}
        assert (await api.get(url, params={"until": "0.5"})).status_code == 422


def test_a_scan_since_a_time_starts_where_the_views_saw_it_begin():
    from controlplane.api.views import JobEntry
    from controlplane.core.records import StoredEvent
    from controlplane.core.steps import TIME_MARK_EVERY

    log = two_incidents()
    entry = JobEntry(view=final_view_of(log))
    entry.steps.count(log)
    every = TIME_MARK_EVERY
    assert entry.steps.mark_positions == [s.position for s in log[::every]]
    late = log[-1].recorded_at
    start = entry.after(late)
    assert 0 < start < log[-1].position
    assert all(s.recorded_at < late for s in log if s.position <= start)
    assert entry.after(log[0].recorded_at) == 0
    # A time recorded out of order: no shortcut any more.
    back = StoredEvent(log[-1].position + 1, log[0].recorded_at, log[-1].event)
    entry.steps.count([back])
    assert not entry.steps.monotone and entry.after(late) == 0


def final_view_of(log):
    from controlplane.core.fold import fold

    return fold(None, log)
