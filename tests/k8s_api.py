"""A stand-in for the one request a launcher makes of the Kubernetes API server
(``GET /api/v1/nodes/<name>``, ``rank_runtime/k8s.py``), over HTTPS on loopback with a
certificate made here, checking the bearer token; and the service account directory
(``token``, ``ca.crt``) a pod would have. There is no cluster on a test machine.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rank_runtime import k8s
from tests.certs import self_signed

TOKEN = "service-account-token"


@dataclass
class NodeApi:
    """The running stand-in: the environment a pod gets (the API server's address, the
    service account's directory), its nodes' labels, the nodes it refuses to show."""

    env: dict[str, str]
    account: Path
    nodes: dict[str, dict[str, str]]
    denied: set[str] = field(default_factory=set)


@contextmanager
def node_api(directory: Path, nodes: Mapping[str, Mapping[str, str]]) -> Iterator[NodeApi]:
    """Serve ``nodes`` (name -> labels) until the block ends."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = self_signed(directory, "kubernetes")
    account = directory / "serviceaccount"
    account.mkdir(exist_ok=True)
    (account / "token").write_text(TOKEN + "\n")
    (account / "ca.crt").write_bytes(cert.read_bytes())
    api = NodeApi({}, account, {n: dict(labels) for n, labels in nodes.items()})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            prefix = "/api/v1/nodes/"
            name = self.path[len(prefix) :] if self.path.startswith(prefix) else ""
            token = (account / "token").read_text().strip()
            if self.headers.get("Authorization") != f"Bearer {token}" or token != TOKEN:
                self._answer(401, {"kind": "Status", "reason": "Unauthorized", "code": 401})
            elif name in api.denied:
                self._answer(403, {"kind": "Status", "reason": "Forbidden", "code": 403})
            elif name not in api.nodes:
                self._answer(404, {"kind": "Status", "reason": "NotFound", "code": 404})
            else:
                node = {"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": name, "labels": api.nodes[name]}}  # fmt: skip
                self._answer(200, node)

        def _answer(self, status: int, body: Mapping[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api.env = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(server.server_address[1]),
        k8s.SERVICE_ACCOUNT_ENV: str(account),
    }
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
