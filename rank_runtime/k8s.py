"""The one thing a launcher asks of Kubernetes: a label of the node its pod runs on, for the
rack (``elasticctl run --rack-label LABEL``).

The pod names its node through the downward API (``ELASTIC_K8S_NODE_NAME`` from
``spec.nodeName``); the launcher reads ``/api/v1/nodes/<node>`` from the API server with the
pod's service account (the in-cluster address, token and CA), which needs ``get`` on nodes
(``deploy/k8s/trainer/gpu/rbac.yaml``). Standard library only: a training image carries no
Kubernetes client.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path

#: The Kubernetes node this pod runs on (downward API: ``fieldRef: spec.nodeName``).
NODE_NAME_ENV = "ELASTIC_K8S_NODE_NAME"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: Where the pod's service account (``token``, ``ca.crt``) is, if not where the kubelet puts
#: it (a projected volume of your own).
SERVICE_ACCOUNT_ENV = "ELASTIC_K8S_SERVICE_ACCOUNT"
#: A rack is an identifier of the event model (``schemas.common.IDENT_PATTERN``).
_NOT_IDENT = re.compile(r"[^A-Za-z0-9_-]")


class NodeLabelError(ValueError):
    """The rack cannot be read: what is missing, and what to do about it."""


def rack_name(value: str) -> str:
    """A label's value as a rack name: characters a name cannot hold (dots of a host name)
    become ``-``, at most 64; ``ValueError`` for a value with nothing left."""
    name = _NOT_IDENT.sub("-", value).lstrip("_-")[:64]
    if not name:
        raise NodeLabelError(f"the label's value {value!r} makes no rack name")
    return name


def api_server(env: Mapping[str, str]) -> str:
    """The in-cluster API server's address (``KUBERNETES_SERVICE_HOST``/``_PORT``)."""
    host = env.get("KUBERNETES_SERVICE_HOST")
    if not host:
        raise NodeLabelError(
            "--rack-label reads the node's labels from the Kubernetes API server, and this is"
            " not a pod (KUBERNETES_SERVICE_HOST is unset): give --rack instead"
        )
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"https://{host}:{env.get('KUBERNETES_SERVICE_PORT', '443')}"


def node_label(
    label: str,
    *,
    env: Mapping[str, str] | None = None,
    api: str | None = None,
    account: Path | None = None,
    timeout_s: float = 30.0,
) -> str:
    """The value of ``label`` on this pod's Kubernetes node. Retries what may pass (the API
    server unreachable or answering 5xx) for up to ``timeout_s``; a refusal (401, 403), an
    unknown node or a node without the label raise :class:`NodeLabelError` at once."""
    env = os.environ if env is None else env
    node = env.get(NODE_NAME_ENV)
    if not node:
        raise NodeLabelError(
            f"--rack-label needs the pod's Kubernetes node in {NODE_NAME_ENV}"
            " (the downward API: valueFrom.fieldRef.fieldPath: spec.nodeName)"
        )
    base = api or api_server(env)
    if account is None:
        account = Path(env.get(SERVICE_ACCOUNT_ENV) or SERVICE_ACCOUNT)
    try:
        token = (account / "token").read_text().strip()
    except OSError as exc:
        raise NodeLabelError(f"no service account token at {account}/token: {exc}") from exc
    context = ssl.create_default_context(cafile=str(account / "ca.crt"))
    url = f"{base}/api/v1/nodes/{urllib.parse.quote(node, safe='')}"
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"}
    )
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as response:
                body = json.load(response)
            break
        except urllib.error.HTTPError as exc:
            exc.close()  # its body's connection
            if exc.code in (401, 403):
                raise NodeLabelError(
                    f"the API server refused to show node {node} ({exc.code}): the pod's"
                    " service account needs `get` on nodes (a ClusterRole bound to it)"
                ) from exc
            if exc.code == 404:
                raise NodeLabelError(f"the API server knows no node {node}") from exc
            if exc.code < 500 or time.monotonic() + delay > deadline:
                raise NodeLabelError(f"GET {url}: {exc.code} {exc.reason}") from exc
        except (OSError, ValueError) as exc:  # unreachable, reset, a body that is not JSON
            if time.monotonic() + delay > deadline:
                raise NodeLabelError(f"GET {url}: {exc}") from exc
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
    labels = (body.get("metadata") or {}).get("labels") or {}
    if label not in labels:
        raise NodeLabelError(
            f"node {node} has no label {label} (it has: {', '.join(sorted(labels)) or 'none'})"
        )
    return str(labels[label])
