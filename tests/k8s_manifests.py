"""``deploy/k8s`` rendered as Kubernetes would get it (the real ``kustomize``), for the tests
that check the manifests (``tests/unit/test_kubernetes.py``) and the one that runs their roles
(``tests/e2e/test_kubernetes_roles.py``).

``deploy/k8s/secrets`` renders from a copy given what an operator writes there: example
values, and what the real ``elasticctl creds`` issues for the example job's nodes.
"""

from __future__ import annotations

import atexit
import base64
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from tests import kustomize

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
#: The example job (its name, the nodes `elasticctl creds` issues for it).
JOB = "elastic-example"
SECRET_FILES = {
    "database-url": "postgresql://elastic:try-it@postgres:5432/elastic",
    "elastic-secret": "74727969742d74727969742d74727969742d74727969742d74727969742d2121",
    "postgres-password": "try-it",
}


def kustomizations() -> list[str]:
    """Every directory with a Kustomization (Components are rendered through them)."""
    found = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind") == "Kustomization":
            found.append(str(path.parent.relative_to(K8S)))
    return found


def example_nodes() -> list[str]:
    """The node names of the example job's pods: the training operator's
    ``<job>-<type>-<index>`` and the spare pool's ``<job>-spares-<completion index>``."""
    job = next(d for d in render("trainer/gpu") if d["kind"] == "PyTorchJob")
    nodes = [
        f"{JOB}-{kind.lower()}-{i}"
        for kind, spec in job["spec"]["pytorchReplicaSpecs"].items()
        for i in range(spec.get("replicas", 1))
    ]
    pool = next(d for d in render("trainer/gpu") if d["kind"] == "Job")
    return nodes + [f"{JOB}-spares-{i}" for i in range(pool["spec"]["completions"])]


@cache
def _secrets_inputs() -> Path:
    """A copy of ``deploy/k8s/secrets`` with the files an operator writes there: the values,
    and what the real ``elasticctl creds`` issues for the example job's nodes."""

    root = Path(tempfile.mkdtemp(prefix="elastic-k8s-secrets-"))
    atexit.register(shutil.rmtree, root, True)
    directory = root / "secrets"
    shutil.copytree(K8S / "secrets", directory)
    for name, value in SECRET_FILES.items():
        (directory / name).write_text(value)
    nodes = [a for n in example_nodes() for a in ("--node", n)]
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", "creds", "--job", JOB, *nodes,
         "--out", str(directory / "creds")],
        env={"PATH": "/usr/bin:/bin", "ELASTIC_SECRET": SECRET_FILES["elastic-secret"]},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return directory


@cache
def render(name: str) -> tuple[dict[str, Any], ...]:
    directory = _secrets_inputs() if name == "secrets" else K8S / name
    return tuple(d for d in yaml.safe_load_all(kustomize.build(directory)) if d)


def everything() -> Iterator[dict[str, Any]]:
    for name in kustomizations():
        yield from render(name)


def pod_templates(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(role, pod template) of a workload: Deployments, StatefulSets, Jobs, CronJobs and the
    PyTorchJob's replicas."""
    spec = doc.get("spec", {})
    if "template" in spec:
        return [(doc["metadata"]["name"], spec["template"])]
    if "jobTemplate" in spec:
        return [(doc["metadata"]["name"], spec["jobTemplate"]["spec"]["template"])]
    return [(kind, r["template"]) for kind, r in spec.get("pytorchReplicaSpecs", {}).items()]


def image_name(container: dict[str, Any]) -> str:
    return str(container["image"]).rsplit("/", 1)[-1].split(":")[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_data(kind: str, name: str) -> dict[str, str]:
    """The decoded data of a Secret (or a ConfigMap) that ``deploy/k8s/secrets`` makes."""
    for doc in render("secrets"):
        if (doc["kind"], doc["metadata"]["name"]) == (kind, name):
            data = doc.get("data", {})
            if kind == "Secret":
                return {k: base64.b64decode(v).decode() for k, v in data.items()}
            return dict(data)
    raise KeyError(f"{kind} {name}")
