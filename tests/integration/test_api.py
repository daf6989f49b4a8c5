"""The REST API over a recorded run with two incidents, in a real PostgreSQL log."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta, timezone

import httpx
import psycopg
import pytest
from pydantic import SecretStr

from controlplane.api import create_app, render
from controlplane.core.goodput import TERMS
from controlplane.core.records import StoredEvent
from controlplane.core.timeline import POINTS
from controlplane.devstack import free_port
from controlplane.errors import StoreUnavailable
from controlplane.settings import Settings
from controlplane.store.postgres import PostgresEventStore
from controlplane.synth import SyntheticJob
from schemas.api import (
    Cluster,
    EventOut,
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
from tests.integration.helpers import publish, valid_messages
from tests.recorded import JOB, LAST_STEP, final_view, loss_at, two_incidents

pytestmark = pytest.mark.services

API = "/api/v1"
READ_TOKEN = "t0ken-read-4c1d"
WRITE_TOKEN = "t0ken-write-9e2f"
#: The event behind each point of a timeline, by the point's name.
POINT_TYPES = {
    "fault": {"member.exited", "member.heartbeat", "member.fault"},
    "detected": {"fault.detected"},
    "decided": {"reallocation.issued"},
    "acked": {"command.acked"},
    "restored": {"restore.completed"},
    "first_step": {"train.step"},
}


def record(store: PostgresEventStore, database_url: str, log: list[StoredEvent]) -> None:
    """Append ``log`` and give its events the positions and recorded times of the recording."""
    result = store.append([s.event for s in log])
    assert [s.position for s in result.stored] == [s.position for s in log]
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE events SET recorded_at = u.at FROM unnest(%s::int8[], %s::timestamptz[])"
            " AS u(p, at) WHERE position = u.p",
            ([s.position for s in log], [s.recorded_at for s in log]),
        )


@pytest.fixture
def recorded(pg_store: PostgresEventStore, database_url: str) -> list[StoredEvent]:
    log = two_incidents()
    record(pg_store, database_url, log)
    return log


@asynccontextmanager
async def client_for(
    settings: Settings, store: PostgresEventStore
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app over ``store``, its start-up and shutdown run around it."""
    app = create_app(settings, store)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://api") as client,
    ):
        yield client


@pytest.fixture
async def api(
    settings: Settings, pg_store: PostgresEventStore, recorded: list[StoredEvent]
) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(settings.model_copy(update={"api_refresh_s": 0.0}), pg_store) as c:
        yield c


async def get_json(api: httpx.AsyncClient, path: str, **params: object) -> object:
    response = await api.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


async def all_events(api: httpx.AsyncClient, limit: int = 100, **params: object) -> list[dict]:
    """Every page of the job's events (following ``next_after``)."""
    out: list[dict] = []
    after = 0
    while True:
        page = EventPage.model_validate(
            await get_json(api, f"{API}/jobs/{JOB}/events", after=after, limit=limit, **params)
        )
        out.extend(e.model_dump(mode="json") for e in page.events)
        if page.next_after is None:
            return out
        assert page.events and page.next_after == page.events[-1].position
        after = page.next_after


# --------------------------------------------------------------------------- every route


