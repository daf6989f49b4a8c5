"""The read-only REST API (``/api/v1``): job history, incident timelines, events, metrics.

Views (jobs, incidents, timelines, cluster, loss) come from job views kept in memory and
caught up by tailing the log (``views.py``); events are read from the log by (job, position)
(``sql.py``). Bodies are rendered once per version of a job's view and sent with an ETag;
what can no longer change (a closed incident, a full page of events) is marked immutable.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from anyio import to_thread
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RootModel,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from controlplane.api import examples, render, sql
from controlplane.api.auth import Denied, TokenAuth
from controlplane.api.metrics import CONTENT_TYPE, LogMetrics
from controlplane.api.plan import plan_routes
from controlplane.api.views import JobEntry, LiveViews, Reader, Rendered, store_reader
from controlplane.core.goodput import Goodput
from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView
from controlplane.errors import StoreError
from controlplane.settings import Settings
from controlplane.store.port import EventStore
from controlplane.store.postgres import PostgresEventStore, make_engine
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
from schemas.common import IDENT_PATTERN

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
#: Largest position a cursor may name (PostgreSQL bigint).
MAX_POSITION = 2**63 - 1
MAX_PAGE = 1000
DEFAULT_PAGE = 100
#: Answers that cannot change: a closed incident's timeline, a full page of events.
IMMUTABLE = "max-age=31536000, immutable"
#: Answers that change as the log grows: use them after checking the ETag.
REVALIDATE = "no-cache"
NO_STORE = "no-store"
JSON = "application/json"

#: Every event type the log can hold (a unit test keeps it equal to ``SCHEMA_VERSIONS``).
EventType = Literal[
    "member.joined",
    "member.heartbeat",
    "train.step",
    "backup.snapshot",
    "backup.replicated",
    "checkpoint.saved",
    "member.fault",
    "member.exited",
    "member.launched",
    "command.acked",
    "command.refused",
    "restore.completed",
    "train.resumed",
    "train.completed",
    "train.anomaly",
    "job.registered",
    "generation.started",
    "fault.detected",
    "anomaly.detected",
    "member.slow",
    "job.state_changed",
    "reallocation.issued",
    "incident.resolved",
    "job.stopped",
    "job.completed",
    "liveness.summary",
    "backup.catalog",
]

JobId = Annotated[str, Path(description="The job's id.", examples=["job-recorded"])]
_ISO_8601 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}")


def _iso_8601(value: object) -> object:
    """Accept times as ISO 8601 text only (not as a number of seconds, which pydantic would)."""
    if isinstance(value, str) and not _ISO_8601.match(value):
        raise ValueError("expected an ISO 8601 time with a UTC offset, e.g. 2026-01-01T00:00:00Z")
    return value


def _in_utc(value: datetime) -> datetime:
    """The same moment in UTC: PostgreSQL takes offsets of at most 15:59 (ISO 8601 allows
    more, ``-21:54`` say), and the log's times are UTC anyway."""
    try:
        return value.astimezone(UTC)
    except OverflowError:  # e.g. 0001-01-01T00:00:00+01:00 is a moment of year 0
        raise ValueError("the time is out of range once moved to UTC") from None


#: A time with its offset, e.g. ``2026-01-01T00:00:00Z`` (handed on in UTC).
Time = Annotated[AwareDatetime, BeforeValidator(_iso_8601), AfterValidator(_in_utc)]


def _example(value: Any) -> dict[str, Any]:
    return {"content": {JSON: {"example": value}}}


def _problem(description: str) -> dict[str, Any]:
    return {"model": Problem, "description": description}


Responses = dict[int | str, dict[str, Any]]
_NOT_MODIFIED: Responses = {
    304: {"description": "Not modified: `If-None-Match` names the current ETag."}
}
_UNAVAILABLE: Responses = {503: _problem("The database is unavailable.")}
_NOT_FOUND: Responses = {404: _problem("No such job (or incident).")}
_INVALID: Responses = {422: _problem("A parameter is not valid.")}


