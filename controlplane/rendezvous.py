"""The rendezvous store every generation's ranks meet in, hosted by the control plane.

A rank that dies must not take the rendezvous with it, so the store lives here (a
``torch.distributed.TCPStore`` server), not on rank 0. Each generation gets its own key space:
the endpoint handed to ranks is ``tcp://<host>:<port>/<job>/<generation>``; a rank connects a
client to ``host:port`` and wraps it in ``PrefixStore("<job>/<generation>", client)`` (see
``parse_endpoint``). After the leader changes, new generations name the new leader's store;
ranks of a formed process group no longer need the old one.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


class Endpoint(NamedTuple):
    """Where a generation rendezvouses: the store's address and the ``PrefixStore`` prefix."""

    host: str
    port: int
    prefix: str


def parse_endpoint(endpoint: str) -> Endpoint:
    """Split ``tcp://host:port/<job>/<generation>``; ValueError when it is not one."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"not a rendezvous endpoint (tcp://host:port/job/gen): {endpoint!r}")
    prefix = parts.path.strip("/")
    return Endpoint(parts.hostname, parts.port, prefix)


class RendezvousHost:
    """A TCPStore server in this process. The constructor does no I/O; ``start`` binds."""

    def __init__(self, advertise: str, port: int = 0) -> None:
        self._advertise = advertise
        self._port = port
        self._store: Any = None

    def start(self) -> str:
        """Start the server (idempotent) and return the base endpoint ``tcp://host:port``."""
        if self._store is None:
            from datetime import timedelta

            import torch.distributed as dist  # heavy: imported only where a store is hosted

            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                "0.0.0.0",
                self._port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=30),
            )
            log.info("rendezvous store listening on port %d", self._store.port)
        return f"tcp://{self._advertise}:{self._store.port}"

    @property
    def base(self) -> str | None:
        """The base endpoint once started."""
        return None if self._store is None else f"tcp://{self._advertise}:{self._store.port}"

    def close(self) -> None:
        """Stop serving (dropping the server object closes its socket)."""
        self._store = None