async def test_every_route_answers_with_the_views_of_the_recorded_log(api, recorded):
    view = final_view()
    jobs = JobList.model_validate(await get_json(api, f"{API}/jobs"))
    assert jobs == JobList(jobs=[render.job_summary(view)])
    assert jobs.jobs[0].events == len(recorded) and jobs.jobs[0].state == "COMPLETED"

    detail = JobDetail.model_validate(await get_json(api, f"{API}/jobs/{JOB}"))
    assert detail == render.job_detail(view)
    assert [c.to_state for c in detail.history][-1] == "COMPLETED"

    incidents = [
        IncidentSummary.model_validate(i)
        for i in await get_json(api, f"{API}/jobs/{JOB}/incidents")  # type: ignore[union-attr]
    ]
    assert incidents == [render.incident_summary(i) for i in view.incidents.values()]
    assert [i.outcome for i in incidents] == ["recovered", "recovered"]
    assert incidents[0].reasons[0].startswith("w01")
    assert incidents[1].members == ["w10"]

    for incident in incidents:
        timeline = IncidentTimeline.model_validate(
            await get_json(api, f"{API}/jobs/{JOB}/incidents/{incident.incident_id}")
        )
        assert timeline == render.incident_timeline(view.incidents[incident.incident_id])
        assert [p.name for p in timeline.points] == list(POINTS)
        assert timeline.downtime_s == pytest.approx(
            (timeline.points[-1].at - timeline.points[0].at).total_seconds()
        )

    cluster = Cluster.model_validate(await get_json(api, f"{API}/jobs/{JOB}/cluster"))
    assert cluster == render.cluster(view)
    assert cluster.world == ["w00", "spare0", "w11"]
    assert sorted(cluster.topology) == ["rack0", "rack1"]

    loss = LossCurve.model_validate(await get_json(api, f"{API}/jobs/{JOB}/loss"))
    steps = sorted({s.event.payload.step for s in recorded if s.event.type == "train.step"})
    assert [p.step for p in loss.points] == steps
    assert steps[0] == 1 and steps[-1] >= LAST_STEP
    assert all(p.loss == pytest.approx(loss_at(p.step)) for p in loss.points)
    assert loss.faults == {i.incident_id: i.step_at_fault for i in view.incidents.values()}
    few = LossCurve.model_validate(await get_json(api, f"{API}/jobs/{JOB}/loss", points=10))
    assert 0 < len(few.points) <= 10 and few.faults == loss.faults
    assert {p.step for p in few.points} <= set(steps)
    assert max(p.loss for p in few.points) == max(p.loss for p in loss.points)
    assert min(p.loss for p in few.points) == min(p.loss for p in loss.points)
    for bad in (1, 0, "x"):
        assert (await api.get(f"{API}/jobs/{JOB}/loss", params={"points": bad})).status_code == 422

    health = Health.model_validate(await get_json(api, "/healthz"))
    assert health == Health(status="ok", database=True, last_position=len(recorded))

    page = EventPage.model_validate(await get_json(api, f"{API}/jobs/{JOB}/events", limit=5))
    assert [e.position for e in page.events] == [1, 2, 3, 4, 5]
    assert page.events[0].recorded_at == recorded[0].recorded_at
    assert page.events[0].event_id == recorded[0].event.event_id
    assert page.events[0].payload == recorded[0].event.payload.model_dump(mode="json")


async def test_each_timeline_point_names_the_event_behind_it(api):
    incidents = await get_json(api, f"{API}/jobs/{JOB}/incidents")
    assert len(incidents) == 2  # type: ignore[arg-type]
    for incident in incidents:  # type: ignore[union-attr]
        timeline = IncidentTimeline.model_validate(
            await get_json(api, f"{API}/jobs/{JOB}/incidents/{incident['incident_id']}")
        )
        for point in timeline.points:
            page = EventPage.model_validate(
                await get_json(api, f"{API}/jobs/{JOB}/events", after=point.position - 1, limit=1)
            )
            (event,) = page.events
            assert event.position == point.position
            assert event.type in POINT_TYPES[point.name], (point, event.type)
            if point.name != "fault":  # the fault is when its evidence says, not when recorded
                assert event.recorded_at == point.at
        assert timeline.detections == [timeline.points[1].position]
        decided = next(p for p in timeline.points if p.name == "decided")
        assert [d.position for d in timeline.history][-1] == decided.position


# --------------------------------------------------------------------------- events


async def test_paging_returns_every_event_exactly_once_in_order(api, recorded):
    # Every field of every event as stored (PostgreSQL writes each event's JSON).
    expected = [
        EventOut.model_validate(
            {"position": s.position, "recorded_at": s.recorded_at,
             **s.event.model_dump(mode="json", by_alias=True)}
        ).model_dump(mode="json")
        for s in recorded
    ]  # fmt: skip
    for limit in (1000, 37):
        events = await all_events(api, limit=limit)
        assert [e["position"] for e in events] == [s.position for s in recorded]
        assert events == expected
    last = await get_json(api, f"{API}/jobs/{JOB}/events", after=len(recorded))
    assert last == {"events": [], "next_after": None}