class Api:
    """What the routes share: the views, the store, the metrics, the token checker."""

    def __init__(
        self,
        settings: Settings,
        store: EventStore,
        *,
        owned: PostgresEventStore | None = None,
    ) -> None:
        self.store = store
        #: A store the API made itself, and closes on shutdown.
        self.owned = owned
        self.auth = TokenAuth.from_setting(settings.api_tokens)

        def views() -> list[JobView]:
            return self.views.views()

        def goodputs() -> list[Goodput]:
            return self.views.goodputs(self.read_types, datetime.now(UTC))

        self.metrics = LogMetrics(views, goodputs, dead_letters=store.count_dead_letters)
        #: Pages of events straight from PostgreSQL (None: filtered here from ``store.read``).
        self.pages = (
            sql.PageReader(store.engine.url.render_as_string(hide_password=False))
            if isinstance(store, PostgresEventStore)
            else None
        )
        self.views = LiveViews(
            sql_reader(store) or store_reader(store),
            store.last_position,
            refresh_s=settings.api_refresh_s,
            observe=self.metrics.observe,
            async_head=self.pages.head if self.pages is not None else None,
            # The API's own process (``elasticctl api``), not one it shares with a caller.
            freeze_heap=owned is not None,
            snapshot=lambda: store.load_snapshot(steps=True),
            started=self.metrics.started,
        )
        self._rendered: dict[Hashable, Rendered] = {}
        #: Requests the hot routes answered (``controlplane.api.hot``).
        self.hot_served = 0

    async def close(self) -> None:
        """Close the connections the API opened."""
        await to_thread.run_sync(self.views.close)
        if self.pages is not None:
            await self.pages.close()
        if self.owned is not None:
            self.owned.close()

    @property
    def cache_scope(self) -> str:
        """``private`` when answers depend on a token (no shared cache may keep them)."""
        return "private" if self.auth is not None else "public"

    async def entry(self, job: str) -> JobEntry:
        """The job's entry, caught up; 404 for an unknown job."""
        views = await self.views.fresh()
        entry = views.jobs.get(job)
        if entry is None:
            raise HTTPException(404, f"no job {job!r}")
        return entry

    def rendered(
        self, entry: JobEntry, key: Hashable, make: Callable[[JobView], BaseModel], final: bool
    ) -> Rendered:
        """``make(view)`` as sent, rendered once per version of the job's view."""
        view = entry.view
        hit = entry.cached(key, view.last_position)
        if hit is None:
            body = make(view).model_dump_json().encode()
            hit = entry.rendered[key] = Rendered(view.last_position, body, _etag(body), final)
        return hit

    def rendered_jobs(self) -> Rendered:
        """``GET /jobs``, rendered once per log position folded."""
        position = self.views.position
        hit = self._rendered.get("jobs")
        if hit is None or hit.version != position:
            jobs = JobList(jobs=[render.job_summary(v) for v in self.views.views()])
            body = jobs.model_dump_json().encode()
            hit = self._rendered["jobs"] = Rendered(position, body, _etag(body))
        return hit

    def send(self, request: Request, rendered: Rendered) -> Response:
        """The body with its ETag and caching headers; 304 when the client has it."""
        return self.answer(request.headers.get("if-none-match"), rendered)

    def answer(self, if_none_match: str | None, rendered: Rendered) -> Response:
        """``rendered`` as sent to a client whose ``If-None-Match`` is ``if_none_match``."""
        cache = f"{self.cache_scope}, {IMMUTABLE}" if rendered.final else REVALIDATE
        headers = {"ETag": rendered.etag, "Cache-Control": cache}
        if _matches(if_none_match, rendered.etag):
            return Response(status_code=304, headers=headers)
        return Response(rendered.body, media_type=JSON, headers=headers)

    async def timeline(self, job: str, incident: str) -> Rendered:
        """``GET /jobs/{job}/incidents/{incident}`` (404: no such job or incident)."""
        entry = await self.entry(job)
        found = entry.view.incidents.get(incident)
        if found is None:
            raise HTTPException(404, f"job {job!r} has no incident {incident!r}")
        final = found.outcome is not None

        def make(view: JobView) -> BaseModel:
            return render.incident_timeline(view.incidents[incident])

        return self.rendered(entry, ("timeline", incident), make, final)

    def read_types(
        self, job: str, after: int, limit: int, types: Sequence[str]
    ) -> list[StoredEvent]:
        """Up to ``limit`` of ``job``'s events of ``types`` after ``after`` (the goodput
        counter of a job the views started from a snapshot reads them once)."""
        return self.store.read(job_id=job, after=after, limit=limit, types=types)

    async def goodput(self, job: str) -> Rendered:
        """``GET /jobs/{job}/goodput`` (404: no such job, or not registered yet). A job
        that ended never changes again (``final``)."""
        await self.entry(job)

        def make() -> Rendered:
            found = self.views.goodput(job, self.read_types, datetime.now(UTC))
            if found is None:
                raise HTTPException(404, f"job {job!r} is not registered yet")
            body = render.goodput(found).model_dump_json().encode()
            return Rendered(0, body, _etag(body), final=found.final)

        return await to_thread.run_sync(make)

    async def events(self, job: str, params: EventParams) -> Rendered:
        """``GET /jobs/{job}/events``: a page of events as PostgreSQL wrote them (404: no such
        job). A page with a next one never changes (``final``)."""
        entry = await self.entry(job)
        after = params.after
        if params.since is not None:  # skip what was recorded before, without reading it
            after = max(after, entry.after(params.since))
        query = sql.EventQuery(
            job_id=job,
            after=after,
            limit=params.limit,
            types=tuple(dict.fromkeys(params.types or ())),
            member=params.member,
            since=params.since,
            until=params.until,
        )
        if self.pages is not None:
            page = await self.pages.page(query)
        else:
            page = await to_thread.run_sync(_page, self.store, query)
        next_after = page.next_after
        body = b'{"events":[%s],"next_after":%s}' % (
            page.events,
            b"null" if next_after is None else str(next_after).encode(),
        )
        return Rendered(0, body, _etag(body), final=next_after is not None)


