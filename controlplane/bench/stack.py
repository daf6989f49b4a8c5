"""NATS and PostgreSQL for a benchmark, and the control plane under test as its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from controlplane.devstack import NatsServer, PostgresServer
from controlplane.settings import DATABASE_URL_ENV, NATS_URL_ENV
from controlplane.store import migrate
from controlplane.store.postgres import make_engine


@dataclass(slots=True)
class Stack:
    """Where a benchmark's services are, and which of them it started."""

    nats_url: str
    database_url: str
    #: The embedded servers started for the benchmark (their CPU time is the benchmark's).
    servers: list[Any] = field(default_factory=list)

    @property
    def where(self) -> dict[str, str]:
        """ "embedded" or "external", per service, for the benchmark's report."""
        kinds = {s.kind for s in self.servers}
        return {
            "nats_url": "embedded" if "nats" in kinds else "external",
            "database": "embedded" if "postgres" in kinds else "external",
        }

    def serve(self, log: Path | None = None, /, **env: str) -> subprocess.Popen[bytes]:
        """Start ``elasticctl serve`` against these services (``env`` adds ELASTIC_* settings;
        ``log``: its standard error goes to that file)."""
        environment = {
            **os.environ,
            NATS_URL_ENV: self.nats_url,
            DATABASE_URL_ENV: self.database_url,
            "ELASTIC_LOG_LEVEL": "WARNING",
            **env,
        }
        command = [sys.executable, "-m", "controlplane", "serve"]
        if log is None:
            return subprocess.Popen(command, env=environment)
        with log.open("wb") as out:
            return subprocess.Popen(command, env=environment, stderr=out, stdout=subprocess.DEVNULL)


@contextmanager
def stack(*, commit_times: bool = False) -> Iterator[Stack]:
    """External services when ELASTIC_NATS_URL / ELASTIC_DATABASE_URL are set (the database
    is migrated and written to), else embedded ones in a temporary directory, stopped after.
    ``commit_times``: an embedded PostgreSQL records when each transaction committed
    (``track_commit_timestamp``; an external one does if so configured)."""
    tmp = tempfile.TemporaryDirectory(prefix="elastic-bench-")
    servers: list[Any] = []
    try:
        nats_url = os.environ.get(NATS_URL_ENV)
        database_url = os.environ.get(DATABASE_URL_ENV)
        if nats_url is None:
            servers.append(NatsServer(Path(tmp.name) / "nats").start())
            nats_url = servers[-1].url
        if database_url is None:
            server = PostgresServer(Path(tmp.name) / "postgres").start()
            servers.append(server)
            database_url = server.url
            if commit_times:
                with psycopg.connect(database_url, autocommit=True) as conn:
                    conn.execute("ALTER SYSTEM SET track_commit_timestamp = on")
                server.stop()  # the setting takes a restart
                server.start()
        engine = make_engine(database_url, pool_size=1)
        migrate.upgrade(engine)
        engine.dispose()
        yield Stack(nats_url, database_url, servers)
    finally:
        for server in servers:
            server.stop()
        tmp.cleanup()


@contextmanager
def serving(services: Stack, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """The control plane process, terminated on the way out."""
    process = services.serve(**env)
    try:
        yield process
    finally:
        process.terminate()
        process.wait(30)
