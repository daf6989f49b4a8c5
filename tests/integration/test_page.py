"""The timeline page in a real browser: headless Chromium renders a recorded run.

The page (``controlplane.web``) is served by the real API app (``create_app``) over PostgreSQL
holding the recorded two-incident run (``tests.recorded``), with uvicorn on a free port;
Chromium loads it, runs its scripts, and the test reads the DOM they built. A screenshot is
kept under ``test-artifacts/`` (or the folder ``ELASTIC_TEST_ARTIFACTS`` names). Chromium is
Debian's ``chromium``: installed here once per session when missing (as root, with apt-get),
else the browser tests are skipped saying why. ``ELASTIC_TEST_CHROMIUM`` names another binary.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr

from controlplane.settings import Settings, libpq_url
from controlplane.store.postgres import PostgresEventStore
from controlplane.web import STATIC_FILES, router
from tests.recorded import final_view, two_incidents

CHROMIUM_ENV = "ELASTIC_TEST_CHROMIUM"
ARTIFACTS_ENV = "ELASTIC_TEST_ARTIFACTS"
ROOT = Path(__file__).resolve().parents[2]
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
PHASES = ["detect", "decide", "ack", "restore", "resume"]


# --------------------------------------------------------------------------- Chromium


def find_chromium() -> str | None:
    """A Chromium binary: ``ELASTIC_TEST_CHROMIUM``, else the first known name on PATH."""
    if explicit := os.environ.get(CHROMIUM_ENV):
        return explicit if Path(explicit).is_file() else None
    for name in _CANDIDATES:
        if path := shutil.which(name):
            return path
    return None


def ensure_chromium() -> tuple[str | None, str]:
    """(binary, "") when Chromium is there or could be installed; (None, why) otherwise."""
    if found := find_chromium():
        return found, ""
    if os.environ.get(CHROMIUM_ENV):
        return None, f"{CHROMIUM_ENV}={os.environ[CHROMIUM_ENV]} is not a file"
    apt = shutil.which("apt-get")
    if apt is None:
        return None, "chromium is not installed and there is no apt-get to install it"
    if os.geteuid() != 0:
        return None, "chromium is not installed and installing it needs root (apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (
        [apt, "update", "-q"],
        [apt, "install", "-y", "-q", "--no-install-recommends", "chromium"],
    )
    for step in steps:
        try:
            done = subprocess.run(step, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return None, f"`{' '.join(step)}` took more than 15 minutes"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return None, f"`{' '.join(step)}` failed ({done.returncode}): {' / '.join(tail)}"
    found = find_chromium()
    return (found, "") if found else (None, "apt-get installed chromium but it is not on PATH")


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser binary, installed once per session when missing (a minute or two)."""
    binary, why = ensure_chromium()
    if binary is None:
        pytest.skip(f"headless Chromium unavailable: {why}")
    return binary


