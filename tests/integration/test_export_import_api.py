"""Export -> import into a fresh database -> identical API answers, route by route.

Database A holds a log as a control plane leaves it: two synthetic jobs ingested live (stamped
now, interleaved, with a sequence gap filled late) and the recorded run with two incidents
(with its own recorded times). ``elasticctl export`` writes it to a file; ``elasticctl migrate``
and ``elasticctl import`` (twice: it is idempotent) load it into a fresh database B. An API is
served over each database (``create_app`` as ``elasticctl api`` makes it), both are crawled the
same way (every job, every incident, event pages under many cursor / filter combinations
followed to the end, error answers), and every answer of B must equal A's: status, headers
(ETag and Cache-Control included) and body, byte for byte.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from typer.testing import CliRunner

from controlplane.api import create_app
from controlplane.cli import app as cli
from controlplane.settings import Settings
from controlplane.store.postgres import PostgresEventStore
from controlplane.synth import SyntheticJob
from schemas.events import EVENT_ADAPTER, EnvelopeBase
from tests.conftest import Services, with_database
from tests.recorded import JOB, two_incidents

pytestmark = pytest.mark.services

API = "/api/v1"
SYNTH = "job-synth"
LATER = "job-later"
#: Headers that differ between two processes answering the same log (none so far: an ASGI
#: transport adds no ``date`` or ``server`` header). Everything else is compared.
PROCESS_HEADERS: frozenset[str] = frozenset({"date", "server"})
#: ``/metrics`` lines that describe this process, not the log: prometheus_client's
#: ``*_created`` samples are the wall-clock time the counter object was made in the process.
PROCESS_METRICS = ("_created",)
#: Goodput gauges: a job still running is measured to the time of the scrape, not the log's.
CLOCK_METRICS = ("elastic_job_wall_seconds", "elastic_job_goodput_seconds", "elastic_job_ettr")
#: The source log's jobs that have not ended (the synthetic ones).
RUNNING = ("job-synth", "job-later")


@dataclass(frozen=True)
class Answer:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


# --------------------------------------------------------------------------- the two logs


def _cli(args: list[str], url: str) -> str:
    result = CliRunner().invoke(cli, args, env={"ELASTIC_DATABASE_URL": url})
    assert result.exit_code == 0, (args, result.stdout, result.stderr)
    return result.stdout


def _fill_source(store: PostgresEventStore) -> None:
    """Two synthetic jobs ingested live, interleaved (a job's positions are not contiguous),
    one event arriving late (a gap filled later), then the recorded two-incident run."""
    synth, later = SyntheticJob(SYNTH, members=4, seed=3), SyntheticJob(LATER, members=2, seed=5)

    def envelopes(job: SyntheticJob, count: int) -> list[EnvelopeBase]:
        raw = [*job.controlplane_events(), *job.member_events(count)]
        return [EVENT_ADAPTER.validate_python(e, strict=False) for e in raw]

    a, b = envelopes(synth, 240), envelopes(later, 90)
    late = a[50]
    for start in range(0, len(a), 40):
        store.append([e for e in a[start : start + 40] if e is not late])
        store.append(b[start // 40 * 15 : (start // 40 + 1) * 15])
    store.append([late])
    assert store.seq_gaps(), "the live ingest left a gap filled late"
    store.import_events(two_incidents())


@pytest.fixture
def target_url(services: Services) -> Iterator[str]:
    """A fresh database with no schema (the import's target), dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(services.database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield with_database(services.database_url, name)
    with psycopg.connect(services.database_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --------------------------------------------------------------------------- crawling


@asynccontextmanager
async def served(settings: Settings, database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The API over the database at ``database_url``, as ``elasticctl api`` builds it (its own
    store from the settings), with its start-up and shutdown run around the client."""
    app = create_app(settings.model_copy(update={"database_url": database_url, "api_refresh_s": 0}))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c,
    ):
        yield c


class Crawler:
    """Requests every route of one API and keeps each answer by request. Which requests are
    made depends only on earlier answers, so two equal APIs are crawled identically."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.answers: dict[str, Answer] = {}

    async def get(self, path: str, **params: object) -> Answer:
        response = await self.client.get(path, params=params)  # type: ignore[arg-type]
        key = response.request.url.raw_path.decode()
        headers = tuple(
            sorted((k, v) for k, v in response.headers.items() if k not in PROCESS_HEADERS)
        )
        answer = Answer(response.status_code, headers, response.content)
        assert key not in self.answers, f"{key} requested twice"
        self.answers[key] = answer
        return answer

    async def pages(self, job: str, label: str, **params: object) -> list[dict[str, Any]]:
        """Every page of ``job``'s events under ``params``, following ``next_after``."""
        events: list[dict[str, Any]] = []
        after = params.pop("after", 0)
        while True:
            answer = await self.get(f"{API}/jobs/{job}/events", after=after, **params)
            assert answer.status == 200, (label, answer.body)
            page = answer.json()
            assert isinstance(page, dict)
            events.extend(page["events"])
            if page["next_after"] is None:
                return events
            after = page["next_after"]

    async def crawl(self) -> None:
        jobs = (await self.get(f"{API}/jobs")).json()
        assert isinstance(jobs, dict)
        for job in [j["job_id"] for j in jobs["jobs"]]:
            await self.crawl_job(job)
        for path in (
            "/jobs/nope",
            "/jobs/nope/events",
            "/jobs/nope/loss",
            f"/jobs/{JOB}/incidents/x",
        ):
            assert (await self.get(API + path)).status == 404
        assert (await self.get(f"{API}/jobs/{JOB}/events", limit=0)).status == 422
        assert (await self.get("/healthz")).status == 200
        assert (await self.get("/openapi.json")).status == 200

    async def crawl_job(self, job: str) -> None:
        for route in ("", "/cluster", "/loss"):
            assert (await self.get(f"{API}/jobs/{job}{route}")).status == 200
        incidents = (await self.get(f"{API}/jobs/{job}/incidents")).json()
        assert isinstance(incidents, list)
        for incident in incidents:
            answer = await self.get(f"{API}/jobs/{job}/incidents/{incident['incident_id']}")
            assert answer.status == 200
        everything = await self.pages(job, "all", limit=1000)
        assert everything, f"{job} has no events"
        positions = [e["position"] for e in everything]
        for limit in (100, 37, 7):
            assert await self.pages(job, f"limit {limit}", limit=limit) == everything
        # Cursors that are not the job's positions: between them, before, past the head.
        middle = positions[len(positions) // 2]
        for after in (positions[0] - 1, middle - 1, middle, middle + 1, positions[-1], 2**40):
            await self.pages(job, f"after {after}", after=after, limit=50)
        types = list(dict.fromkeys(e["type"] for e in everything))
        for kind in types:
            await self.pages(job, kind, type=kind, limit=25)
        await self.pages(job, "rare, one by one", type=types[-3:], limit=1)
        await self.pages(job, "two types", type=types[:2], after=middle, limit=40)
        members = sorted({e["source"].partition("/")[2] for e in everything} - {""})
        for member in members:
            await self.pages(job, member, member=member, limit=60)
        start = datetime.fromisoformat(everything[0]["recorded_at"])
        end = datetime.fromisoformat(everything[-1]["recorded_at"])
        third = (end - start) / 3
        for since, until in ((start, start + third), (start + third, end), (end, end + third)):
            await self.pages(job, "window", since=since.isoformat(), until=until.isoformat())
        if members and types:
            await self.pages(
                job,
                "member, type and window",
                member=members[0],
                type=types[-1],
                since=(start + timedelta(microseconds=1)).isoformat(),
                limit=3,
            )


async def crawl(settings: Settings, database_url: str) -> tuple[dict[str, Answer], str]:
    async with served(settings, database_url) as client:
        crawler = Crawler(client)
        await crawler.crawl()
        metrics = (await client.get("/metrics")).text
    return crawler.answers, metrics


async def revalidate(settings: Settings, database_url: str, answers: dict[str, Answer]) -> int:
    """Ask the API at ``database_url`` for each answer with its ETag: each must be a 304."""
    checked = 0
    async with served(settings, database_url) as client:
        for key, answer in answers.items():
            etag = dict(answer.headers).get("etag")
            if etag is None:
                continue
            response = await client.get(key, headers={"If-None-Match": etag})
            assert response.status_code == 304, (key, response.status_code)
            assert response.headers["etag"] == etag
            checked += 1
    return checked


def _log_metrics(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        series = line.split(" ")[0]
        if any(part in series for part in PROCESS_METRICS):
            continue
        clocked = series.startswith(CLOCK_METRICS) and any(
            f'job_id="{j}"' in series for j in RUNNING
        )
        out.append(series if clocked else line)  # clocked: the series, not its value
    return out


# --------------------------------------------------------------------------- the test


async def test_an_imported_log_answers_every_route_like_the_original(
    pg_store: PostgresEventStore,
    settings: Settings,
    database_url: str,
    target_url: str,
    tmp_path: Path,
) -> None:
    _fill_source(pg_store)
    exported = tmp_path / "log.jsonl"
    _cli(["export", "--output", str(exported)], database_url)
    assert exported.read_bytes().count(b"\n") == pg_store.last_position()

    assert json.loads(_cli(["migrate", "--json"], target_url))["from"] is None
    first = json.loads(_cli(["import", str(exported), "--batch", "97", "--json"], target_url))
    assert first["imported"] == pg_store.last_position() and first["positions_kept"] is True
    assert first["rejected"] == 0 and first["jobs"] == [SYNTH, LATER, JOB]
    again = json.loads(_cli(["import", str(exported), "--json"], target_url))
    assert again["imported"] == 0 and again["duplicates"] == first["imported"]

    original, original_metrics = await crawl(settings, database_url)
    imported, imported_metrics = await crawl(settings, target_url)

    # The same requests were made (the crawl follows the answers), in the same order.
    assert list(imported) == list(original)
    for key, answer in original.items():
        copy = imported[key]
        assert copy.status == answer.status, key
        assert copy.json() == answer.json(), key
        assert copy.body == answer.body, key
        assert copy.headers == answer.headers, key
    # /metrics are computed from the folded log, so they agree too (but for process lines).
    assert _log_metrics(imported_metrics) == _log_metrics(original_metrics)

    # ETags are a function of the log: B validates A's, and A validates B's.
    assert await revalidate(settings, target_url, original) == await revalidate(
        settings, database_url, imported
    )

    # The crawl covered what it should have: three jobs, the two incidents, many pages.
    jobs = original[f"{API}/jobs"].json()
    assert [j["job_id"] for j in jobs["jobs"]] == [SYNTH, LATER, JOB]  # type: ignore[index]
    timelines = [
        k for k in original if k.startswith(f"{API}/jobs/{JOB}/incidents/") and "/x" not in k
    ]
    assert len(timelines) == 2
    assert all("immutable" in dict(original[k].headers)["cache-control"] for k in timelines)
    pages = [k for k in original if "/events?" in k]
    assert len(pages) > 500
    assert any("immutable" in dict(original[k].headers)["cache-control"] for k in pages)
    assert any(dict(original[k].headers)["cache-control"] == "no-cache" for k in pages)
