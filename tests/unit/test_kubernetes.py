"""``deploy/k8s``, checked without ``kubectl`` or a cluster.

Every kustomization (the control-plane base, its overlays, the GPU and CPU trainers, the
Secrets) is rendered by the real ``kustomize`` (``tests/kustomize.py``) and every object it
renders is validated:

- Kubernetes' own kinds against the API's JSON schemas (``kubernetes-validate``, strict: an
  unknown field fails), for the oldest release the manifests are for and the newest packaged;
- the Kubeflow ``PyTorchJob`` against a schema built from the Kubeflow Training SDK's models
  (``kubeflow-training`` from PyPI: every field and its type, nothing else allowed), its pod
  templates against Kubernetes' ``PodTemplateSpec``;
- the Prometheus Operator's ``ServiceMonitor`` by what it must match (no schema of it is
  published on a registry these tests install from): the Service its selector picks, and the
  port it names.

Then what the files must agree on: the commands each container runs are real (parsed by the
CLI's own command), the secrets they read are the ones ``deploy/k8s/secrets`` makes from what
``elasticctl creds`` writes, each pod's credentials are its own node's, the NetworkPolicies let
each client reach its server, the restart policies fit the launcher's exit codes, GPU pods ask
for a GPU per member.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from kubeflow.training import models as kubeflow_models  # type: ignore[import-untyped]

from controlplane.settings import ENV_PREFIX
from rank_runtime import k8s
from rank_runtime.launcher import EXIT_FAILED, EXIT_NO_CONTROL_PLANE, EXIT_USAGE
from tests.k8s_manifests import (
    JOB,
    K8S,
    env_of,
    everything,
    example_nodes,
    image_name,
    kustomizations,
    pod_templates,
    render,
)
from tests.unit.test_deploy import TRAINER_SH, check_cli, known_env, trainer_argv

#: The oldest Kubernetes the manifests are for (Job podFailurePolicy is GA from 1.31), and the
#: newest kubernetes-validate knows.
VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
IMAGES = ("elastic-controlplane", "elastic-trainer")


# --------------------------------------------------------------------------- validation

#: What the SDK's models leave to the API documentation: the values these fields take.
KUBEFLOW_ENUMS = {
    ("KubeflowOrgV1ReplicaSpec", "restart_policy"): ["Always", "OnFailure", "Never", "ExitCode"],
    ("KubeflowOrgV1RunPolicy", "clean_pod_policy"): ["None", "Running", "All"],
}
#: Kubernetes types inside the PyTorchJob: validated as part of an object of this kind.
EMBEDDED = {
    "V1PodTemplateSpec": ("PodTemplate", "template"),
    "V1ObjectMeta": ("ConfigMap", "metadata"),
}


def _sdk_schema(type_name: str) -> dict[str, Any]:
    """A JSON schema from a Kubeflow SDK model's ``openapi_types``: its fields (by their JSON
    names) and nothing else; Kubernetes types are checked by ``x-kubernetes``."""
    scalars = {"str": "string", "int": "integer", "bool": "boolean", "float": "number"}
    if type_name in scalars:
        return {"type": scalars[type_name]}
    if type_name == "object":
        return {}
    if m := re.fullmatch(r"list\[(.+)\]", type_name):
        return {"type": "array", "items": _sdk_schema(m.group(1))}
    if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        return {"type": "object", "additionalProperties": _sdk_schema(m.group(1))}
    if not type_name.startswith("KubeflowOrg"):
        return {"x-kubernetes": type_name}
    model = getattr(kubeflow_models, type_name)
    properties = {}
    for field, kind in model.openapi_types.items():
        schema = _sdk_schema(kind)
        if (type_name, field) in KUBEFLOW_ENUMS:
            schema = {**schema, "enum": KUBEFLOW_ENUMS[(type_name, field)]}
        properties[model.attribute_map[field]] = schema
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _kubernetes_typed(version: str) -> Any:
    def check(validator: Any, type_name: str, instance: Any, schema: Any) -> Iterator[Any]:
        if type_name not in EMBEDDED:
            yield jsonschema.ValidationError(f"no schema here for the Kubernetes type {type_name}")
            return
        kind, key = EMBEDDED[type_name]
        wrapper = {"apiVersion": "v1", "kind": kind, "metadata": {"name": "x"}, key: instance}
        try:
            kubernetes_validate.validate(wrapper, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            yield jsonschema.ValidationError(f"{type_name}: {exc.message} at {list(exc.path)}")

    return check


def pytorchjob_validator(version: str) -> Any:
    schema = _sdk_schema("KubeflowOrgV1PyTorchJob")
    schema["properties"]["spec"]["properties"]["pytorchReplicaSpecs"]["propertyNames"] = {
        "enum": ["Master", "Worker"]
    }
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    base = jsonschema.Draft202012Validator
    validator = jsonschema.validators.extend(base, {"x-kubernetes": _kubernetes_typed(version)})
    return validator(schema)


def validation_errors(doc: dict[str, Any], version: str) -> list[str]:
    """Why ``doc`` is not a valid object of its kind (empty: it is)."""
    if (doc["apiVersion"], doc["kind"]) == ("kubeflow.org/v1", "PyTorchJob"):
        found = pytorchjob_validator(version).iter_errors(doc)
        return [f"{e.message} at {list(e.absolute_path)}" for e in found]
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{exc.message} at {list(exc.path)}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no schema for {doc['apiVersion']} {doc['kind']}"]
    return []


def test_every_kustomization_is_rendered_and_covered() -> None:
    assert set(kustomizations()) == {
        "controlplane", "overlays/trial", "overlays/production",
        "trainer/gpu", "trainer/cpu", "secrets",
    }  # fmt: skip
    components = {p.parent.name for p in (K8S / "components").glob("*/kustomization.yaml")}
    used = {
        Path(c).name
        for name in kustomizations()
        for c in yaml.safe_load((K8S / name / "kustomization.yaml").read_text()).get(
            "components", []
        )
    }
    assert components == used, "a component no overlay renders is never validated"
    loose = {p.relative_to(K8S) for p in K8S.rglob("*.yaml")} - {
        p.relative_to(K8S) for p in K8S.rglob("*.yaml") if _listed(p)
    }
    assert not loose, f"manifests no kustomization renders: {sorted(map(str, loose))}"


def _listed(path: Path) -> bool:
    if path.name == "kustomization.yaml":
        return True
    spec = yaml.safe_load((path.parent / "kustomization.yaml").read_text())
    return path.name in spec.get("resources", [])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", kustomizations())
def test_every_object_is_valid_for_its_kind(name: str, version: str) -> None:
    docs = render(name)
    assert docs
    problems = {}
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # test_service_monitors_scrape_what_exists
        if errors := validation_errors(doc, version):
            problems[f"{doc['kind']} {doc['metadata']['name']}"] = errors
    assert not problems, problems


def test_the_validation_refuses_what_the_api_server_would() -> None:
    """The checks can fail: a mistyped field, a value a field never takes, in a Kubernetes
    kind, in the PyTorchJob and inside its pod template."""
    version = VERSIONS[0]
    deployment = next(d for d in render("overlays/trial") if d["kind"] == "Deployment")
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["replica"] = 2
    assert validation_errors(wrong, version)
    job = next(d for d in render("trainer/gpu") if d["kind"] == "PyTorchJob")
    assert validation_errors(job, version) == []
    for path, value in (
        (("spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"), "Sometimes"),
        (("spec", "runPolicy", "backofLimit"), 3),
        (("spec", "pytorchReplicaSpecs", "Chief"), {"replicas": 1}),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers"), "x"),
        (("spec", "pytorchReplicaSpecs", "Master", "template", "spec", "hostNetwork"), "yes"),
    ):
        wrong = yaml.safe_load(yaml.safe_dump(job))
        target = wrong
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        assert validation_errors(wrong, version), path


# --------------------------------------------------------------------------- what they run


def test_every_container_of_the_images_runs_a_real_command(tmp_path: Path) -> None:
    known = known_env()
    ran = set()
    for doc in everything():
        for role, template in pod_templates(doc):
            for container in template["spec"]["containers"]:
                if image_name(container) not in IMAGES:
                    continue
                args = [str(a) for a in container.get("args", [])]
                env = env_of(container)
                for var in env:
                    if var.startswith(ENV_PREFIX):
                        assert var in known, f"{role}: {var} is read by nothing"
                    else:
                        assert f"$({var})" in " ".join(args), f"{role}: {var} is used by nothing"
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(args)):
                    assert var in env, f"{role}: $({var}) is not set (Kubernetes keeps it as is)"
                assert "FAULTS" not in env, f"{role}: fault injection in a deployment manifest"
                if container.get("command") == [TRAINER_SH]:
                    args = trainer_argv(args, "", tmp_path)
                else:
                    assert "command" not in container, "the image's entry point is elasticctl"
                check_cli(args, args[0])
                ran.add(args[0])
    assert ran == {"migrate", "serve", "api", "run", "retention"}


def launchers() -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(variant, role, pod template, the launcher's container) of every trainer pod."""
    for variant in ("trainer/gpu", "trainer/cpu"):
        for doc in render(variant):
            for role, template in pod_templates(doc):
                for container in template["spec"]["containers"]:
                    if image_name(container) == "elastic-trainer":
                        yield variant, role, template, container


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_trainer_pods_ask_for_a_device_per_member_and_share_memory() -> None:
    worlds: dict[str, set[str]] = {}
    for variant, role, template, container in launchers():
        args = [str(a) for a in container["args"]]
        members = int(_option(args, "--nproc")) + int(
            _option(args, "--spares") if "--spares" in args else 0
        )
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        if variant == "trainer/gpu":
            assert int(gpus) == members, f"{role}: a GPU per member (LOCAL_RANK picks it)"
            assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
        else:
            assert gpus is None and "nvidia.com/gpu" not in str(container["resources"])
        (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == shm["name"]]
        assert volume["emptyDir"]["medium"] == "Memory"
        assert "--rack-label" in args and "--rack" not in args, "the rack is the node's label"
        env = env_of(container)
        assert env[k8s.NODE_NAME_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert template["spec"]["serviceAccountName"] == "elastic-trainer"
        policy = _option(args, "--policy")
        worlds.setdefault(variant, set()).add(policy)
    # Every launcher of a job states the same policy; its world is what the workers start.
    for variant, policies in worlds.items():
        assert len(policies) == 1, (variant, policies)
        world = int(re.search(r"world_size=(\d+)", next(iter(policies))).group(1))  # type: ignore[union-attr]
        job = next(d for d in render(variant) if d["kind"] == "PyTorchJob")
        workers = job["spec"]["pytorchReplicaSpecs"]["Worker"]
        args = [str(a) for a in workers["template"]["spec"]["containers"][0]["args"]]
        assert workers["replicas"] * int(_option(args, "--nproc")) == world, variant


def test_restart_policies_follow_the_launchers_exit_codes() -> None:
    """The launcher's final statuses (1: the job stopped, 2: usage, 3: no control plane it can
    trust) are permanent errors to the operator (1-127), a signal's (128+N, SIGTERM on an
    eviction, a preemption, a deletion) retryable: the pod comes back and joins the job."""
    final = {EXIT_FAILED, EXIT_USAGE, EXIT_NO_CONTROL_PLANE}
    assert all(1 <= code <= 127 for code in final) and 128 + signal.SIGTERM > 127
    for variant in ("trainer/gpu", "trainer/cpu"):
        job = next(d for d in render(variant) if d["kind"] == "PyTorchJob")
        for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
            assert replica["restartPolicy"] == "ExitCode", role
        assert job["spec"]["runPolicy"]["backoffLimit"] >= 1
        pool = next(d for d in render(variant) if d["kind"] == "Job")
        assert pool["spec"]["template"]["spec"]["restartPolicy"] == "Never"
        rules = pool["spec"]["podFailurePolicy"]["rules"]
        (fail,) = [r for r in rules if r["action"] == "FailJob"]
        assert (
            fail["onExitCodes"]["operator"] == "In" and set(fail["onExitCodes"]["values"]) == final
        )
        (container,) = pool["spec"]["template"]["spec"]["containers"]
        assert fail["onExitCodes"]["containerName"] == container["name"]
        (ignore,) = [r for r in rules if r["action"] == "Ignore"]
        assert ignore["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
        args = [str(a) for a in container["args"]]
        assert _option(args, "--nproc") == "0" and int(_option(args, "--spares")) >= 1
        assert pool["spec"]["completionMode"] == "Indexed"


# --------------------------------------------------------------------------- secrets


def _generated() -> dict[tuple[str, str], set[str]]:
    """(kind, name) -> keys, of what deploy/k8s/secrets makes."""
    out = {}
    for doc in render("secrets"):
        assert doc["kind"] in ("Secret", "ConfigMap"), doc["kind"]
        out[(doc["kind"], doc["metadata"]["name"])] = set(doc.get("data", {}))
    return out


def test_secrets_are_kept_apart_and_every_one_read_is_made() -> None:
    generated = _generated()
    for name in kustomizations():
        if name == "secrets":
            continue
        made_here = {(d["kind"], d["metadata"]["name"]) for d in render(name)}
        for doc in render(name):
            assert doc["kind"] != "Secret", f"{name}: a Secret in what is re-applied"
            for role, template in pod_templates(doc):
                spec = template["spec"]
                for container in spec["containers"]:
                    for entry in container.get("env", []):
                        ref = entry.get("valueFrom", {}).get("secretKeyRef")
                        if ref and not ref.get("optional"):
                            keys = generated.get(("Secret", ref["name"]))
                            assert keys and ref["key"] in keys, f"{role}: {ref}"
                for volume in spec.get("volumes", []):
                    source = volume.get("secret") or volume.get("configMap")
                    kind = "Secret" if "secret" in volume else "ConfigMap"
                    if source is None:
                        continue
                    name_key = "secretName" if kind == "Secret" else "name"
                    if ("ConfigMap", source[name_key]) in made_here:
                        continue  # a ConfigMap of the same kustomization (not a secret)
                    keys = generated.get((kind, source[name_key]))
                    assert keys is not None, f"{role}: {kind} {source[name_key]} is made nowhere"
                    for item in source.get("items", []):
                        assert item["key"] in keys, f"{role}: {source[name_key]} has no {item}"


def test_each_trainer_pod_holds_its_own_nodes_credentials_only() -> None:
    """A pod of index i of a replica type mounts the seeds of the nodes its template's pods
    are (one template serves every Worker), the job's secret and command key; never the
    installation secret, never another kind of pod's seeds."""
    nodes = example_nodes()
    for variant, role, template, container in launchers():
        env = env_of(container)
        assert not {"ELASTIC_SECRET", "ELASTIC_NATS_USER", "ELASTIC_NATS_PASSWORD"} & set(env)
        mount = env["ELASTIC_NATS_CREDS_DIR"]["value"]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "creds"]
        assert {"name": "creds", "mountPath": mount, "readOnly": True} in container["volumeMounts"]
        prefix = f"{JOB}-spares-" if role == f"{JOB}-spares" else f"{JOB}-{role.lower()}-"
        own = [n for n in nodes if n.startswith(prefix)]
        assert own, role
        expected = {f"{JOB}/{n}/{seed}" for n in own for seed in ("launcher.nk", "member.nk")}
        expected |= {f"{JOB}/job-secret", f"{JOB}/command-key"}
        assert {i["path"] for i in volume["secret"]["items"]} == expected, (variant, role)


# --------------------------------------------------------------------------- the network


def test_network_policies_let_each_client_reach_its_server() -> None:
    for variant in ("overlays/trial", "overlays/production"):
        docs = list(render(variant))
        for trainer in ("trainer/gpu", "trainer/cpu"):
            docs_with_job = docs + list(render(trainer))
            policies = [d for d in docs_with_job if d["kind"] == "NetworkPolicy"]

            def admitted(
                labels: dict[str, str],
                target: str,
                port: int | None,
                policies: list[dict[str, Any]] = policies,
            ) -> bool:
                """Whether a pod of ``labels`` may reach pods named ``target`` on ``port``."""
                for policy in policies:
                    selected = policy["spec"]["podSelector"].get("matchLabels", {})
                    if selected.get("app.kubernetes.io/name") != target:
                        continue
                    for rule in policy["spec"].get("ingress", []):
                        ports = {p["port"] for p in rule.get("ports", [])}
                        if port is not None and ports and port not in ports:
                            continue
                        for peer in rule.get("from", [{}]):
                            want = peer.get("podSelector", {}).get("matchLabels")
                            if "namespaceSelector" in peer or want is None:
                                return True
                            if all(labels.get(k) == v for k, v in want.items()):
                                return True
                return False

            for doc in docs_with_job:
                for role, template in pod_templates(doc):
                    labels = template["metadata"].get("labels", {})
                    for container in template["spec"]["containers"]:
                        env = env_of(container)
                        if "ELASTIC_NATS_URL" in env:
                            assert admitted(labels, "nats", 4222), f"{role} cannot reach NATS"
                        if "ELASTIC_DATABASE_URL" in env and variant == "overlays/trial":
                            assert admitted(labels, "postgres", 5432), f"{role}: no database"
                    if labels.get("app.kubernetes.io/component") == "trainer":
                        assert admitted(labels, "elastic-controlplane", 29400), role
                        job = labels["elastic.dev/job"]
                        (own,) = [p for p in policies if p["metadata"]["name"] == job]
                        assert own["spec"]["podSelector"]["matchLabels"] == {"elastic.dev/job": job}
            # An outsider reaches neither the rendezvous nor NATS.
            assert not admitted({"app": "other"}, "elastic-controlplane", 29400)
            assert not admitted({"app": "other"}, "nats", 4222)


def test_nats_is_a_cluster_of_three_every_client_knows() -> None:
    docs = render("overlays/trial")
    (nats,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats"]
    replicas = nats["spec"]["replicas"]
    assert replicas == 3
    urls = ",".join(f"nats://nats-{i}.nats-headless:4222" for i in range(replicas))
    conf = (K8S / "controlplane" / "nats.conf").read_text()
    for i in range(replicas):
        assert f"nats-route://nats-{i}.nats-headless:6222" in conf
    assert nats["spec"]["serviceName"] == "nats-headless"
    anti = nats["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )
    (budget,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"
                 and d["metadata"]["name"] == "nats"]  # fmt: skip
    assert budget["spec"]["maxUnavailable"] == 1
    for doc in [*docs, *render("trainer/gpu")]:
        for role, template in pod_templates(doc):
            for container in template["spec"]["containers"]:
                env = env_of(container)
                if "ELASTIC_NATS_URL" in env:
                    assert env["ELASTIC_NATS_URL"]["value"] == urls, role
                if "ELASTIC_STREAM_REPLICAS" in env:
                    assert int(env["ELASTIC_STREAM_REPLICAS"]["value"]) == replicas


def test_the_control_plane_has_a_standby_elsewhere_and_its_ports_served() -> None:
    docs = render("overlays/production")
    (cp,) = [d for d in docs if d["kind"] == "Deployment"
             and d["metadata"]["name"] == "elastic-controlplane"]  # fmt: skip
    assert cp["spec"]["replicas"] == 2
    spec = cp["spec"]["template"]["spec"]
    anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    (container,) = spec["containers"]
    env = env_of(container)
    assert env["ELASTIC_RENDEZVOUS_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["ELASTIC_NATS_CREDS"]["value"] == "/creds/controlplane.nk"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"rendezvous": int(env["ELASTIC_RENDEZVOUS_PORT"]["value"]),
                     "metrics": int(env["ELASTIC_METRICS_PORT"]["value"])}  # fmt: skip
    (budget,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"
                 and d["metadata"]["name"] == "elastic-controlplane"]  # fmt: skip
    assert budget["spec"]["minAvailable"] == 1
    assert container["readinessProbe"] and container["livenessProbe"]
    assert container["resources"]["requests"] and container["resources"]["limits"]


def test_service_monitors_scrape_what_exists() -> None:
    docs = render("overlays/production")
    services = [d for d in docs if d["kind"] == "Service"]
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"elastic-controlplane", "elastic-api"}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        want = monitor["spec"]["selector"]["matchLabels"]
        picked = [s for s in services
                  if all(s["metadata"].get("labels", {}).get(k) == v for k, v in want.items())]  # fmt: skip
        assert len(picked) == 1, monitor["metadata"]["name"]
        names = {p["name"] for p in picked[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in names and endpoint["path"] == "/metrics"


def test_images_are_per_role_and_overridable() -> None:
    production = render("overlays/production")
    images = {c["image"] for d in production for _, t in pod_templates(d)
              for c in t["spec"]["containers"] if "elastic" in c["image"]}  # fmt: skip
    assert images == {"registry.example.com/elastic/controlplane:0.1.0"}
    by_variant: dict[str, set[str]] = {}
    for variant, _, _, container in launchers():
        by_variant.setdefault(variant, set()).add(container["image"])
    assert by_variant == {
        "trainer/gpu": {"elastic-trainer:latest"},
        "trainer/cpu": {"elastic-trainer:cpu"},
    }
