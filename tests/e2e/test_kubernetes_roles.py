"""The Kubernetes roles run here, from the rendered manifests: each container's command with its
environment, secrets and configuration as Kubernetes would give them, and pods restarted by
their restart policies; a trainer pod is killed mid-run, comes back, and the job completes.

What stands in for the cluster (nothing else is changed):

- addresses: a pod's IP is 127.0.0.1; each container port it declares gets a free local port,
  and a value naming it (an environment variable, an argument) that port; a Service's DNS
  name (``nats-1.nats-headless:4222``) is the port its pod got; ``0.0.0.0`` is 127.0.0.1;
- files: a mounted Secret or ConfigMap is a directory of its items, and a value under its mount
  path points into it; ``/app`` (the images' work directory) is the checkout;
- the downward API: ``metadata.name``, ``status.podIP``, ``spec.nodeName``, the training
  operator's job-name label, the Job's completion index; the API server's node lookup is
  ``tests/k8s_api.py``'s stand-in, with each Kubernetes node's ``kubernetes.io/hostname``;
- PostgreSQL is the tests' embedded server (its URL replaces the Secret's ``database-url``);
  NATS is ``nats-server`` run with the rendered ``nats.conf`` and the users ``elasticctl creds``
  issued (the ConfigMap ``nats-users``);
- the restart policies are applied as the kubelet, the training operator and the Job
  controller would: ``ExitCode`` restarts a pod that exited 128+N and never one that exited
  1-127; a Job's ``podFailurePolicy`` fails it on the exit codes it names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controlplane.devstack import free_port, nats_server_binary
from tests.k8s_api import NodeApi, node_api
from tests.k8s_manifests import JOB, ROOT, render, secret_data

pytestmark = pytest.mark.timeout(300)

#: The Kubernetes nodes the pods are scheduled on (each a rack of its own in the CPU variant).
NODES = {f"node-{c}": {"kubernetes.io/hostname": f"node-{c}"} for c in "abcdef"}
VENV_BIN = Path(sys.executable).parent
ENTRYPOINTS = {"elastic-controlplane": "elasticctl", "elastic-trainer": "elastic-run"}


@dataclass
class Pod:
    """A pod of a workload: its container run as a process group of its own."""

    name: str
    node: str
    workload: dict[str, Any]
    template: dict[str, Any]
    index: int = 0
    ports: dict[int, int] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    exits: list[int] = field(default_factory=list)

    @property
    def container(self) -> dict[str, Any]:
        (container,) = [
            c for c in self.template["spec"]["containers"] if c["image"].startswith("elastic-")
        ]
        return container

    def status(self) -> int | None:
        """Its container's exit status as Kubernetes reports it (128+N for a signal)."""
        assert self.proc is not None
        code = self.proc.poll()
        return None if code is None else (128 - code if code < 0 else code)


