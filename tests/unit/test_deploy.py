"""The deployment files, checked without a Docker engine or a cluster.

- ``docker-compose.yml`` against the Compose Specification's JSON Schema (vendored in
  ``tests/data``), and through ``docker compose config`` where a Compose binary is installed;
- every compose service that runs the image runs a real ``elasticctl``
  command whose options exist (parsed by the CLI's own click command), a training script that
  exists with options it has, a policy the launcher accepts and fault specs that parse;
- every ``ELASTIC_*`` variable set is a setting (``controlplane.settings.Settings``) or one the
  rank runtime reads;
- ``deploy/nats/nats.conf`` loads the users ``elasticctl creds`` issues, which give each
  identity the subjects of ``schemas.subjects`` (a static check), and a real
  ``nats-server`` started with it lets the control plane, a member and its launcher do what the
  code does, and refuses what they must not (marked ``services``);
- the Dockerfile copies what the services run, and the health check finds the ingest lock.

The Kubernetes manifests are ``tests/unit/test_kubernetes.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import typer.main
import yaml  # type: ignore[import-untyped]

from controlplane.cli import app
from controlplane.settings import ENV_PREFIX, Settings
from rank_runtime import faults
from rank_runtime.launcher_cli import launch_policy
from schemas.events import CONTROLPLANE_EVENT_TYPES
from schemas.subjects import (
    BROADCAST,
    EVENTS_WILDCARD,
    command_subject,
    event_subject,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
NATS_CONF = ROOT / "deploy" / "nats" / "nats.conf"
NATS_CLUSTER_CONF = ROOT / "deploy" / "nats" / "nats-cluster.conf"
CLUSTER_COMPOSE = ROOT / "docker-compose.nats-cluster.yml"
TRAINER_SH = "/app/deploy/trainer.sh"
#: The compose services that run the project's image, and what each must run.
EXPECTED = {
    "creds": "creds",
    "migrate": "migrate",
    "controlplane": "serve",
    "controlplane-standby": "serve",
    "api": "api",
    "trainer": "run",
}


# --------------------------------------------------------------------------- helpers


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR-default}`` / ``${VAR}`` with an empty host
    environment (what a fresh checkout gets)."""
    env = env or {}

    def one(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", one, value)


def service_env(service: dict[str, Any]) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    return {k: None if v is None else interpolate(str(v)) for k, v in env.items()}


def trainer_argv(args: list[str], fault_env: str, tmp_path: Path) -> list[str]:
    """The ``elasticctl`` command line ``deploy/trainer.sh ARGS`` amounts to (run with stubs of
    ``elasticctl`` and of ``elastic-run``, which is ``elasticctl run``)."""
    stub_dir = tmp_path / f"stub-{uuid.uuid4().hex[:6]}"
    stub_dir.mkdir()
    for name, first in (("elasticctl", ""), ("elastic-run", 'printf "run\\n"\n')):
        stub = stub_dir / name
        stub.write_text(f'#!/bin/sh\n{first}for a in "$@"; do printf "%s\\n" "$a"; done\n')
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub_dir}{os.pathsep}{os.environ['PATH']}"}
    env["FAULTS"] = fault_env
    done = subprocess.run(
        ["sh", str(ROOT / "deploy" / "trainer.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


_TRAIN_HELP: dict[str, str] = {}


def script_help(script: str) -> str:
    """``python SCRIPT --help`` (imports torch: a few seconds, once per script)."""
    if script not in _TRAIN_HELP:
        done = subprocess.run(
            [sys.executable, script, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        _TRAIN_HELP[script] = done.stdout
    return _TRAIN_HELP[script]


def check_cli(argv: list[str], expected: str) -> Any:
    """Parse ``elasticctl ARGV`` with the CLI's own click command; fail on an unknown command,
    an unknown or invalid option, a missing argument. Returns the subcommand's context."""
    # Typer may bring its own copy of click: use the objects it builds, not click's classes.
    group = typer.main.get_command(app)
    assert argv and argv[0] == expected, f"expected `elasticctl {expected} ...`, got {argv}"
    root = group.make_context("elasticctl", [], resilient_parsing=True)
    command = group.get_command(root, argv[0])  # type: ignore[attr-defined]
    assert command is not None, f"`elasticctl {argv[0]}` is not a command"
    try:
        ctx = command.make_context(argv[0], list(argv[1:]), parent=root)
    except Exception as exc:
        if not hasattr(exc, "format_message"):  # not a usage error
            raise
        pytest.fail(f"`elasticctl {shlex.join(argv)}`: {exc.format_message()}")
    if expected == "run":
        check_run(ctx)
    else:
        assert not ctx.args, f"`elasticctl {shlex.join(argv)}`: extra arguments {ctx.args}"
    return ctx


def check_run(ctx: Any) -> None:
    """The launcher's script exists, takes the arguments passed to it; the policy and the
    faults are what ``elasticctl run`` accepts."""
    params = ctx.params
    script = params["script"]
    assert (ROOT / script).is_file(), f"no training script {script}"
    helptext = script_help(script)
    for arg in ctx.args:
        if arg.startswith("--"):
            assert arg.split("=", 1)[0] in helptext, f"{script} has no option {arg}"
    launch_policy(params["policy"], params["nproc"])
    for spec in params["fault"] or []:
        faults.parse(spec)


def known_env() -> set[str]:
    """Every ``ELASTIC_*`` name a process of the image reads: the settings, and the names the
    rank runtime reads (its source names each as a string)."""
    names = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    sources = [*(ROOT / "rank_runtime").glob("*.py"), ROOT / "schemas" / "auth.py"]
    sources.append(ROOT / "schemas" / "creds.py")  # what the launcher reads through it
    for path in sources:
        names |= set(re.findall(r"\"(ELASTIC_[A-Z0-9_]+)\"", path.read_text()))
    return names


# --------------------------------------------------------------------------- compose


def test_compose_file_matches_the_compose_specification() -> None:
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
    )


def _compose_binary() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
            if probe.returncode == 0:
                return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def test_docker_compose_config_accepts_the_file() -> None:
    binary = _compose_binary()
    if binary is None:
        pytest.skip("no Compose binary: `docker compose` (the plugin) and `docker-compose` absent")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "NATS_"))}
    done = subprocess.run(
        [*binary, "-f", str(COMPOSE), "config", "--quiet"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def merged(base: dict[str, Any], over: dict[str, Any], key: str = "") -> dict[str, Any]:
    """``over`` applied to ``base`` as Compose merges files: mappings key by key, a service's
    ``volumes`` by their target, any other value replaced."""
    out = dict(base)
    for name, value in over.items():
        old = out.get(name)
        if isinstance(old, dict) and isinstance(value, dict):
            out[name] = merged(old, value, name)
        elif name == "volumes" and isinstance(old, list) and isinstance(value, list):
            targets = {str(v).split(":")[1]: v for v in old}
            targets.update({str(v).split(":")[1]: v for v in value})
            out[name] = list(targets.values())
        else:
            out[name] = value
    return out


def test_the_nats_cluster_overlay_runs_three_nodes_every_client_reaches() -> None:
    """docker-compose.nats-cluster.yml over docker-compose.yml: three NATS nodes on the
    cluster configuration, each with the users and a store of its own, routes naming every
    node; the control planes keep the streams on all three and every client names all three."""
    overlay = yaml.safe_load(CLUSTER_COMPOSE.read_text())
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(overlay))
    assert not errors, [e.message for e in errors]
    stack = merged(compose(), overlay)
    services = stack["services"]
    nodes = sorted(
        n for n, svc in services.items() if "/etc/nats/nats-cluster.conf" in svc.get("command", [])
    )
    assert nodes == ["nats", "nats-2", "nats-3"]
    names = {service_env(services[n])["NATS_SERVER_NAME"] for n in nodes}
    assert len(names) == len(nodes), "two nodes share a server name"
    stores = set()
    for name in nodes:
        volumes = {str(v).split(":")[1]: str(v).split(":")[0] for v in services[name]["volumes"]}
        assert volumes["/etc/nats/nats.conf"] == "./deploy/nats/nats.conf"
        assert volumes["/etc/nats/nats-cluster.conf"] == "./deploy/nats/nats-cluster.conf"
        assert volumes["/etc/nats/auth"] == "nats-creds"
        stores.add(volumes["/data"])
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no health check"
    assert len(stores) == len(nodes) and stores <= set(stack["volumes"])
    conf = NATS_CLUSTER_CONF.read_text()
    assert re.search(r'^include "nats.conf"', conf, re.M)
    assert set(re.findall(r"nats-route://([\w-]+):6222", conf)) == set(nodes)
    for client in ("controlplane", "controlplane-standby", "trainer"):
        env = service_env(services[client])
        assert env["ELASTIC_NATS_URL"] == ",".join(f"nats://{n}:4222" for n in nodes), client
    for client in ("controlplane", "controlplane-standby"):
        assert service_env(services[client])["ELASTIC_STREAM_REPLICAS"] == str(len(nodes))
        needs = services[client]["depends_on"]
        assert all(needs[n]["condition"] == "service_healthy" for n in nodes), client
    binary = _compose_binary()
    if binary is not None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "NATS_"))}
        done = subprocess.run(
            [*binary, "-f", str(COMPOSE), "-f", str(CLUSTER_COMPOSE), "config", "--quiet"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr


def test_start_up_order_and_health_checks() -> None:
    services = compose()["services"]
    assert set(EXPECTED) | {"nats", "postgres"} == set(services)
    for name in ("nats", "postgres", "controlplane", "controlplane-standby", "api"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no health check"

    def needs(name: str) -> dict[str, str]:
        return {k: v["condition"] for k, v in services[name].get("depends_on", {}).items()}

    assert needs("migrate") == {"postgres": "service_healthy"}
    assert needs("nats") == {"creds": "service_completed_successfully"}
    assert services["creds"]["restart"] == "no"
    for name in ("controlplane", "controlplane-standby"):
        assert needs(name) == {
            "migrate": "service_completed_successfully",
            "nats": "service_healthy",
            "postgres": "service_healthy",
        }
    assert needs("api")["migrate"] == "service_completed_successfully"
    assert needs("trainer")["controlplane"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"
    assert services["postgres"]["volumes"][0].startswith("postgres-data:")
    assert "postgres-data" in compose()["volumes"]
    # NATS runs with the configuration that loads the issued users, JetStream on.
    nats = services["nats"]
    assert "/etc/nats/nats.conf" in nats["command"]
    assert any(v.startswith("./deploy/nats/nats.conf:") for v in nats["volumes"])
    assert "nats-creds:/etc/nats/auth:ro" in nats["volumes"]
    assert re.search(r'^\s*include "auth/nats-users.conf"', NATS_CONF.read_text(), re.M)
    assert re.search(r"^jetstream\s*\{", NATS_CONF.read_text(), re.M)


def test_each_control_plane_advertises_its_own_rendezvous_address() -> None:
    """Ranks in another container reach the leader's rendezvous store by service name."""
    services = compose()["services"]
    for name in ("controlplane", "controlplane-standby"):
        env = service_env(services[name])
        assert env["ELASTIC_RENDEZVOUS_HOST"] == name
        port = env["ELASTIC_RENDEZVOUS_PORT"]
        assert port and port != "0" and port in services[name]["expose"]
        assert env.get("ELASTIC_RENDEZVOUS", "true") != "false"


def test_every_service_runs_a_real_elasticctl_command(tmp_path: Path) -> None:
    services = compose()["services"]
    for name, expected in EXPECTED.items():
        service = services[name]
        target = "trainer" if expected == "run" else "controlplane"
        assert service["image"].startswith(f"elastic-{target}:")
        assert service.get("build") == {"context": ".", "target": target}, name
        command = [interpolate(str(c)) for c in service["command"]]
        entrypoint = service.get("entrypoint")
        if entrypoint:
            assert entrypoint == [TRAINER_SH], f"{name}: entrypoint {entrypoint}"
            fault_env = service_env(service).get("FAULTS") or ""
            assert fault_env, "the trainer injects faults by default"
            command = trainer_argv(command, fault_env, tmp_path)
            assert command.count("--fault") == len(fault_env.split(","))
        ctx = check_cli(command, expected)
        if expected == "run":
            assert ctx.params["spares"] >= 1, "the example deployment keeps a warm spare"
        if expected == "api":
            assert ctx.params["host"] == "0.0.0.0" and ctx.params["port"] == 8080
            assert any(p.startswith("8080:") for p in service["ports"])


def test_trainer_wrapper_turns_faults_into_flags(tmp_path: Path) -> None:
    argv = ["run", "--nproc", "2", "examples/train.py", "--steps", "5"]
    assert trainer_argv(argv, "", tmp_path) == argv
    assert trainer_argv(argv, "crash@3:rank=1, hang@4:rank=0", tmp_path) == [
        "run", "--fault", "crash@3:rank=1", "--fault", "hang@4:rank=0", *argv[1:],
    ]  # fmt: skip
    assert trainer_argv(["migrate"], "crash@3:rank=1", tmp_path) == ["migrate"]
    bad = subprocess.run(
        ["sh", str(ROOT / "deploy" / "trainer.sh"), "run", "x.py"],
        env={**os.environ, "FAULTS": "crash@3:rank=1;rm"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "FAULTS entry" in bad.stderr


def test_environment_names_are_settings_or_runtime_variables() -> None:
    known = known_env()
    services = compose()["services"]
    for name in EXPECTED:
        for var in service_env(services[name]):
            if var.startswith(ENV_PREFIX):
                assert var in known, f"compose service {name}: {var} is read by nothing"
            else:
                assert var == "FAULTS", f"compose service {name}: unexpected variable {var}"


def test_secrets_have_local_defaults_only_in_compose() -> None:
    """Every secret has a default for a laptop and can be set from the host environment."""
    text = COMPOSE.read_text()
    for var in ("ELASTIC_SECRET", "POSTGRES_PASSWORD"):
        assert re.search(r"\$\{" + var + r":-[^}]+\}", text), f"{var} has no default"
    assert "ELASTIC_API_TOKENS" in service_env(compose()["services"]["api"])
    assert service_env(compose()["services"]["api"])["ELASTIC_API_TOKENS"] is None


# --------------------------------------------------------------------------- the image


def dockerfile_stages() -> dict[str, list[str]]:
    """The Dockerfile's instructions by stage (``FROM ... AS name``), comments dropped."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in (ln.strip() for ln in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        if m := re.fullmatch(r"FROM (\S+) AS (\S+)", line):
            current = stages[m.group(2)] = [line]
        else:
            current.append(line)
    return stages


def test_dockerfile_builds_an_image_per_role() -> None:
    """The control plane's image has no torch, the trainer's none of the server packages;
    each copies what its roles run, runs as a user, and has its command as entry point."""
    stages = dockerfile_stages()
    assert set(stages) == {"base", "controlplane", "trainer"}
    assert stages["base"][0] == "FROM python:3.11-slim AS base"
    for name in ("controlplane", "trainer"):
        assert stages[name][0] == f"FROM base AS {name}"
    base = " ".join(stages["base"])
    assert "useradd" in base and "--uid 10001" in base
    control, trainer = (" ".join(stages[n]) for n in ("controlplane", "trainer"))
    assert "torch" not in control
    assert "RUN pip install '.[server]'" in control
    assert re.search(r"RUN pip install \. ", trainer) and "[server]" not in trainer
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", "\n".join(stages["trainer"]), re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in stages["trainer"]
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url "\$\{TORCH_INDEX_URL\}"',
                     trainer)  # fmt: skip
    # torch installs before the project's files are copied: a code change keeps its layer.
    first_copy = next(i for i, ln in enumerate(stages["trainer"]) if ln.startswith("COPY "))
    torch_at = next(i for i, ln in enumerate(stages["trainer"]) if "torch==" in ln)
    assert torch_at < first_copy
    assert stages["controlplane"][-1] == 'CMD ["--help"]'
    assert 'ENTRYPOINT ["elasticctl"]' in stages["controlplane"]
    assert 'ENTRYPOINT ["elastic-run"]' in stages["trainer"]
    for name in ("controlplane", "trainer"):
        user = [ln for ln in stages[name] if ln.startswith("USER ")]
        assert user and user[-1] not in ("USER root", "USER 0")
    ignored = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    copied: dict[str, set[str]] = {}
    for name in ("controlplane", "trainer"):
        for line in stages[name]:
            if line.startswith("COPY "):
                *sources, _ = line.split()[1:]
                for source in sources:
                    assert (ROOT / source).exists(), f"COPY {source}: no such path"
                    top = source.rstrip("/")
                    assert not any(top == p or top.startswith(p + "/") for p in ignored), (
                        f"COPY {source} is excluded by .dockerignore"
                    )
                    copied.setdefault(name, set()).add("/app/" + top)
    # The files each role names inside its image are copied to /app.
    needed = {"controlplane": {"/app/deploy/healthcheck.py"}, "trainer": {TRAINER_SH}}
    for service in compose()["services"].values():
        target = (service.get("build") or {}).get("target")
        for word in service.get("healthcheck", {}).get("test", []):
            if target and str(word).startswith("/app/"):
                needed[target].add(str(word))
        if target and service.get("entrypoint"):
            needed[target].update(str(w) for w in service["entrypoint"])
    for name, paths in needed.items():
        for path in paths:
            assert path in copied[name] or any(path.startswith(c + "/") for c in copied[name]), (
                name,
                path,
            )
    assert "/app/examples" in copied["trainer"] and (ROOT / "examples" / "train.py").is_file()


def _healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "deploy" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_health_check_knows_the_ingest_lock_key() -> None:
    from controlplane.lock import INGEST_LOCK_KEY

    assert _healthcheck().INGEST_LOCK_KEY == INGEST_LOCK_KEY


@pytest.mark.services
def test_health_check_sees_a_leader_through_the_lock(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    from controlplane.lock import INGEST_LOCK_KEY
    from controlplane.settings import libpq_url

    check = _healthcheck()
    monkeypatch.setenv("ELASTIC_DATABASE_URL", database_url)
    monkeypatch.delenv("ELASTIC_METRICS_PORT", raising=False)
    assert check.controlplane() == "no control plane holds the ingest lock yet"
    with psycopg.connect(libpq_url(database_url), autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (INGEST_LOCK_KEY,))
        assert check.controlplane() is None
        assert check.main(["healthcheck.py", "controlplane"]) == 0
    assert check.main(["healthcheck.py", "controlplane"]) == 1
    monkeypatch.setenv("ELASTIC_API_PORT", "1")
    assert "does not answer" in (check.api() or "")


# --------------------------------------------------------------------------- NATS

#: The job, nodes and secret of the static and the live checks.
JOB = "job-1"
NODES = ("node0", "node1")
SECRET = bytes(range(32))


def issued_users(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(job, node/kind) or ("", "controlplane") -> the user ``elasticctl creds`` issues."""
    from controlplane import creds

    creds.issue(SECRET, directory, JOB, NODES)
    settings = Settings()
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in creds.users(
        directory, events_stream=settings.stream, command_stream=settings.command_stream
    ):
        key = ("", creds.CONTROLPLANE)
        for node in NODES:
            for kind in creds.KINDS:
                seed = creds.node_seed(SECRET, JOB, node, kind)
                if entry["nkey"] == creds.public_key(seed):
                    key = (JOB, f"{node}/{kind}")
        found[key] = entry
    return found


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcards: ``*`` is one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def allowed(rules: dict[str, list[str]], subject: str) -> bool:
    """Whether NATS lets ``subject`` through ``rules`` ({"allow": [...], "deny": [...]})."""
    if any(subject_matches(p, subject) for p in rules.get("deny", [])):
        return False
    return any(subject_matches(p, subject) for p in rules.get("allow", []))


def test_nats_identities_cover_the_subjects(tmp_path: Path) -> None:
    users = issued_users(tmp_path)
    assert len(users) == 1 + 2 * len(NODES)
    cp = users[("", "controlplane")]["permissions"]
    launcher = users[(JOB, "node0/launcher")]["permissions"]
    member = users[(JOB, "node0/member")]["permissions"]
    settings = Settings()
    own = [event_subject(JOB, "node0", "w0", t) for t in ("member.joined", "train.step")]
    for subject in own:
        assert allowed(member["publish"], subject) and not allowed(launcher["publish"], subject)
        assert not allowed(cp["publish"], subject), "the control plane never publishes events"
        assert subject_matches(EVENTS_WILDCARD, subject)
    exits = event_subject(JOB, "node0", "launcher", "member.exited")
    assert allowed(launcher["publish"], exits) and not allowed(member["publish"], exits)
    # Literal subjects only: every token is one the control plane named (no wildcard a member
    # could fill with bytes that are not UTF-8, or with subjects of its own).
    for perms in (member, launcher):
        for subject in perms["publish"]["allow"]:
            if subject.startswith(("elastic.evt.", "elastic.hb.")):
                assert "*" not in subject.split(".") and ">" not in subject.split("."), subject
    for subject in (
        f"elastic.evt.{JOB}.node0.member.member.bogus",
        f"elastic.evt.{JOB}.node0.w0.member.joined",
        f"elastic.evt.{JOB}.node0.member.{next(iter(CONTROLPLANE_EVENT_TYPES))}",
        f"elastic.hb.{JOB}.node0.w0",
    ):
        assert not allowed(member["publish"], subject), subject
    for subject in (
        event_subject(JOB, "node1", "w1", "member.exited"),
        event_subject(JOB, "node1", "launcher", "member.exited"),
        event_subject("job-2", "node0", "w0", "member.exited"),
    ):
        assert not allowed(member["publish"], subject), subject
        assert not allowed(launcher["publish"], subject), subject
    commands = [command_subject(JOB), command_subject(JOB, "w0")]
    assert command_subject(JOB).endswith(BROADCAST)
    for subject in commands:
        assert allowed(cp["publish"], subject)
        assert not allowed(member["publish"], subject), "only the control plane commands"
        assert not allowed(launcher["publish"], subject), "only the control plane commands"
    # The control plane administers the streams and pulls from its durable consumer.
    for api in (
        f"$JS.API.STREAM.CREATE.{settings.stream}",
        f"$JS.API.STREAM.UPDATE.{settings.command_stream}",
        f"$JS.API.CONSUMER.MSG.NEXT.{settings.stream}.{settings.ingest_durable}",
        f"$JS.ACK.{settings.stream}.{settings.ingest_durable}.1.1.1.1.0",
    ):
        assert allowed(cp["publish"], api), api
    # A node follows its job's commands: NATS core subscriptions to that job's command
    # subjects, and the command in force read by its subject (direct get), that job's only.
    for perms in (member, launcher):
        for target in (BROADCAST, "w0"):
            api = f"$JS.API.DIRECT.GET.{settings.command_stream}.{command_subject(JOB, target)}"
            assert allowed(perms["publish"], api), api
            assert allowed(perms["subscribe"], command_subject(JOB, target))
        for subject in (command_subject("job-2"), command_subject("job-2", "w0"), "elastic.cmd.>"):
            assert not allowed(perms["subscribe"], subject), subject
        for api in (
            f"$JS.API.DIRECT.GET.{settings.command_stream}",  # by sequence: any job's
            f"$JS.API.DIRECT.GET.{settings.command_stream}.{command_subject('job-2')}",
            f"$JS.API.DIRECT.GET.{settings.stream}.{EVENTS_WILDCARD}",
            f"$JS.API.STREAM.MSG.GET.{settings.command_stream}",
            f"$JS.API.CONSUMER.CREATE.{settings.command_stream}",
            f"$JS.API.CONSUMER.CREATE.{settings.command_stream}.c1.{command_subject(JOB)}",
            f"$JS.API.CONSUMER.CREATE.{settings.stream}",
            f"$JS.API.CONSUMER.CREATE.{settings.stream}.c1.{EVENTS_WILDCARD}",
            f"$JS.API.CONSUMER.DELETE.{settings.command_stream}.c1",
            f"$JS.API.STREAM.DELETE.{settings.command_stream}",
            f"$JS.API.STREAM.PURGE.{settings.stream}",
            f"$JS.ACK.{settings.stream}.x.1.1.1.1.0",
        ):
            assert not allowed(perms["publish"], api), api
    # Replies come to an inbox of each identity's own; nobody may read _INBOX.> or events.
    inboxes = set()
    for entry in users.values():
        sub = entry["permissions"]["subscribe"]
        pattern, *others = sub["allow"]
        # ... and only the control plane hears heartbeats (NATS core, never stored); a node
        # hears its own job's commands, and the control plane's beacon (which only the
        # control plane may send).
        if entry["permissions"] is cp:
            assert others == ["elastic.hb.>"], others
            assert allowed(entry["permissions"]["publish"], "elastic.beacon")
        else:
            assert others == [f"elastic.cmd.{JOB}.>", "elastic.beacon"], others
            assert not allowed(entry["permissions"]["publish"], "elastic.beacon")
        assert pattern.startswith("_INBOX_") and pattern.endswith(".>")
        inboxes.add(pattern)
        for subject in (
            "_INBOX.abc.1",
            "elastic.evt.job-1.node0.w0.train.step",
            "elastic.cmd.x.all",
        ):
            assert not allowed(sub, subject), subject
    assert len(inboxes) == len(users)


def test_compose_gives_every_nats_client_its_own_credential(tmp_path: Path) -> None:
    from controlplane import creds
    from rank_runtime import launcher
    from schemas.auth import MASTER_SECRET_ENV, parse_secret
    from schemas.creds import CREDS_DIR_ENV

    services = compose()["services"]
    issue = check_cli([interpolate(str(c)) for c in services["creds"]["command"]], "creds")
    argv = [interpolate(str(c)) for c in services["trainer"]["command"]]
    job = argv[argv.index("--job-id") + 1]
    nodes, racks = int(argv[argv.index("--nodes") + 1]), int(argv[argv.index("--racks") + 1])
    nproc, spares = int(argv[argv.index("--nproc") + 1]), int(argv[argv.index("--spares") + 1])
    assert issue.params["job"] == job and issue.params["nodes"] == nodes
    assert f"nats-creds:{issue.params['out']}" in services["creds"]["volumes"]
    secret = service_env(services["creds"])[MASTER_SECRET_ENV]
    assert secret
    for name in ("controlplane", "controlplane-standby"):
        env = service_env(services[name])
        assert env["ELASTIC_NATS_CREDS"] == f"/creds/{creds.CONTROLPLANE_FILE}"
        assert env[MASTER_SECRET_ENV] == secret
        assert "nats-creds:/creds:ro" in services[name]["volumes"]
    trainer = service_env(services["trainer"])
    assert trainer[CREDS_DIR_ENV] == "/creds"
    assert "nats-creds:/creds:ro" in services["trainer"]["volumes"]
    assert MASTER_SECRET_ENV not in trainer, "members never hold the installation secret"
    for env in (service_env(s) for s in services.values()):
        assert "ELASTIC_NATS_USER" not in env and "ELASTIC_NATS_PASSWORD" not in env
    # What the creds service writes is what the launcher looks for, node by node.
    creds.issue(parse_secret(secret), tmp_path, job, [f"node{j}" for j in range(nodes)])
    base = {CREDS_DIR_ENV: str(tmp_path)}
    found = launcher._node_credentials(base, job, launcher.layout(nproc, spares, nodes, racks))
    assert len(found) == nodes and "ELASTIC_JOB_SECRET" in base


@pytest.fixture
def nats_with_roles(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real nats-server running deploy/nats/nats.conf (its store and ports moved here) with
    the users ``elasticctl creds`` issues under ``auth/`` beside it: (url, creds directory)."""
    from controlplane.devstack import free_port, nats_server_binary

    issued_users(tmp_path / "auth")
    port, monitor = free_port(), free_port()
    conf = NATS_CONF.read_text()
    conf = re.sub(r"(?m)^listen: .*$", f"listen: 127.0.0.1:{port}", conf)
    conf = re.sub(r"(?m)^http: .*$", f"http: 127.0.0.1:{monitor}", conf)
    conf = conf.replace("store_dir: /data/jetstream", f"store_dir: {tmp_path / 'js'}")
    path = tmp_path / "nats.conf"
    path.write_text(conf)
    log = (tmp_path / "nats.log").open("wb")
    proc = subprocess.Popen(
        [nats_server_binary(), "-c", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 15
        import socket

        while True:
            assert proc.poll() is None, (tmp_path / "nats.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not start"
                time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}", tmp_path / "auth"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _start_nats(config: Path, env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    """``nats-server -c config``, once it listens on ``port``."""
    from controlplane.devstack import nats_server_binary

    log = config.with_suffix(".log")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(config)], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **env}, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 15
    while True:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(OSError):
            import socket

            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        assert time.monotonic() < deadline, "nats-server did not start"
        time.sleep(0.05)


@pytest.mark.services
@pytest.mark.timeout(90)
async def test_the_nats_cluster_config_keeps_the_streams_on_three_nodes(tmp_path: Path) -> None:
    """Three real nats-servers, each deploy/nats/nats-cluster.conf over deploy/nats/nats.conf
    (ports, stores and the routes' hosts moved to this machine) with the issued users: the
    control plane's identity creates the streams at R3, and with the events stream's leader
    killed another node leads it."""
    import urllib.request

    import nats.errors

    from controlplane import bus, creds
    from controlplane.devstack import free_port

    hosts = ("nats", "nats-2", "nats-3")
    routes = {host: free_port() for host in hosts}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls, monitors = [], {}
    try:
        for i, host in enumerate(hosts):
            directory = tmp_path / host
            issued_users(directory / "auth")
            port, monitors[host] = free_port(), free_port()
            conf = NATS_CONF.read_text()
            conf = re.sub(r"(?m)^listen: .*$", f"listen: 127.0.0.1:{port}", conf)
            conf = re.sub(r"(?m)^http: .*$", f"http: 127.0.0.1:{monitors[host]}", conf)
            conf = conf.replace("store_dir: /data/jetstream", f"store_dir: {directory / 'js'}")
            (directory / "nats.conf").write_text(conf)
            cluster = NATS_CLUSTER_CONF.read_text()
            cluster = cluster.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{routes[host]}")
            for other, route in routes.items():
                cluster = cluster.replace(
                    f"nats-route://{other}:6222", f"nats-route://127.0.0.1:{route}"
                )
            (directory / "nats-cluster.conf").write_text(cluster)
            procs[host] = _start_nats(
                directory / "nats-cluster.conf", {"NATS_SERVER_NAME": f"nats-{i + 1}"}, port
            )
            urls.append(f"nats://127.0.0.1:{port}")
        settings = Settings(
            nats_url=",".join(urls), stream_replicas=3,
            nats_creds=str(tmp_path / "nats" / "auth" / creds.CONTROLPLANE_FILE),
        )  # fmt: skip
        nc = await bus.connect(settings)
        try:
            js = nc.jetstream()
            deadline = time.monotonic() + 30
            while True:  # the cluster elects its meta leader first (until then: no answer)
                try:
                    await bus.ensure_stream(js, settings)
                    await bus.ensure_command_stream(js, settings)
                    break
                except nats.errors.Error:
                    assert time.monotonic() < deadline, "the cluster never took the streams"
                    await asyncio.sleep(0.2)
            for stream in (settings.stream, settings.command_stream):
                info = await js.stream_info(stream)
                assert info.config.num_replicas == 3 and info.cluster is not None
                assert len(info.cluster.replicas or []) == 2
            leader = (await js.stream_info(settings.stream)).cluster.leader  # type: ignore[union-attr]
            varz = await asyncio.to_thread(
                urllib.request.urlopen, f"http://127.0.0.1:{monitors['nats']}/varz"
            )
            with varz:
                assert json.load(varz)["cluster"]["name"] == "elastic"
            procs[hosts[int(str(leader).rsplit("-", 1)[1]) - 1]].kill()
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                    info = await js.stream_info(settings.stream)
                    if info.cluster is not None and info.cluster.leader not in (None, leader):
                        break
                assert time.monotonic() < deadline, f"no new leader after {leader} was killed"
                await asyncio.sleep(0.2)
        finally:
            await nc.close()
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


@pytest.mark.services
@pytest.mark.timeout(90)
async def test_nats_roles_let_each_side_do_its_part(nats_with_roles: tuple[str, Path]) -> None:
    import nats
    import nats.errors
    import nkeys

    from controlplane import bus, creds
    from rank_runtime.client import EventClient
    from rank_runtime.identity import Identity
    from schemas.commands import Stop
    from schemas.common import Role
    from schemas.creds import nkey_connect_options
    from schemas.subjects import MSG_ID_HEADER

    url, directory = nats_with_roles
    job = JOB
    settings = Settings(nats_url=url, nats_creds=str(directory / creds.CONTROLPLANE_FILE))
    nc = await bus.connect(settings)
    member: EventClient | None = None
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js, settings)
        await bus.ensure_command_stream(js, settings)

        # A member publishes its events and follows its job's commands.
        member_seed = directory / job / "node0" / "member.nk"
        identity = Identity(
            job, "node0", "rack0", "w0", Role.WORKER, url, nats_creds=str(member_seed)
        )
        member = EventClient(identity).start()
        member.publish("member.heartbeat", {"step": 0, "phase": "init"})
        deadline = time.monotonic() + 20
        while member.stats.acked < 1:
            assert time.monotonic() < deadline, f"the event was not acknowledged: {member.stats}"
            await asyncio.sleep(0.05)

        # The control plane pulls it through its durable consumer and acknowledges it.
        consumer = bus.EventConsumer(nc, settings)
        got: list[bus.Delivery] = []
        while not got:
            assert time.monotonic() < deadline, "the control plane received nothing"
            got = await consumer.fetch(10, 1.0)
        assert got[0].subject == event_subject(job, "node0", "w0", "member.heartbeat")
        assert await consumer.ack_through(got[-1], consumer.epoch)

        # It publishes a command; the member receives it.
        stop = Stop(
            command_id=uuid.uuid4(),
            job_id=job,
            decision_position=1,
            issued_at=datetime.now(UTC),
            reason="test",
        )
        await js.publish(
            command_subject(job),
            stop.model_dump_json().encode(),
            headers={MSG_ID_HEADER: str(stop.command_id)},
        )
        received = await asyncio.to_thread(member.next_command, 20.0)
        assert isinstance(received, Stop) and received.command_id == stop.command_id

        # What each side must not do.
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await js.publish(
                event_subject(job, "node0", "w0", "member.heartbeat"), b"{}", timeout=1
            )
        launcher_seed = directory / job / "node0" / "launcher.nk"
        options = nkey_connect_options(launcher_seed)
        assert options is not None
        trainer = await nats.connect(url, **options)
        try:
            tjs = trainer.jetstream()
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await tjs.publish(command_subject(job), b"{}", timeout=1)
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await tjs.stream_info(settings.stream, subjects_filter=None)
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await tjs.publish(
                    event_subject(job, "node1", "w1", "member.exited"), b"{}", timeout=1
                )
            ack = await tjs.publish(
                event_subject(job, "node0", "launcher", "member.exited"), b"{}", timeout=5
            )
            assert ack.stream == settings.stream
        finally:
            await trainer.close()
        # A user of the old configuration, a key the server does not know, and a client
        # without credentials are refused. Raw protocol: a failed nats-py connect leaks its
        # socket.
        stranger = nkeys.from_seed(
            bytearray(creds.node_seed(os.urandom(32), job, "node0", "member"))
        )
        host, port = url.removeprefix("nats://").split(":")
        for connect in (
            {"user": "trainer", "pass": "trainer-local"},
            {"nkey": stranger.public_key.decode(), "sig": None},
            {},
        ):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                info = json.loads((await reader.readline()).split(b" ", 1)[1])
                if "nkey" in connect:
                    import base64

                    signed = stranger.sign(info["nonce"].encode())
                    connect["sig"] = base64.urlsafe_b64encode(signed).decode().rstrip("=")
                hello = {**connect, "verbose": False, "pedantic": False}
                writer.write(f"CONNECT {json.dumps(hello)}\r\nPING\r\n".encode())
                await writer.drain()
                answer = await asyncio.wait_for(reader.readline(), 10)
                assert b"Authorization Violation" in answer, (hello, answer)
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
    finally:
        if member is not None:
            member.close(flush_s=0.5)
        await nc.close()


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--bogus"],
        ["api", "--port", "99999"],
        ["run", "--nproc", "0", "examples/train.py"],
        ["run", "--nproc", "2", "examples/train.py", "--no-such-option"],
        ["run", "--nproc", "2", "--fault", "explode@3", "examples/train.py"],
        ["run", "--nproc", "2", "--policy", "backup_interval=0", "examples/train.py"],
        ["run", "--nproc", "2", "examples/missing.py"],
    ],
)
def test_the_command_check_refuses_what_elasticctl_refuses(argv: list[str]) -> None:
    with pytest.raises((pytest.fail.Exception, AssertionError, ValueError)):
        check_cli(argv, argv[0])
