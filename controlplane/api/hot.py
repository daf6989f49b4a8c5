"""The route clients poll hardest, answered before FastAPI's routing.

``GET /jobs/{job}/incidents/{incident}`` (an incident's timeline, polled by the page and by
tools watching a recovery) is answered by an ASGI middleware (``HotRoutes``, added with
``app.add_middleware``) that calls the same ``Api`` method, checks and response as the
FastAPI route, without the routing and dependency solving that are most of a cached answer's
cost. The FastAPI route stays the documented one (OpenAPI) and answers everything else: every
error (404, 401/403; a 503 is answered here as FastAPI's handler does). Inside the app's
middleware stack, it is traced with every other request when FastAPI's telemetry is on.

A fast path kept by measurement: ``elasticctl bench api --compare-plain`` runs the same load
against the API with it and without it (``ELASTIC_API_HOT_ROUTES=false``) in one run
(docs/benchmarks.md: the timeline answers about 3 times the requests per second, and meets
its p99 target only with it; the events route gained under 1.1 times and is FastAPI's), and
``tests/integration/test_api.py`` checks that the two answer byte for byte alike.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.app import API_PREFIX, Api, _unavailable
from controlplane.errors import StoreError

log = logging.getLogger(__name__)

_JOBS_PREFIX = f"{API_PREFIX}/jobs/"


def _header(scope: Scope, name: bytes) -> str | None:
    """The first header ``name`` (lower case) of the request, as Starlette reads it."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class HotRoutes:
    """The middleware (see the module docstring). ``api.hot_served`` counts its answers."""

    def __init__(self, app: ASGIApp, api: Api) -> None:
        self.app = app
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not await self._answer(scope, receive, send):
            await self.app(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer the request if it is a timeline's; False otherwise."""
        if scope["type"] != "http" or scope["method"] != "GET" or scope.get("root_path"):
            return False
        path: str = scope["path"]
        if not path.startswith(_JOBS_PREFIX):
            return False
        parts = path[len(_JOBS_PREFIX) :].split("/")
        if len(parts) != 3 or parts[1] != "incidents" or not all(parts):
            return False
        api = self.api
        try:
            if api.auth is not None:
                api.auth.check(_header(scope, b"authorization"))
            rendered = await api.timeline(parts[0], parts[2])
        except StoreError as exc:  # answered as FastAPI's handler does, not tried again
            log.warning("database error: %s", exc)
            response = _unavailable()
        except Exception:  # FastAPI's route answers it (404, 401, 422...) as documented
            return False
        else:
            response = api.answer(_header(scope, b"if-none-match"), rendered)
        api.hot_served += 1
        await response(scope, receive, send)
        return True