def _etag(body: bytes) -> str:
    """A strong ETag of ``body``: 96 bits of its SHA-1 (not a signature: an identity; SHA-1
    is the fastest hash hashlib has, a third of BLAKE2b's time on a page of events)."""
    return '"' + hashlib.sha1(body, usedforsecurity=False).hexdigest()[:24] + '"'


def _matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",")}
    return etag in tags or "*" in tags


def sql_reader(store: EventStore) -> Reader | None:
    """The PostgreSQL store's fast tail (JSON rows, validated once), None for other stores."""
    if isinstance(store, PostgresEventStore):
        engine = store.engine
        return lambda after, limit: sql.tail(engine, after, limit)
    return None


# --------------------------------------------------------------------------- routes


def _view_routes(api: Api, router: APIRouter) -> None:
    @router.get(
        "/jobs",
        response_model=JobList,
        summary="Every job in the log",
        responses={200: _example(examples.JOB_LIST), **_NOT_MODIFIED},
    )
    async def list_jobs(request: Request) -> Response:
        """Every job the log holds, in order of its first event, with its state and counts."""
        await api.views.fresh()
        return api.send(request, api.rendered_jobs())

    @router.get(
        "/jobs/{job}",
        response_model=JobDetail,
        summary="A job: its summary, policy and state-machine history",
        responses={200: _example(examples.JOB_DETAIL), **_NOT_MODIFIED, **_NOT_FOUND},
    )
    async def job_detail(request: Request, job: JobId) -> Response:
        """The job's summary, its registered policy and every transition of its state."""
        entry = await api.entry(job)
        return api.send(request, api.rendered(entry, "detail", render.job_detail, False))

    @router.get(
        "/jobs/{job}/incidents",
        response_model=list[IncidentSummary],
        summary="A job's incidents",
        responses={200: _example(examples.INCIDENTS), **_NOT_MODIFIED, **_NOT_FOUND},
    )
    async def incidents(request: Request, job: JobId) -> Response:
        """Every incident of the job in the order they opened, with outcome and cost."""
        entry = await api.entry(job)

        def make(view: JobView) -> BaseModel:
            return _IncidentList([render.incident_summary(i) for i in view.incidents.values()])

        return api.send(request, api.rendered(entry, "incidents", make, False))

    @router.get(
        "/jobs/{job}/incidents/{incident}",
        response_model=IncidentTimeline,
        summary="An incident's recovery timeline",
        responses={200: _example(examples.TIMELINE), **_NOT_MODIFIED, **_NOT_FOUND},
    )
    async def incident_timeline(
        request: Request,
        job: JobId,
        incident: Annotated[str, Path(description="The incident's id.")],
    ) -> Response:
        """The points of the recovery (fault, detected, decided, acked, restored, first step),
        each with the log position of the event behind it, the phases between them, the
        decisions taken and what the incident cost. A closed incident never changes: its
        answer may be cached for good."""
        return api.send(request, await api.timeline(job, incident))

    @router.get(
        "/jobs/{job}/cluster",
        response_model=Cluster,
        summary="A job's members, topology, backups and state",
        responses={200: _example(examples.CLUSTER), **_NOT_MODIFIED, **_NOT_FOUND},
    )
    async def cluster(request: Request, job: JobId) -> Response:
        """Members (with rank, phase and last heartbeat), the topology (rack, node, members),
        the world, the backup placement and catalog, and the job's state."""
        entry = await api.entry(job)
        rendered = entry.cached("cluster", entry.view.last_position)
        if rendered is None:  # a big world takes a while: not on the event loop
            rendered = await to_thread.run_sync(
                lambda: api.rendered(entry, "cluster", render.cluster, False)
            )
        return api.send(request, rendered)

    @router.get(
        "/jobs/{job}/loss",
        response_model=LossCurve,
        summary="A job's loss by step, with fault markers",
        responses={200: _example(examples.LOSS), **_NOT_MODIFIED, **_NOT_FOUND},
    )
    async def loss(
        request: Request,
        job: JobId,
        points: Annotated[
            int | None,
            Query(
                ge=2,
                le=1_000_000,
                description="At most this many points, for a chart: the steps cut into "
                "points/2 runs, and of each run its lowest and highest loss (a one-step spike "
                "is kept). Default: every step.",
            ),
        ] = None,
    ) -> Response:
        """The mean of the ranks' losses at each step (a newer generation's reports replace
        an older one's, after a roll-back), and the step each fault opened at."""
        entry = await api.entry(job)
        key = ("loss", points)

        def make() -> Rendered:
            with api.views.locked():  # the loss table is the tail's to mutate
                return api.rendered(
                    entry,
                    key,
                    lambda view: render.loss_curve(view, entry.loss_points(points)),
                    False,
                )

        rendered = entry.cached(key, entry.view.last_position)
        if rendered is None:
            rendered = await to_thread.run_sync(make)
        return api.send(request, rendered)

    @router.get(
        "/jobs/{job}/goodput",
        response_model=GoodputOut,
        summary="A job's goodput: its wall time by term, ETTR, each incident's cost",
        responses={200: _example(examples.GOODPUT), **_NOT_MODIFIED, **_NOT_FOUND},
    )
    async def goodput(request: Request, job: JobId) -> Response:
        """The job's wall time, from its registration to its end (or now), split into
        productive, recomputation, backup, stragglers, detection, decision, restore, resume,
        waiting and idle seconds (docs/design.md, "Goodput accounting"); its ETTR (productive
        / wall); per incident its window by phase and the recomputation it caused; per
        generation the same terms. A job that ended never changes: its answer may be cached
        for good."""
        return api.send(request, await api.goodput(job))