class LocalCluster:
    """Runs the pods of rendered manifests on this machine (see the module's docstring)."""

    def __init__(self, root: Path, database_url: str, api: NodeApi) -> None:
        self.root = root
        self.database_url = database_url
        self.api = api
        self.addresses: dict[str, str] = {}  # "host:port" -> "127.0.0.1:local"
        self.pods: list[Pod] = []

    # ------------------------------------------------------------------ what a pod gets
    def rewrite(self, pod: Pod, value: str, mounts: dict[str, Path]) -> str:
        for address, local in self.addresses.items():
            value = value.replace(address, local)
        value = value.replace("0.0.0.0", "127.0.0.1")
        if value.isdigit() and int(value) in pod.ports:
            return str(pod.ports[int(value)])
        for mount, directory in mounts.items():
            if value == mount or value.startswith(mount.rstrip("/") + "/"):
                return str(directory) + value[len(mount.rstrip("/")) :]
        if value.startswith("/app/"):
            return str(ROOT / value[len("/app/") :])
        return value

    def field(self, pod: Pod, path: str) -> str:
        return {
            "metadata.name": pod.name,
            "status.podIP": "127.0.0.1",
            "spec.nodeName": pod.node,
            "metadata.labels['training.kubeflow.org/job-name']": pod.workload["metadata"]["name"],
            "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(pod.index),
        }[path]

    def mounts(self, pod: Pod) -> dict[str, Path]:
        """Write the pod's Secret and ConfigMap volumes; mount path -> local directory."""
        volumes = {v["name"]: v for v in pod.template["spec"].get("volumes", [])}
        found = {}
        for mount in pod.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "secret" in volume:
                data = secret_data("Secret", volume["secret"]["secretName"])
                items = volume["secret"].get("items")
            elif "configMap" in volume:
                data = secret_data("ConfigMap", volume["configMap"]["name"])
                items = volume["configMap"].get("items")
            else:
                continue  # an emptyDir (/dev/shm): the machine's own
            directory = self.root / "pods" / pod.name / mount["name"]
            for item in items or [{"key": k, "path": k} for k in data]:
                target = directory / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(data[item["key"]])
                target.chmod(0o440)
            found[mount["mountPath"]] = directory
        return found

    def environment(self, pod: Pod, mounts: dict[str, Path]) -> dict[str, str]:
        env = {
            "PATH": f"{VENV_BIN}{os.pathsep}/usr/bin:/bin",
            "HOME": str(self.root / "pods" / pod.name),
            "ELASTIC_LOG_LEVEL": "INFO",
            **self.api.env,
        }
        for entry in pod.container.get("env", []):
            source = entry.get("valueFrom", {})
            if "value" in entry:
                value = expand(str(entry["value"]), env)
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                data = secret_data("Secret", ref["name"])
                if ref["key"] not in data and ref.get("optional"):
                    continue
                value = self.database_url if ref["key"] == "database-url" else data[ref["key"]]
            else:
                value = self.field(pod, source["fieldRef"]["fieldPath"])
            env[entry["name"]] = self.rewrite(pod, value, mounts)
        return env

    # ------------------------------------------------------------------ running pods
    def add(self, name: str, node: str, workload: dict[str, Any], template: dict[str, Any],
            index: int = 0) -> Pod:  # fmt: skip
        pod = Pod(name, node, workload, template, index)
        for port in pod.container.get("ports", []):
            pod.ports[port["containerPort"]] = free_port()
        self.pods.append(pod)
        return pod

    def start(self, pod: Pod) -> Pod:
        (self.root / "pods" / pod.name).mkdir(parents=True, exist_ok=True)
        mounts = self.mounts(pod)
        env = self.environment(pod, mounts)
        image = pod.container["image"].split(":")[0]
        command = [self.rewrite(pod, c, mounts) for c in pod.container.get("command", [])]
        if command and command[0].endswith(".sh"):
            command = ["sh", *command]
        argv = command or [str(VENV_BIN / ENTRYPOINTS[image])]
        argv += [self.rewrite(pod, expand(str(a), env), mounts) for a in pod.container["args"]]
        pod.log = self.root / "logs" / f"{pod.name}.{len(pod.exits)}.log"
        pod.log.parent.mkdir(parents=True, exist_ok=True)
        with pod.log.open("wb") as out:
            pod.proc = subprocess.Popen(
                argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        pod.env = env
        return pod

    def kill(self, pod: Pod) -> None:
        """SIGKILL every process of the pod (its container's cgroup, as a node's kubelet)."""
        assert pod.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pod.proc.pid, signal.SIGKILL)
        pod.proc.wait(30)

    def stop_all(self) -> None:
        for pod in reversed(self.pods):
            if pod.proc is not None and pod.proc.poll() is None:
                self.kill(pod)

    def tail(self, pod: Pod, lines: int = 40) -> str:
        assert pod.log is not None
        return "\n".join(pod.log.read_text(errors="replace").splitlines()[-lines:])

    def ready(self, pod: Pod) -> bool:
        """Its readiness probe, as the kubelet runs it."""
        probe = pod.container["readinessProbe"]
        env = pod.env
        if "exec" in probe:
            argv = [self.rewrite(pod, a, {}) for a in probe["exec"]["command"]]
            argv[0] = sys.executable if argv[0] == "python" else argv[0]
            done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, timeout=30)
            return done.returncode == 0
        named = {p["name"]: p["containerPort"] for p in pod.container.get("ports", [])}
        port = pod.ports[named[probe["httpGet"]["port"]]]
        try:
            url = f"http://127.0.0.1:{port}{probe['httpGet']['path']}"
            with urllib.request.urlopen(url, timeout=5) as response:
                return bool(200 <= response.status < 400)
        except OSError:
            return False

    def wait_ready(self, pod: Pod, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready(pod):
            assert pod.proc is not None and pod.proc.poll() is None, self.tail(pod)
            assert time.monotonic() < deadline, f"{pod.name} not ready:\n{self.tail(pod)}"
            time.sleep(0.5)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a variable defined before it is replaced, any other
    reference kept as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value)