async def test_filters_by_type_member_and_time(api, recorded):
    def expected(keep) -> list[int]:
        return [s.position for s in recorded if keep(s)]

    steps = await all_events(api, type="train.step")
    assert [e["position"] for e in steps] == expected(lambda s: s.event.type == "train.step")
    both = await all_events(api, limit=50, type=["command.acked", "restore.completed"])
    assert [e["position"] for e in both] == expected(
        lambda s: s.event.type in ("command.acked", "restore.completed")
    )
    w10 = await all_events(api, member="w10")
    assert [e["position"] for e in w10] == expected(lambda s: s.event.member == "w10")
    assert {e["source"] for e in w10} == {"node-1-0/w10"}

    start = recorded[0].recorded_at
    since, until = start + timedelta(seconds=20), start + timedelta(seconds=25)
    window = await all_events(
        api, since=since.isoformat(), until=until.isoformat(), member="w00", type="train.step"
    )
    assert [e["position"] for e in window] == expected(
        lambda s: (
            since <= s.recorded_at < until
            and s.event.member == "w00"
            and s.event.type == "train.step"
        )
    )
    assert window, "the window holds steps of w00"
    assert await get_json(api, f"{API}/jobs/{JOB}/events", member="nobody") == {
        "events": [],
        "next_after": None,
    }


async def test_a_time_means_the_same_moment_whatever_its_offset(api, recorded):
    """ISO 8601 allows offsets PostgreSQL does not take (past 15:59; schemathesis found
    ``-21:54`` answered with a 503): the API hands times on in UTC."""
    start = recorded[0].recorded_at
    since, until = start + timedelta(seconds=20), start + timedelta(seconds=25)
    far = timezone(-timedelta(hours=21, minutes=54))
    in_utc = await all_events(api, since=since.isoformat(), until=until.isoformat())
    far_off = await all_events(
        api, since=since.astimezone(far).isoformat(), until=until.astimezone(far).isoformat()
    )
    assert in_utc and far_off == in_utc
    page = await api.get(f"{API}/jobs/{JOB}/events", params={"until": "0711-11-22T05:58:05-21:54"})
    assert page.status_code == 200 and page.json()["events"] == []