class EventParams(BaseModel):
    """The query of ``GET /jobs/{job}/events`` (validated in one go)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    after: int = Field(
        0, ge=0, le=MAX_POSITION, description="Cursor: events after this log position."
    )
    limit: int = Field(DEFAULT_PAGE, ge=1, le=MAX_PAGE, description="Most events in the page.")
    types: list[EventType] | None = Field(
        None, alias="type", description="Only these types (repeat the parameter)."
    )
    member: str | None = Field(
        None,
        pattern=IDENT_PATTERN,
        description="Only events whose source is this member (`<node>/<member>`).",
    )
    since: Time | None = Field(None, description="Only events recorded at or after this time.")
    until: Time | None = Field(None, description="Only events recorded before this time.")


class _IncidentList(RootModel[list[IncidentSummary]]):
    """The incidents as one model, rendered like the other answers."""


def _event_routes(api: Api, router: APIRouter) -> None:
    @router.get(
        "/jobs/{job}/events",
        response_model=EventPage,
        summary="A page of a job's events",
        responses={200: _example(examples.EVENT_PAGE), **_NOT_MODIFIED, **_NOT_FOUND},
    )
    async def events(
        request: Request, job: JobId, params: Annotated[EventParams, Query()]
    ) -> Response:
        """The job's events in log order, after the cursor ``after``, optionally filtered by
        type, member and time recorded. Pass ``next_after`` as ``after`` for the next page;
        it is null when no event after this page matches (yet). A page with a
        ``next_after`` never changes and may be cached for good."""
        return api.send(request, await api.events(job, params))


def _page(store: EventStore, query: sql.EventQuery) -> sql.Page:
    """A page of events as JSON (UTF-8), filtered here (a store other than PostgreSQL)."""
    out: list[bytes] = []
    after = query.after
    while len(out) <= query.limit:
        batch = store.read(job_id=query.job_id, after=after, limit=1000, types=query.types)
        for stored in batch:
            event = stored.event
            if (
                (query.member is None or event.member == query.member)
                and (query.since is None or stored.recorded_at >= query.since)
                and (query.until is None or stored.recorded_at < query.until)
            ):
                out.append(_event_json(stored))
        if len(batch) < 1000:
            break
        after = batch[-1].position
    more = len(out) > query.limit
    texts = out[: query.limit]
    next_after = EventOut.model_validate_json(texts[-1]).position if more else None
    return sql.Page(b",".join(texts), len(texts), next_after)


def _event_json(stored: Any) -> bytes:
    event = stored.event
    return (
        EventOut(
            position=stored.position,
            recorded_at=stored.recorded_at,
            event_id=event.event_id,
            job_id=event.job_id,
            type=event.type,
            v=event.v,
            source=event.source,
            incarnation=event.incarnation,
            seq=event.seq,
            generation=event.generation,
            emitted_at=event.emitted_at,
            payload=event.payload.model_dump(mode="json"),
        )
        .model_dump_json()
        .encode()
    )


def _service_routes(api: Api, app: FastAPI, guard: list[Any]) -> None:
    @app.get(
        "/healthz",
        response_model=Health,
        summary="Liveness and the database",
        responses={200: _example(examples.HEALTH), 503: {"model": Health}},
    )
    async def healthz() -> JSONResponse:
        """``ok`` with the log's last position when the database answers; 503 otherwise.
        Needs no token."""
        try:
            if api.pages is not None:
                head = await api.pages.head()
            else:
                head = await to_thread.run_sync(api.store.last_position)
        except StoreError:
            health = Health(status="unavailable", database=False, last_position=api.views.position)
            return JSONResponse(health.model_dump(), 503, headers={"Cache-Control": NO_STORE})
        health = Health(status="ok", database=True, last_position=head)
        return JSONResponse(health.model_dump(), headers={"Cache-Control": NO_STORE})

    @app.get(
        "/metrics",
        summary="Prometheus metrics",
        dependencies=guard,
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        """Events ingested, ingest lag, incidents by outcome, MTTR histogram, jobs by state
        (Prometheus text format)."""
        try:
            await api.views.fresh()
        except StoreError as exc:  # serve what is known; healthz reports the database
            log.warning("metrics from views at position %d: %s", api.views.position, exc)
        body = await to_thread.run_sync(api.metrics.exposition)
        return Response(body, media_type=CONTENT_TYPE, headers={"Cache-Control": NO_STORE})


# --------------------------------------------------------------------------- errors


def _problem_response(
    status: int, detail: str, headers: Mapping[str, str] | None = None
) -> Response:
    return JSONResponse(
        Problem(detail=detail).model_dump(),
        status,
        headers={"Cache-Control": NO_STORE, **(headers or {})},
    )


def _unavailable() -> Response:
    return _problem_response(503, "the database is unavailable; retry later")


def _location(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc)


def _install_error_handlers(app: FastAPI) -> None:
    async def invalid(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        detail = "; ".join(f"{_location(e['loc'])}: {e['msg']}" for e in exc.errors())
        return _problem_response(422, detail or "invalid request")

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return _problem_response(exc.status_code, str(exc.detail), exc.headers)

    async def denied(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, Denied)
        return _problem_response(exc.status, exc.detail, {"WWW-Authenticate": exc.challenge})

    async def store_error(_: Request, exc: Exception) -> Response:
        log.warning("database error: %s", exc)
        return _unavailable()

    async def internal(_: Request, exc: Exception) -> Response:
        return _problem_response(500, "internal error; the API's log has the details")

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Denied, denied)
    app.add_exception_handler(StoreError, store_error)
    app.add_exception_handler(Exception, internal)  # logged by the server, answered as JSON


# --------------------------------------------------------------------------- the app


#: The security scheme in the OpenAPI document (the check itself is ``TokenAuth``'s).
_BEARER = HTTPBearer(
    auto_error=False, description="A token of ELASTIC_API_TOKENS with the `read` scope."
)


def _guard(api: Api) -> list[Any]:
    """The dependency that requires the ``read`` scope, when tokens are configured."""
    auth = api.auth
    if auth is None:
        return []

    async def require_read(
        request: Request,
        _: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)],
    ) -> None:
        auth.check(request.headers.get("authorization"))

    return [Depends(require_read)]


def _web_router() -> APIRouter | None:
    """The page for people (``controlplane.web.router``) when it is installed."""
    try:
        module = importlib.import_module("controlplane.web")
    except ModuleNotFoundError as exc:
        if exc.name == "controlplane.web":
            return None
        log.warning("the page is not served: %s", exc)
        return None
    except Exception as exc:  # a page that cannot load must not take the API down
        log.warning("the page is not served: %s", exc)
        return None
    router = getattr(module, "router", None)
    return router if isinstance(router, APIRouter) else None


_DESCRIPTION = """\
Read-only history of elastic training jobs, folded from the control plane's event log:
jobs and their state machines, incidents and their recovery timelines (each point names the
log position of the event behind it, so `/jobs/{job}/events?after=position-1&limit=1` fetches
it), the cluster, the loss curve, and the events themselves (cursor paging).

