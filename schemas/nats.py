"""Connecting to NATS as a node or the control plane: what both sides share of nats-py.

``auth_options`` turns the credentials a process is given (an NKey seed file from
``elasticctl creds``, a JWT ``.creds`` file, or a user and password) into nats-py's connect
options. The control plane's own adapter (its stream, the ingest's consumer) is
``controlplane/bus.py``.
"""

from __future__ import annotations

import logging
import random
from typing import Any
from urllib.parse import ParseResult

from schemas.creds import nkey_connect_options

log = logging.getLogger(__name__)


def auth_options(creds: str | None, user: str | None, password: str | None) -> dict[str, Any]:
    """nats-py connect options for a credentials file, else a user and password.

    ``creds`` is an NKey seed file issued by ``elasticctl creds`` (schemas/creds.py: the
    seed, and the inbox prefix that identity alone may receive on) or a JWT ``.creds`` file.
    """
    if creds:
        return nkey_connect_options(creds) or {"user_credentials": creds}
    if user:
        return {"user": user, "password": password or ""}
    return {}


class Failover:
    """Where a connection goes when it leaves its server: nats-py's
    ``reconnect_to_server_handler``. After ``leave`` (the server is reachable but cut off from
    the rest of the cluster: its JetStream has no quorum, and what is published on it reaches
    no subscriber elsewhere), any other server first; otherwise, and when the server went
    away by itself, a random one, waiting ``wait_s`` between attempts as nats-py does."""

    def __init__(self, wait_s: float = 0.25) -> None:
        self.wait_s = wait_s
        self._leaving: str | None = None
        self._attempts = 0

    def leave(self, url: ParseResult | None) -> None:
        """The next reconnection avoids ``url`` (the connection's current server)."""
        self._leaving = url.netloc if url is not None else None
        self._attempts = 0

    def __call__(self, servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        others = [s for s in servers if s.uri.netloc != self._leaving] or servers
        delay = 0.0 if self._attempts == 0 else self.wait_s
        self._attempts += 1
        if self._attempts > len(others):  # each tried once: any server again
            self._leaving = None
        return random.choice(others), delay

    async def move(self, nc: Any, why: str) -> None:
        """Leave ``nc``'s server (a nats-py client connected with this chooser) for another
        one, logging ``why``."""
        where = nc.connected_url
        log.warning("%s on %s: moving to another server", why, where.netloc if where else "?")
        self.leave(where)
        await nc.force_reconnect()

    def connected(self) -> None:
        """A connection was made: the next reconnection starts afresh."""
        self._leaving = None
        self._attempts = 0
