"""``elasticctl run --rack-label LABEL``: the rack is a label of the pod's Kubernetes node, read
from the API server with the pod's service account (``rank_runtime/k8s.py``), against the
stand-in of ``tests/k8s_api.py`` (no cluster here)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rank_runtime import k8s
from tests.k8s_api import NodeApi, node_api

NODES = {
    "gpu-node-7": {"topology.kubernetes.io/zone": "rack-b", "kubernetes.io/hostname": "gpu-7"},
    "ip-10-0-1-2.ec2.internal": {"kubernetes.io/hostname": "ip-10-0-1-2.ec2.internal"},
}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NodeApi]:
    with node_api(tmp_path / "api", NODES) as api:
        yield api


def test_the_rack_is_the_nodes_label(cluster: NodeApi) -> None:
    env = {**cluster.env, k8s.NODE_NAME_ENV: "gpu-node-7"}
    assert k8s.node_label("topology.kubernetes.io/zone", env=env) == "rack-b"
    host = {**cluster.env, k8s.NODE_NAME_ENV: "ip-10-0-1-2.ec2.internal"}
    value = k8s.node_label("kubernetes.io/hostname", env=host)
    assert k8s.rack_name(value) == "ip-10-0-1-2-ec2-internal"  # a name the event model takes


@pytest.mark.parametrize(
    ("node", "label", "token", "says"),
    [
        ("gpu-node-7", "example.com/rack", None, "has no label example.com/rack (it has: "),
        ("gpu-node-9", "topology.kubernetes.io/zone", None, "knows no node gpu-node-9"),
        ("gpu-node-7", "topology.kubernetes.io/zone", "stale", "needs `get` on nodes"),
        ("denied", "topology.kubernetes.io/zone", None, "needs `get` on nodes"),
    ],
)
def test_what_cannot_be_read_is_said_at_once(
    cluster: NodeApi, node: str, label: str, token: str | None, says: str
) -> None:
    cluster.denied.add("denied")
    if token is not None:
        (cluster.account / "token").write_text(token)
    with pytest.raises(k8s.NodeLabelError) as caught:
        k8s.node_label(label, env={**cluster.env, k8s.NODE_NAME_ENV: node}, timeout_s=0.2)
    assert says in str(caught.value)


def test_outside_a_pod_the_option_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """No node name, or not in a pod: exit 2 (bad usage), with what to do; nothing launched."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('started')\n")
    base = [sys.executable, "-m", "rank_runtime.launcher_cli", "--node", "n0", "--nproc", "1"]
    env = {"PATH": "/usr/bin:/bin", "ELASTIC_NATS_URL": "nats://127.0.0.1:1"}
    for extra, says in (
        ({}, "ELASTIC_K8S_NODE_NAME"),
        ({k8s.NODE_NAME_ENV: "gpu-node-7"}, "not a pod"),
    ):
        done = subprocess.run(
            [*base, "--rack-label", "topology.kubernetes.io/zone", str(script)],
            env={**env, **extra}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert says in done.stderr
    both = [*base, "--rack", "r1", "--rack-label", "x", str(script)]
    done = subprocess.run(both, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--rack-label goes with --node" in done.stderr