def browse(
    chromium: str, url: str, tmp: Path, *, screenshot: Path | None = None, budget_ms: int = 20_000
) -> str:
    """The DOM after the page's scripts ran (``--dump-dom``), or a screenshot of it.

    ``--virtual-time-budget`` lets the page run until its timers and fetches settle (virtual
    time stands still while a fetch is pending), so no fixed sleep is needed.
    """
    profile = tmp / f"profile-{time.monotonic_ns()}"
    command = [
        chromium,
        "--headless",
        "--no-sandbox",  # root in a container: the sandbox cannot start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        "--window-size=1280,2600",
    ]
    command += [f"--screenshot={screenshot}"] if screenshot is not None else ["--dump-dom"]
    done = subprocess.run([*command, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


# --------------------------------------------------------------------------- the DOM


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    text: str = ""

    def find_all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        """Descendants with ``tag``, the class ``cls`` and attributes equal to ``attrs``
        (``data_x`` is ``data-x``)."""
        out = []
        for child in self.children:
            wanted = {k.replace("_", "-"): v for k, v in attrs.items()}
            if (
                (tag is None or child.tag == tag)
                and (cls is None or cls in child.attrs.get("class", "").split())
                and all(child.attrs.get(k) == v for k, v in wanted.items())
            ):
                out.append(child)
            out.extend(child.find_all(tag, cls, **attrs))
        return out

    def one(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> Node:
        found = self.find_all(tag, cls, **attrs)
        assert len(found) == 1, f"expected one <{tag} class={cls} {attrs}>, found {len(found)}"
        return found[0]

    def by_id(self, ident: str) -> Node:
        return self.one(id=ident)

    @property
    def all_text(self) -> str:
        return self.text + "".join(c.all_text for c in self.children)


_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr"}  # fmt: skip


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(Node("#text", {}, text=data))


def parse(html: str) -> Node:
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.root


# --------------------------------------------------------------------------- the routes


async def test_the_router_serves_the_pages_and_their_files() -> None:
    app = FastAPI()
    app.include_router(router)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://page") as client:
        root = await client.get("/")
        assert root.status_code == 307 and root.headers["location"] == "ui/"
        ui = await client.get("/ui")
        assert ui.status_code == 307 and ui.headers["location"] == "ui/"
        for path in ("/ui/", "/ui/jobs/job-recorded", "/ui/plan"):
            page = await client.get(path)
            assert page.status_code == 200, path
            assert page.headers["content-type"].startswith("text/html")
            assert "default-src 'none'" in page.headers["content-security-policy"]
        script = await client.get("/ui/static/job.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        style = await client.get("/ui/static/style.css")
        assert style.headers["content-type"].startswith("text/css")
        for missing in ("/ui/static/nope.js", "/ui/static/job.html", "/ui/static/..%2Fweb"):
            assert (await client.get(missing)).status_code == 404, missing


def test_the_page_works_offline() -> None:
    """Nothing is loaded from another origin: no URL but the SVG namespace, every file the
    HTML names is served."""
    for name, body in STATIC_FILES.items():
        text = body.decode()
        urls = set(re.findall(r"https?://[^\s\"')]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{name} refers to {urls}"
    for page in ("job.html", "jobs.html", "plan.html"):
        for ref in re.findall(r'(?:src|href)="([^"#]+)"', STATIC_FILES[page].decode()):
            if "static/" in ref:
                assert ref.rsplit("/", 1)[-1] in STATIC_FILES, f"{page} names missing {ref}"


def test_the_page_is_package_data() -> None:
    """``pip install .`` (the Docker image) must carry the static files."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["controlplane.web"]
    assert any(p.startswith("static/") for p in patterns)


# --------------------------------------------------------------------------- the browser


def load_recorded(store: PostgresEventStore, database_url: str) -> None:
    """Append the recorded run, then give each event the time it was recorded at (the store
    stamps the commit's time; the timelines are derived from the recorded times)."""
    log = two_incidents()
    result = store.append([s.event for s in log])
    assert not result.rejected and not result.duplicates
    assert [s.position for s in result.stored] == [s.position for s in log]
    with psycopg.connect(libpq_url(database_url)) as conn, conn.cursor() as cur:
        cur.executemany(
            "UPDATE events SET recorded_at = %s WHERE position = %s",
            [(s.recorded_at, s.position) for s in log],
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on a free port; yield its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(15)


def artifacts_dir() -> Path:
    folder = Path(os.environ.get(ARTIFACTS_ENV) or ROOT / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def recorded_app(pg_store: PostgresEventStore, settings: Settings) -> Iterator[str]:
    """The real API app (with the page) over PostgreSQL holding the recorded run."""
    from controlplane.api.app import create_app

    load_recorded(pg_store, settings.database_url)
    app = create_app(settings, pg_store)
    if not any(getattr(r, "path", "") == "/ui/jobs/{job}" for r in app.routes):
        app.include_router(router)  # an API build that does not mount the page itself
    with serve(app) as url:
        yield url


@pytest.mark.services
@pytest.mark.timeout(1200)  # the first run may install Chromium
def test_the_page_renders_a_recorded_run_with_two_incidents(
    chromium: str, recorded_app: str, tmp_path: Path
) -> None:
    from controlplane.api.render import incident_timeline

    view = final_view()
    timelines = [incident_timeline(i) for i in view.incidents.values()]
    assert len(timelines) == 2
    url = f"{recorded_app}/ui/jobs/{view.job_id}"

    dom = parse(browse(chromium, url, tmp_path))
    body = dom.one("body")
    assert body.attrs.get("data-state") == "ready", dom.by_id("status").all_text
    assert view.job_id in dom.by_id("job-id").all_text

    # The state machine: every transition in the table, a band segment per state.
    rows = [r for r in dom.by_id("history").find_all("tr") if "data-position" in r.attrs]
    assert len(rows) == len(view.history)
    assert [r.attrs["data-position"] for r in rows] == [str(c.position) for c in view.history]
    band = dom.by_id("state-band")
    states = {g.attrs["data-state"] for g in band.find_all("g", "segment")}
    assert {"PENDING", "RUNNING", "DEGRADED", "RECOVERING", "COMPLETED"} <= states

    # Two incidents, each with its five phases as bars and a link per timeline point.
    incidents = dom.by_id("incident-list").find_all("article", "incident")
    assert [a.attrs["data-incident-id"] for a in incidents] == [t.incident_id for t in timelines]
    for article, expected in zip(incidents, timelines, strict=True):
        phases = article.find_all("g", "phase")
        assert [g.attrs["data-phase"] for g in phases] == PHASES
        for g, phase in zip(phases, expected.phases, strict=True):
            assert g.find_all("rect", "phase-bar"), f"no bar for {phase.name}"
            assert g.attrs["data-seconds"] == f"{phase.seconds:g}"
        points = article.find_all("a", "point")
        assert [(p.attrs["data-point"], p.attrs["href"]) for p in points] == [
            (p.name, f"#event-{p.position}") for p in expected.points
        ]
        heading = article.one("h3").all_text
        assert f"{expected.steps_lost} steps lost" in heading and "recovered" in heading

    # The loss curve, with a marker at the step each fault struck at.
    loss = dom.by_id("loss-chart")
    line = loss.one("polyline", "loss-line")
    assert int(line.attrs["data-points"]) > 50
    markers = loss.find_all("a", "fault-marker")
    assert sorted(int(m.attrs["data-step"]) for m in markers) == sorted(
        t.step_at_fault for t in timelines
    )

    # Goodput: a bar segment per term that took any of the wall time, each titled with its
    # seconds, and a row per incident, as the API's goodput route answers them.
    found = httpx.get(f"{recorded_app}/api/v1/jobs/{view.job_id}/goodput", timeout=10).json()
    segments = dom.by_id("goodput-bar").find_all("g", "segment")
    assert [g.attrs["data-term"] for g in segments] == [
        term for term, value in found["seconds"].items() if value > 0
    ]
    assert "productive" in [g.attrs["data-term"] for g in segments]
    assert f"ETTR {found['ettr']:.4f}" in dom.by_id("goodput-bar").all_text
    rows = dom.by_id("goodput-incidents").find_all("tr")
    rows = [r for r in rows if "data-incident" in r.attrs]
    assert [r.attrs["data-incident"] for r in rows] == [t.incident_id for t in timelines]
    assert [i["incident_id"] for i in found["incidents"]] == [t.incident_id for t in timelines]

    # A point links to its event: the page opened at a point shows that event.
    fault_point = timelines[0].points[0]
    event = next(s for s in two_incidents() if s.position == fault_point.position)
    dom = parse(browse(chromium, f"{url}#event-{fault_point.position}", tmp_path))
    panel = dom.by_id("event-panel")
    assert "hidden" not in panel.attrs
    assert panel.one("dl").attrs["data-type"] == event.event.type
    assert event.event.source in panel.all_text

    # The screenshot, kept as the test's artifact.
    shot = artifacts_dir() / "timeline-page.png"
    shot.unlink(missing_ok=True)
    browse(chromium, url, tmp_path, screenshot=shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000

    # The job list links to the job's page.
    dom = parse(browse(chromium, f"{recorded_app}/", tmp_path))
    assert dom.one("body").attrs.get("data-state") == "ready"
    links = [a.attrs["href"] for a in dom.by_id("jobs").find_all("a")]
    assert f"jobs/{view.job_id}" in links


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    commands on the child's fd 3, answers on its fd 4, each a JSON text ending in NUL), for
    what ``--dump-dom`` cannot do: type into the page and read it as it changes."""

    def __init__(self, chromium: str, tmp: Path) -> None:
        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()

        def wire() -> None:  # in the child, before exec: the pipe's ends become fds 3 and 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child, from_child)]
            os.dup2(high[0], 3)  # inheritable; every other fd of Python's is close-on-exec
            os.dup2(high[1], 4)

        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--remote-debugging-pipe",
             f"--user-data-dir={tmp / f'cdp-{time.monotonic_ns()}'}", "about:blank"],
            close_fds=False,  # (close_fds would close fds 3 and 4 after ``wire``)
            preexec_fn=wire,  # noqa: PLW1509 (it only calls fcntl and dup2: no lock taken)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_child)
        os.close(from_child)
        self._buffer = b""
        self._id = 0
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t["targetId"] for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page, flatten=True)["sessionId"]

    def call(self, method: str, session: str | None = None, **params: object) -> dict[str, Any]:
        self._id += 1
        message: dict[str, object] = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 30
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._id:
                    assert "error" not in answer, answer["error"]
                    return dict(answer.get("result", {}))
            assert time.monotonic() < deadline, f"no answer to {method}"
            chunk = os.read(self._in, 1 << 16)
            assert chunk, "chromium closed the pipe"
            self._buffer += chunk

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", self.session, url=url)

    def js(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", self.session, expression=expression, returnByValue=True
        )
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.js(expression)):
            assert time.monotonic() < deadline, f"never true: {expression}"
            time.sleep(0.1)
        return value

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._out)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._in)


@pytest.mark.services
@pytest.mark.timeout(1200)
def test_the_page_asks_for_a_token_and_uses_it(
    chromium: str, pg_store: PostgresEventStore, settings: Settings, tmp_path: Path
) -> None:
    from controlplane.api.app import create_app

    load_recorded(pg_store, settings.database_url)
    guarded = settings.model_copy(update={"api_tokens": SecretStr("s3cret:read,other:write")})
    app = create_app(guarded, pg_store)
    if not any(getattr(r, "path", "") == "/ui/jobs/{job}" for r in app.routes):
        app.include_router(router)
    with serve(app) as url:
        page = f"{url}/ui/jobs/job-recorded"
        dom = parse(browse(chromium, page, tmp_path))
        assert dom.one("body").attrs.get("data-state") == "auth", dom.by_id("status").all_text
        assert dom.one("input", id="token-input").attrs["type"] == "password"
        assert "bearer token" in dom.by_id("status").all_text

        browser = Browser(chromium, tmp_path)
        try:
            browser.navigate(page)
            browser.wait("document.body.dataset.state === 'auth'")
            typed = """(token) => {
                document.getElementById('token-input').value = token;
                document.querySelector('.token-form').requestSubmit();
            }"""
            # A token without the read scope: 403, asked again.
            browser.js(f"({typed})('other')")
            browser.wait("document.body.dataset.state === 'auth'")
            assert "read scope" in browser.js("document.getElementById('status').textContent")
            # The right one: the page loads, and the token is kept for this tab only.
            browser.js(f"({typed})('s3cret')")
            assert browser.wait("document.body.dataset.state === 'ready' && "
                                "document.querySelectorAll('article.incident').length") == 2  # fmt: skip
            assert browser.js("sessionStorage.getItem('elastic.apiToken')") == "s3cret"
            assert browser.js("localStorage.length") == 0
            # A reload uses the kept token; "Forget token" drops it.
            browser.navigate(page)
            browser.wait("document.body.dataset.state === 'ready'")
            browser.js("document.querySelector('#token button').click()")
            browser.wait("document.body.dataset.state === 'auth'")
            assert browser.js("sessionStorage.getItem('elastic.apiToken')") is None
        finally:
            browser.close()


@pytest.mark.timeout(600)
def test_the_plan_view_draws_a_sweep_from_the_simulator(chromium: str, tmp_path: Path) -> None:
    """The plan view runs ``GET /api/v1/simulate`` with the address's query (what the form
    puts there) and draws ETTR against the swept value, a line a strategy, with the runs
    in a table: the figures the simulator gives."""
    from controlplane.api.app import create_app
    from controlplane.postmortem import simulate as sim
    from controlplane.store.memory import InMemoryEventStore

    app = create_app(Settings(api_refresh_s=0, api_tokens=None), InMemoryEventStore())
    query = "ranks=64&days=1&preset=seed512&spares=1&seed=0&strategy=mixed,restart&sweep=spares=0,1"
    with serve(app) as url:
        dom = parse(browse(chromium, f"{url}/ui/plan?{query}", tmp_path, budget_ms=60_000))
    assert dom.one("body").attrs.get("data-state") == "ready", dom.by_id("status").all_text
    chart = dom.by_id("plan-chart")
    assert {line.attrs["data-strategy"] for line in chart.find_all("polyline", "plan-line")} == {
        "mixed", "restart"}  # fmt: skip
    planned = sim.plan(ranks=64, days=1, preset="seed512", spares=1, seed=0,
                       strategies="mixed,restart", sweep="spares=0,1")  # fmt: skip
    expected = sim.run_plan(planned)["runs"]
    rows = dom.by_id("runs").find_all("tr", None)
    shown = [
        [td.all_text for td in row.find_all("td")] for row in rows if "data-strategy" in row.attrs
    ]
    assert [(r[0], r[1], r[2]) for r in shown] == [
        (run["strategy"], f"spares={run['sweep']['spares']:g}", f"{run['ettr']:.4f}")
        for run in expected
    ]