def restarts(pod: Pod, code: int) -> bool:
    """Whether the pod's controller brings it back after exit status ``code``."""
    spec = pod.workload["spec"]
    if pod.workload["kind"] == "PyTorchJob":
        replica = next(r for r in spec["pytorchReplicaSpecs"].values()
                       if r["template"] is pod.template)  # fmt: skip
        policy = replica["restartPolicy"]
        assert policy == "ExitCode", policy
        return code >= 128  # the training operator: 1-127 permanent, 128-255 retryable
    for rule in spec.get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes and (code in codes["values"]) == (codes["operator"] == "In"):
            return rule["action"] not in ("FailJob", "FailIndex")
    return code != 0


def job_state(api_port: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{api_port}/api/v1/jobs/{JOB}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return dict(json.load(response))
    except OSError:
        return {}


def start_nats(
    cluster: LocalCluster, docs: tuple[dict[str, Any], ...]
) -> list[subprocess.Popen[bytes]]:
    """The StatefulSet's three servers, each with the rendered nats.conf (its addresses mapped
    to loopback) and the users ConfigMap; their liveness probe waited for."""
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats"]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"
                 and d["metadata"]["name"].startswith("nats-config")]  # fmt: skip
    users = secret_data("ConfigMap", "nats-users")["nats-users.conf"]
    service = sts["spec"]["serviceName"]
    names = [f"nats-{i}" for i in range(sts["spec"]["replicas"])]
    ports = {n: {p: free_port() for p in (4222, 6222, 8222)} for n in names}
    for n in names:
        for port, local in ports[n].items():
            cluster.addresses[f"{n}.{service}:{port}"] = f"127.0.0.1:{local}"
    procs = []
    for n in names:
        directory = cluster.root / n
        (directory / "auth").mkdir(parents=True)
        (directory / "auth" / "nats-users.conf").write_text(users)
        text = config["data"]["nats.conf"]
        for port in (4222, 6222, 8222):
            text = text.replace(f"0.0.0.0:{port}", f"127.0.0.1:{ports[n][port]}")
        for address, local in cluster.addresses.items():
            text = text.replace(address, local)
        text = text.replace("/data/jetstream", str(directory / "jetstream"))
        text = text.replace("/var/run/nats/nats.pid", str(directory / "nats.pid"))
        (directory / "nats.conf").write_text(text)
        with (directory / "log").open("wb") as log:
            procs.append(subprocess.Popen(
                [nats_server_binary(), "--config", str(directory / "nats.conf")],
                env={"POD_NAME": n}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            ))  # fmt: skip
    probe = sts["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["path"]
    deadline = time.monotonic() + 60
    for n in names:
        while True:
            try:
                url = f"http://127.0.0.1:{ports[n][8222]}{probe}"
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (cluster.root / n / "log").read_text()[-2000:]
            time.sleep(0.3)
    return procs


def test_the_roles_run_and_a_killed_trainer_pod_comes_back_to_a_completed_job(
    tmp_path: Path, empty_database_url: str
) -> None:
    stack = render("overlays/trial")
    trainers = render("trainer/cpu")
    with node_api(tmp_path / "k8s-api", NODES) as api:
        cluster = LocalCluster(tmp_path, empty_database_url, api)
        nats = start_nats(cluster, stack)
        try:
            _run(cluster, stack, trainers)
        finally:
            cluster.stop_all()
            for proc in nats:
                proc.kill()
                proc.wait(30)
    shutil.rmtree(tmp_path / "pods", ignore_errors=True)


def _workload(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _run(cluster: LocalCluster, stack: tuple[dict[str, Any], ...],
         trainers: tuple[dict[str, Any], ...]) -> None:  # fmt: skip
    # The migration Job, to completion (restartPolicy OnFailure: it is retried on failure).
    migrate = _workload(stack, "Job", "elastic-migrate")
    pod = cluster.start(
        cluster.add("elastic-migrate-x", "node-a", migrate, migrate["spec"]["template"])
    )
    assert pod.proc is not None and pod.proc.wait(120) == 0, cluster.tail(pod)

    # The control plane (two replicas on two nodes) and the API; ready by their probes.
    cp = _workload(stack, "Deployment", "elastic-controlplane")
    assert cp["spec"]["replicas"] == 2
    planes = [cluster.start(cluster.add(f"elastic-controlplane-{i}", node, cp, cp["spec"]["template"]))
              for i, node in enumerate(("node-a", "node-b"))]  # fmt: skip
    api_doc = _workload(stack, "Deployment", "elastic-api")
    api = cluster.start(
        cluster.add("elastic-api-0", "node-c", api_doc, api_doc["spec"]["template"])
    )
    for pod in [*planes, api]:
        cluster.wait_ready(pod)
    api_port = api.ports[8080]

    # The trainers: the PyTorchJob's Master (spares only) and Workers, the spare pool's pod.
    job = _workload(trainers, "PyTorchJob", JOB)
    pods: list[Pod] = []
    nodes = iter(["node-c", "node-d", "node-e", "node-f"])
    for kind, replica in job["spec"]["pytorchReplicaSpecs"].items():
        for i in range(replica["replicas"]):
            name = f"{JOB}-{kind.lower()}-{i}"
            pods.append(cluster.add(name, next(nodes), job, replica["template"], i))
    pool = _workload(trainers, "Job", f"{JOB}-spares")
    for i in range(pool["spec"]["completions"]):
        pods.append(
            cluster.add(f"{JOB}-spares-{i}-x", next(nodes), pool, pool["spec"]["template"], i)
        )
    for pod in pods:
        cluster.start(pod)

    # Mid-run, a Worker pod is lost whole (its launcher and its members, SIGKILL: 137).
    victim = next(p for p in pods if p.name == f"{JOB}-worker-1")
    deadline = time.monotonic() + 180
    while job_state(api_port).get("last_step", 0) < 30:
        assert time.monotonic() < deadline, [cluster.tail(p) for p in pods]
        for p in pods:
            assert p.status() is None, f"{p.name} exited {p.status()}:\n{cluster.tail(p)}"
        time.sleep(0.5)
    cluster.kill(victim)

    # The controllers apply the restart policies until every pod is done or failed for good.
    final: dict[str, int] = {}
    while len(final) < len(pods):
        assert time.monotonic() < deadline + 120, (
            job_state(api_port),
            [cluster.tail(p) for p in pods],
        )
        for pod in pods:
            code = pod.status()
            if pod.name in final or code is None:
                continue
            pod.exits.append(code)
            if restarts(pod, code):
                cluster.start(pod)  # the same pod name, a new container
            else:
                final[pod.name] = code
        time.sleep(0.3)

    state = job_state(api_port)
    assert state["state"] == "COMPLETED", state
    assert state["completed_step"] == 200 and state["incidents"] >= 1, state
    assert victim.exits[0] == 128 + signal.SIGKILL and len(victim.exits) == 2, victim.exits
    assert final == dict.fromkeys(final, 0), {p.name: (p.exits, cluster.tail(p)) for p in pods}
    # Each launcher took its rack from its Kubernetes node's label.
    for pod in pods:
        assert pod.log is not None
        assert f"rack {pod.node} (label kubernetes.io/hostname)" in pod.log.read_text()

    # The daily retention, once, as its CronJob would run it.
    retention = _workload(stack, "CronJob", "elastic-retention")
    template = retention["spec"]["jobTemplate"]["spec"]["template"]
    pod = cluster.start(cluster.add("elastic-retention-x", "node-a", retention, template))
    assert pod.proc is not None and pod.proc.wait(120) == 0, cluster.tail(pod)
    # Both control planes still serve (one leads, one stands by).
    for plane in planes:
        assert plane.status() is None and cluster.ready(plane), cluster.tail(plane)