@pytest.mark.parametrize("tokens", [None, f"{READ_TOKEN}:read, {WRITE_TOKEN}:write"])
async def test_the_hot_routes_answer_byte_for_byte_as_the_fastapi_routes(
    settings, pg_store, recorded, tokens
):
    """``api.hot.HotRoutes`` answers the timelines itself, exactly as FastAPI's route does
    (status, headers, body; 304s too), and leaves FastAPI everything else: errors, a missing
    or weak token, the events pages. The differential: the same store behind an app without
    it (``api_hot_routes=False``)."""
    update = {"api_refresh_s": 0.0, "api_tokens": SecretStr(tokens) if tokens else None}
    app = create_app(settings.model_copy(update=update), pg_store)
    plain_app = create_app(settings.model_copy(update={**update, "api_hot_routes": False}),
                           pg_store)  # fmt: skip
    token = bearer(READ_TOKEN) if tokens else {}
    hot = app.state.api
    view = final_view()
    last = len(recorded)
    events = f"{API}/jobs/{JOB}/events"
    at = recorded[len(recorded) // 2].recorded_at.isoformat()
    timelines = [f"{API}/jobs/{JOB}/incidents/{i}" for i in view.incidents]
    plain = [*timelines, f"{timelines[0]}?unused=1"]
    others = [
        events,
        f"{events}?after=0&limit=1",
        f"{events}?after={last - 3}",
        f"{events}?after={last}",
        f"{events}?after=0007&limit=1000",
        f"{events}?after=+3",  # " 3": both read 3
        f"{events}?type=train.step&limit=7",
        f"{events}?type=command.acked&type=restore.completed&type=command.acked",
        f"{events}?member=w10&after=5&limit=3",
        f"{events}?member=nobody",
        f"{events}?since={at.replace('+', '%2B')}&until=2100-01-01T00:00:00Z&member=w00",
        f"{API}/jobs/nope/incidents/x",
        f"{API}/jobs/{JOB}/incidents/x",
        f"{API}/jobs/nope/events",
        f"{API}/jobs/{JOB}/events/",
        f"{API}/jobs/{JOB}/events?after=1&after=2",
        f"{events}?after=",
        f"{events}?after=-1",
        f"{events}?limit=0",
        f"{events}?type=member.bogus",
        f"{events}?member=a/b",
        f"{events}?until=2026-01-01T00:00:00",
        f"{events}?types=train.step",
        f"{events}?limit=5&unknown=1",
    ]
    async with (
        app.router.lifespan_context(app),
        plain_app.router.lifespan_context(plain_app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=plain_app), base_url="http://api"
        ) as plain_client,
    ):

        async def both(path: str, headers: dict[str, str]) -> tuple[int, httpx.Response]:
            served = hot.hot_served
            fast = await client.get(path, headers=headers)
            took = hot.hot_served - served
            slow = await plain_client.get(path, headers=headers)
            assert plain_app.state.api.hot_served == 0
            assert fast.status_code == slow.status_code, path
            assert fast.headers.multi_items() == slow.headers.multi_items(), path
            assert fast.content == slow.content, path
            return took, fast

        for path in plain:
            took, answer = await both(path, token)
            assert took == 1 and answer.status_code == 200, path
            etag = answer.headers["etag"]
            took, again = await both(path, {**token, "If-None-Match": f'"x", W/{etag}'})
            assert took == 1 and again.status_code == 304 and again.content == b"", path
        for path in others:
            took, _ = await both(path, token)
            assert took == 0, path
        if tokens:
            for headers in ({}, bearer("not-a-token"), bearer(WRITE_TOKEN)):
                took, refused = await both(plain[0], headers)
                assert took == 0 and refused.status_code in (401, 403)

        async def down() -> object:
            raise StoreUnavailable("the database is down")

        app.state.api.views.fresh = plain_app.state.api.views.fresh = down
        took, unavailable = await both(plain[0], token)
        assert took == 1 and unavailable.status_code == 503
    await app.state.api.close()
    await plain_app.state.api.close()


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "path",
    [
        "/jobs/nope",
        "/jobs/nope/events",
        "/jobs/nope/incidents",
        "/jobs/nope/incidents/x",
        "/jobs/nope/cluster",
        "/jobs/nope/loss",
        f"/jobs/{JOB}/incidents/no-such-incident",
    ],
)
async def test_unknown_jobs_and_incidents_are_404_problems(api, path):
    response = await api.get(API + path)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    problem = Problem.model_validate(response.json())
    assert "no job 'nope'" in problem.detail or "no incident" in problem.detail


@pytest.mark.parametrize(
    ("params", "complaint"),
    [
        ({"limit": 0}, "query.limit"),
        ({"limit": 1001}, "query.limit"),
        ({"after": -1}, "query.after"),
        ({"after": 2**63}, "query.after"),
        ({"after": "x"}, "query.after"),
        ({"type": "member.bogus"}, "query.type"),
        ({"member": "a/b"}, "query.member"),
        ({"since": "yesterday"}, "query.since"),
        ({"until": "2026-01-01T00:00:00"}, "timezone"),
        ({"since": "0001-01-01T00:00:00+01:00"}, "out of range"),
    ],
)
async def test_bad_parameters_are_422_problems(api, params, complaint):
    response = await api.get(f"{API}/jobs/{JOB}/events", params=params)
    assert response.status_code == 422, response.text
    assert complaint in Problem.model_validate(response.json()).detail


# --------------------------------------------------------------------------- auth