When `ELASTIC_API_TOKENS` is set, every route but `/healthz` needs
`Authorization: Bearer <token>` with the `read` scope (401 without or with an unknown token,
403 with a token lacking the scope). Errors are `{"detail": "..."}`.
"""


def create_app(settings: Settings, store: EventStore | None = None) -> FastAPI:
    """The API over ``store`` (default: the PostgreSQL log at ``settings.database_url``)."""
    owned = None
    if store is None:
        owned = PostgresEventStore(make_engine(settings.database_url, pool_size=8))
        store = owned
    api = Api(settings, store, owned=owned)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        api.views.warm_up()
        try:
            yield
        finally:
            await api.close()

    app = FastAPI(
        title="elastic-controlplane API",
        version="1",
        description=_DESCRIPTION,
        lifespan=lifespan,
        responses={**_UNAVAILABLE},
    )
    app.state.api = api
    guard = _guard(api)
    auth_errors: Responses = (
        {401: _problem("No bearer token, or an unknown one."), 403: _problem("No `read` scope.")}
        if guard
        else {}
    )
    router = APIRouter(prefix=API_PREFIX, dependencies=guard, responses={**auth_errors, **_INVALID})
    _view_routes(api, router)
    _event_routes(api, router)
    plan_routes(router)
    app.include_router(router)
    _service_routes(api, app, guard)
    _install_error_handlers(app)
    web = _web_router()
    if web is not None:
        app.include_router(web)
    if settings.api_hot_routes:
        from controlplane.api.hot import HotRoutes  # it imports this module

        app.add_middleware(HotRoutes, api=api)
    return app
