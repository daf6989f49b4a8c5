"""The page for people: a job's state-machine history, its incidents' timelines, its loss curve;
and the plan view of the simulator.

Plain HTML, vanilla JavaScript and inline SVG, shipped as package data (``static/``): no CDN,
no build step, so it works offline. The HTML and scripts hold no data; the browser reads the
REST API (``/api/v1``) with the bearer token the reader typed in (kept in ``sessionStorage``)
when the API asks for one. Include ``router`` in the API app:

- ``GET /`` redirects to ``/ui/``, the list of jobs;
- ``GET /ui/jobs/{job}`` is a job's page;
- ``GET /ui/plan`` is the plan view (``elasticctl simulate`` at a request's size);
- ``GET /ui/static/{name}`` serves the page's scripts and style.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException
from fastapi.responses import HTMLResponse, RedirectResponse, Response

__all__ = ["STATIC_FILES", "router"]

_MEDIA_TYPES = {
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".svg": "image/svg+xml",
}
#: The pages are the same for every job and reader; a reload checks them again.
_CACHE = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
#: The page talks only to its own origin; nothing is loaded from anywhere else.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _static() -> dict[str, bytes]:
    """Every file of ``static/`` by name, read once (a few kilobytes)."""
    folder = resources.files(__name__).joinpath("static")
    return {
        entry.name: entry.read_bytes()
        for entry in folder.iterdir()
        if entry.is_file() and any(entry.name.endswith(s) for s in _MEDIA_TYPES)
    }


#: The page's files by name.
STATIC_FILES = _static()

router = APIRouter(include_in_schema=False)


def _page(name: str) -> HTMLResponse:
    return HTMLResponse(STATIC_FILES[name], headers={**_CACHE, "Content-Security-Policy": _CSP})


@router.get("/")
def root() -> RedirectResponse:
    """The job list."""
    return RedirectResponse("ui/", status_code=307)


@router.get("/ui")
def ui() -> RedirectResponse:
    """The job list, at the address its relative links are written for."""
    return RedirectResponse("ui/", status_code=307)


@router.get("/ui/", response_class=HTMLResponse)
def jobs_page() -> HTMLResponse:
    """Every job the log holds, with its state, and a link to its page."""
    return _page("jobs.html")


@router.get("/ui/jobs/{job}", response_class=HTMLResponse)
def job_page(job: str) -> HTMLResponse:
    """One job: the state machine's history, the incidents' timelines, the loss curve.

    The job id is read by the page's script from the address; this answer is the same for
    every job (an unknown job is reported by the page, from the API's 404).
    """
    del job
    return _page("job.html")


@router.get("/ui/plan", response_class=HTMLResponse)
def plan_page() -> HTMLResponse:
    """The plan view: ``GET /api/v1/simulate`` as a form, ETTR against a swept value."""
    return _page("plan.html")


@router.get("/ui/static/{name}")
def static(name: str) -> Response:
    """A script or style sheet of the page."""
    body = STATIC_FILES.get(name)
    if body is None or name.endswith(".html"):
        raise HTTPException(status_code=404, detail=f"no static file {name!r}")
    media_type = _MEDIA_TYPES[name[name.rindex(".") :]]
    return Response(body, media_type=media_type, headers=_CACHE)