@pytest.fixture
async def guarded(settings, pg_store, recorded) -> AsyncIterator[httpx.AsyncClient]:
    tokens = SecretStr(f"{READ_TOKEN}:read, {WRITE_TOKEN}:write")
    async with client_for(settings.model_copy(update={"api_tokens": tokens}), pg_store) as c:
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("path", [f"{API}/jobs", f"{API}/jobs/{JOB}/events", "/metrics"])
async def test_tokens_are_required_with_the_read_scope(guarded, path, caplog):
    caplog.set_level(logging.DEBUG)
    missing = await guarded.get(path)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    unknown = await guarded.get(path, headers=bearer("not-a-token"))
    assert unknown.status_code == 401
    assert "invalid_token" in unknown.headers["www-authenticate"]
    basic = await guarded.get(path, headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert basic.status_code == 401
    wrong_scope = await guarded.get(path, headers=bearer(WRITE_TOKEN))
    assert wrong_scope.status_code == 403
    assert "read" in Problem.model_validate(wrong_scope.json()).detail
    assert (await guarded.get(path, headers=bearer(READ_TOKEN))).status_code == 200
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert READ_TOKEN not in logged and WRITE_TOKEN not in logged


async def test_healthz_needs_no_token_and_no_token_is_shown(guarded, settings):
    assert (await guarded.get("/healthz")).status_code == 200
    configured = Settings(api_tokens=f"{READ_TOKEN}:read")
    assert configured.api_tokens is not None
    assert READ_TOKEN not in repr(configured) and READ_TOKEN not in str(configured)
    spec = (await guarded.get("/openapi.json")).json()
    assert "HTTPBearer" in spec["components"]["securitySchemes"]


# --------------------------------------------------------------------------- caching


async def test_closed_incidents_are_immutable_and_the_rest_revalidates(api, recorded):
    incident = (await get_json(api, f"{API}/jobs/{JOB}/incidents"))[0]["incident_id"]  # type: ignore[index]
    closed = await api.get(f"{API}/jobs/{JOB}/incidents/{incident}")
    assert closed.headers["cache-control"] == "public, max-age=31536000, immutable"
    etag = closed.headers["etag"]
    again = await api.get(f"{API}/jobs/{JOB}/incidents/{incident}", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""

    jobs = await api.get(f"{API}/jobs")
    assert jobs.headers["cache-control"] == "no-cache"
    full = await api.get(f"{API}/jobs/{JOB}/events", params={"limit": 10})
    assert full.json()["next_after"] == 10
    assert "immutable" in full.headers["cache-control"]
    last = await api.get(f"{API}/jobs/{JOB}/events", params={"after": len(recorded) - 3})
    assert last.json()["next_after"] is None
    assert last.headers["cache-control"] == "no-cache"
    assert (await api.get("/metrics")).headers["cache-control"] == "no-store"
    assert (await api.get(f"{API}/jobs/nope")).headers["cache-control"] == "no-store"


async def test_views_follow_the_log_by_tailing_it(settings, pg_store, recorded):
    """New events are folded onto the views (read after the last position, never from 0
    again), new jobs appear, ETags move, and closed incidents keep theirs."""
    app = create_app(settings.model_copy(update={"api_refresh_s": 0.0}), pg_store)
    views = app.state.api.views
    reads: list[int] = []
    reader = views._reader

    def recording_reader(after: int, limit: int) -> list[StoredEvent]:
        reads.append(after)
        return reader(after, limit)

    views._reader = recording_reader
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
        first = await api.get(f"{API}/jobs")
        assert first.json()["jobs"][0]["events"] == len(recorded)
        assert reads == [0]
        incident = (await get_json(api, f"{API}/jobs/{JOB}/incidents"))[0]["incident_id"]  # type: ignore[index]
        path = f"{API}/jobs/{JOB}/incidents/{incident}"
        etag = (await api.get(path)).headers["etag"]

        pg_store.append([_envelope(e) for e in SyntheticJob("job-later", seed=3).member_events(30)])
        second = await api.get(f"{API}/jobs", headers={"If-None-Match": first.headers["etag"]})
        assert second.status_code == 200 and second.headers["etag"] != first.headers["etag"]
        assert [j["job_id"] for j in second.json()["jobs"]] == [JOB, "job-later"]
        assert second.json()["jobs"][1]["events"] == 30
        assert reads == [0, len(recorded)]
        assert views.position == len(recorded) + 30
        assert (await api.get(path, headers={"If-None-Match": etag})).status_code == 304
        unchanged = await api.get(f"{API}/jobs", headers={"If-None-Match": second.headers["etag"]})
        assert unchanged.status_code == 304
        assert reads == [0, len(recorded)], "nothing new: nothing read"
    await app.state.api.close()


def _envelope(data: dict):
    from schemas.events import EVENT_ADAPTER

    return EVENT_ADAPTER.validate_python(data, strict=False)


# --------------------------------------------------------------------------- metrics


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in the metrics"
    return float(match.group(1))


async def test_metrics_count_the_log(api, recorded):
    view = final_view()
    response = await api.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert metric(text, "elastic_events_ingested_total") == len(recorded)
    assert metric(text, "elastic_log_position") == len(recorded)
    assert metric(text, "elastic_ingest_lag_seconds") >= 0
    assert metric(text, 'elastic_jobs{state="COMPLETED"}') == 1
    assert metric(text, 'elastic_jobs{state="RUNNING"}') == 0
    job = view.job_id
    assert (
        metric(text, f'elastic_incidents{{job_id="{job}",kind="fault",outcome="recovered"}}') == 2
    )
    assert metric(text, f'elastic_incidents{{job_id="{job}",kind="fault",outcome="open"}}') == 0
    downtimes = sorted(i.downtime_s for i in view.incidents.values())
    assert metric(text, f'elastic_mttr_seconds_count{{job_id="{job}"}}') == 2
    assert metric(text, f'elastic_mttr_seconds_sum{{job_id="{job}"}}') == pytest.approx(
        sum(downtimes)
    )
    for le in ("0.01", "0.1", "1.0", "10.0"):
        below = sum(d <= float(le) for d in downtimes)
        assert metric(text, f'elastic_mttr_seconds_bucket{{job_id="{job}",le="{le}"}}') == below
    assert metric(text, f'elastic_mttr_seconds_bucket{{job_id="{job}",le="+Inf"}}') == 2
    assert (
        metric(text, f'elastic_events_discounted_total{{job_id="{job}",reason="stale_exit"}}') == 0
    )
    assert metric(text, "elastic_dead_letters_total") == 0
    assert "elastic_leader" not in text  # the API is no control plane
    # Goodput per job: its wall time, split by term, and its ETTR.
    wall = metric(text, f'elastic_job_wall_seconds{{job_id="{job}"}}')
    assert wall == pytest.approx(55.5)
    terms = re.findall(
        rf'^elastic_job_goodput_seconds{{job_id="{job}",term="(\w+)"}} (\S+)$', text, re.M
    )
    assert {t for t, _ in terms} == set(TERMS)
    assert sum(float(v) for _, v in terms) == pytest.approx(wall)
    productive = metric(text, f'elastic_job_goodput_seconds{{job_id="{job}",term="productive"}}')
    assert metric(text, f'elastic_job_ettr{{job_id="{job}"}}') == pytest.approx(productive / wall)

    answer = await api.get(f"/api/v1/jobs/{job}/goodput")
    assert answer.status_code == 200, answer.text
    body = GoodputOut.model_validate(answer.json())
    assert body.final and body.wall_s == pytest.approx(wall) and len(body.incidents) == 2
    assert "immutable" in answer.headers["cache-control"]  # the job ended
    assert (await api.get("/api/v1/jobs/nope/goodput")).status_code == 404


@pytest.mark.usefixtures("clean_stream")
async def test_the_control_plane_exports_its_metrics(settings):
    """``elasticctl serve`` with ELASTIC_METRICS_PORT serves what it ingests (token-guarded)."""
    port = free_port()
    env = {
        **os.environ,
        "ELASTIC_NATS_URL": settings.nats_url,
        "ELASTIC_DATABASE_URL": settings.database_url,
        "ELASTIC_RENDEZVOUS_PORT": "0",
        "ELASTIC_INGEST_FETCH_TIMEOUT_S": "0.1",
        "ELASTIC_METRICS_PORT": str(port),
        "ELASTIC_API_TOKENS": f"{READ_TOKEN}:read",
        "ELASTIC_LOG_LEVEL": "WARNING",
    }
    serve = subprocess.Popen([sys.executable, "-m", "controlplane", "serve"], env=env)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            await _until_answers(client, url, serve)
            assert (await client.get(url)).status_code == 401
            await publish(settings.nats_url, valid_messages(SyntheticJob("job-m", seed=2), 40))
            deadline = time.monotonic() + 60
            while True:
                response = await client.get(url, headers=bearer(READ_TOKEN))
                assert response.status_code == 200
                text = response.text
                if metric(text, "elastic_events_ingested_total") >= 40:
                    break
                assert time.monotonic() < deadline, text
                await _sleep(0.2)
        assert sum(metric(text, f'elastic_jobs{{state="{s}"}}') for s in _STATES) == 1
        assert metric(text, 'elastic_mttr_seconds_count{job_id="job-m"}') == 0
        assert "elastic_ingest_lag_seconds" in text
        assert metric(text, "elastic_leader") == 1  # it holds the ingest lock
        assert metric(text, "elastic_dead_letters_total") == 0
    finally:
        serve.terminate()
        serve.wait(30)
    assert serve.returncode == 0


_STATES = ("PENDING", "RUNNING", "DEGRADED", "REALLOCATING", "RECOVERING", "COMPLETED", "STOPPED")


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


async def _until_answers(client: httpx.AsyncClient, url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, "the process exited"
        try:
            await client.get(url)
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"nothing answers at {url}"
            await _sleep(0.1)


async def test_the_page_for_people_is_served_by_the_same_app(api):
    page = await api.get(f"/ui/jobs/{JOB}")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")


# --------------------------------------------------------------------------- a served API


@pytest.fixture(scope="module")
def served(services) -> Iterator[str]:
    """``elasticctl api`` on a database holding the recorded run; its base URL."""
    import uuid

    from controlplane.store import migrate
    from controlplane.store.postgres import make_engine
    from tests.conftest import with_database

    name = f"t_api_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(services.database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = with_database(services.database_url, name)
    engine = make_engine(url, pool_size=1)
    migrate.upgrade(engine)
    engine.dispose()
    store = PostgresEventStore.from_url(url)
    record(store, url, two_incidents())
    store.close()
    port = free_port()
    env = {**os.environ, "ELASTIC_DATABASE_URL": url, "ELASTIC_LOG_LEVEL": "WARNING"}
    env.pop("ELASTIC_API_TOKENS", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "controlplane", "api", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, "elasticctl api exited"
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "elasticctl api did not answer"
            time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        process.wait(30)
        with psycopg.connect(services.database_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_served_api_answers_like_the_app(served):
    jobs = JobList.model_validate(httpx.get(f"{served}/api/v1/jobs").json())
    assert jobs == JobList(jobs=[render.job_summary(final_view())])
    spec = httpx.get(f"{served}/openapi.json").json()
    paths = set(spec["paths"])
    assert {
        "/api/v1/jobs",
        "/api/v1/jobs/{job}",
        "/api/v1/jobs/{job}/events",
        "/api/v1/jobs/{job}/incidents",
        "/api/v1/jobs/{job}/incidents/{incident}",
        "/api/v1/jobs/{job}/cluster",
        "/api/v1/jobs/{job}/loss",
        "/healthz",
        "/metrics",
    } <= paths
    timeline = spec["paths"]["/api/v1/jobs/{job}/incidents/{incident}"]["get"]
    assert "example" in timeline["responses"]["200"]["content"]["application/json"]
    assert timeline["responses"]["404"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Problem"
    }


# --------------------------------------------------------------------------- schemathesis


def _schemathesis_test():
    """Generated requests against ``elasticctl api`` (schemathesis' lazy loader does not run
    on this pytest, so the schema is the app's, and the calls go to the served one)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, settings
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    spec = create_app(Settings(api_tokens=None)).openapi()
    schema = schemathesis.openapi.from_dict(spec)

    @schema.parametrize()
    @settings(
        max_examples=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
        database=None,
    )
    def test_no_request_makes_a_server_error(case, served):
        """Valid and invalid requests get documented answers, never a 5xx. The simulator's
        route refuses a schema-valid run larger than a request may take (422, documented:
        a budget of ranks times expected failures, not a bound a schema can state)."""
        bounded = case.path.endswith("/simulate")
        case.call_and_validate(
            base_url=served, excluded_checks=[positive_data_acceptance] if bounded else None
        )

    return test_no_request_makes_a_server_error


test_no_request_makes_a_server_error = _schemathesis_test()
