"""Settings, read from ``ELASTIC_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "ELASTIC_"
NATS_URL_ENV = "ELASTIC_NATS_URL"
DATABASE_URL_ENV = "ELASTIC_DATABASE_URL"


class Settings(BaseSettings):
    """Every setting of the control plane; each field is ``ELASTIC_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    nats_url: str = Field(
        "nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated"
    )
    nats_user: str | None = Field(None, description="NATS user (with ELASTIC_NATS_PASSWORD)")
    nats_password: str | None = Field(None, description="NATS password", repr=False)
    nats_creds: str | None = Field(None, description="Path of a NATS .creds file")
    database_url: str = Field(
        "postgresql://postgres@127.0.0.1:5432/postgres",
        description="PostgreSQL URL (postgresql://...; SQLAlchemy's +psycopg is added)",
    )
    stream: str = Field("ELASTIC_EVENTS", description="JetStream stream holding events")
    stream_max_age_s: PositiveFloat = Field(
        7 * 24 * 3600.0, description="How long the stream keeps events (Postgres keeps them all)"
    )
    stream_duplicate_window_s: PositiveFloat = Field(
        120.0, description="JetStream de-duplication window by Nats-Msg-Id"
    )
    stream_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="Nodes that keep each of the events and commands streams (JetStream"
        " replicas; an existing stream is brought to it): 1 on one server, 3 on a three-node"
        " cluster, which loses no acknowledged event and goes on with a node down",
    )
    ingest_durable: str = Field("controlplane-ingest", description="Durable pull consumer name")
    ingest_batch: PositiveInt = Field(
        10_000, description="Most messages fetched from JetStream in one batch"
    )
    ingest_part: PositiveInt = Field(
        512,
        description="Most messages appended in one transaction: a fetched batch is appended,"
        " folded and acknowledged in parts of this many, and the decider's turn (a deadline,"
        " a fault) waits for at most one part",
    )
    ingest_fetch_timeout_s: PositiveFloat = Field(
        0.5, description="Longest wait for a batch to fill before committing what arrived"
    )
    ingest_ack_wait_s: PositiveFloat = Field(
        30.0, description="Unacked messages are redelivered after this many seconds"
    )
    ingest_max_ack_pending: PositiveInt = Field(
        50_000, description="Messages in flight to the ingest before the server holds back"
    )
    retry_max_s: PositiveFloat = Field(
        5.0, description="Longest back-off between retries while NATS or Postgres is down"
    )
    lock_retry_s: PositiveFloat = Field(
        1.0,
        description="How long a standby waits inside PostgreSQL for the ingest lock before it"
        " looks again (it takes the lock the moment it is free), and how often the holder"
        " checks it",
    )
    command_stream: str = Field("ELASTIC_COMMANDS", description="JetStream stream of commands")
    command_history: PositiveInt = Field(
        16, description="Commands kept per subject in the command stream"
    )
    command_retry_s: PositiveFloat = Field(
        2.0, description="A command still owed (not acked by every member) is re-sent this often"
    )
    decide_interval_s: PositiveFloat = Field(
        0.5, description="Longest time between two decider turns (deadlines wake it sooner)"
    )
    snapshot_interval_s: NonNegativeFloat = Field(
        120.0,
        description="How often the leader records the job views it holds while the log grows,"
        " so that a restart or a standby starts from them and folds only the log after (0: never)",
    )
    retention_days: NonNegativeFloat = Field(
        30.0,
        description="`elasticctl retention` drops step records and interval liveness summaries"
        " older than this many days, a span of the log at a time; decisions, faults, incidents,"
        " backup catalogs and the summaries decisions read are kept (0: drop nothing)",
    )
    rendezvous: bool = Field(
        True, description="Host the ranks' rendezvous store in the control plane"
    )
    rendezvous_host: str = Field(
        "127.0.0.1", description="Address ranks use to reach the rendezvous store"
    )
    rendezvous_listen: str | None = Field(
        None,
        description="Address the rendezvous store listens on (unset: ELASTIC_RENDEZVOUS_HOST's;"
        " 0.0.0.0: every interface)",
    )
    rendezvous_port: int = Field(
        29400, ge=0, le=65535, description="Port of the rendezvous store (0: any free port)"
    )
    rendezvous_max_keys: PositiveInt = Field(
        100_000, description="Most keys one job may hold in the rendezvous store"
    )
    rendezvous_max_bytes: PositiveInt = Field(
        64 << 20, description="Most bytes (keys and values) one job may hold in the store"
    )
    tls_cert: str | None = Field(
        None,
        description="PEM certificate (chain) the rendezvous store serves TLS with; its"
        " endpoints become tls://... (members verify it against ELASTIC_TLS_CA)",
    )
    tls_key: str | None = Field(None, description="PEM private key of ELASTIC_TLS_CERT")
    secret: SecretStr | None = Field(
        None,
        description="Installation secret (hex, at least 32 bytes): authenticates the"
        " rendezvous store and signs commands; unset: neither (a warning is logged)",
    )
    log_level: str = Field("INFO", description="Python logging level")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log records as text lines, or as JSON objects one a line (time, level,"
        " logger, message, and the job, member and incident a record concerns)",
    )
    api_host: str = Field("127.0.0.1", description="Address `elasticctl api` listens on")
    api_port: int = Field(8080, ge=0, le=65535, description="Port `elasticctl api` listens on")
    api_tokens: SecretStr | None = Field(
        None,
        description="Bearer tokens of the REST API and of /metrics, as TOKEN:SCOPE[+SCOPE...]"
        " entries separated by commas (scope `read` reads); unset: no authentication",
    )
    api_hot_routes: bool = Field(
        True,
        description="Answer the timeline and plain event pages before FastAPI's routing (the"
        " same answers, a fraction of the cost: docs/benchmarks.md); false: FastAPI answers all",
    )
    api_refresh_s: NonNegativeFloat = Field(
        0.05, description="Longest the API answers from its job views before checking the log"
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address the control plane's Prometheus exporter listens on"
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of the control plane's Prometheus exporter (0: off)"
    )
    control_fault: str | None = Field(
        None,
        pattern=r"^(exit-after-(record|publish):[1-9][0-9]{0,8})?$",
        description="Fault injection, for chaos runs and tests only: `exit-after-record:G` exits"
        " the process (no clean-up, as a kill would) once it has recorded the decision that"
        " starts generation G, before its commands are published; `exit-after-publish:G` once"
        " JetStream has acknowledged those commands, before the members ack them; unset or"
        " empty: none",
    )


def master_secret(settings: Settings) -> bytes | None:
    """The installation secret's bytes (None when unset); SecretError when it is not one."""
    from schemas.auth import MASTER_SECRET_ENV, parse_secret

    if settings.secret is None or not settings.secret.get_secret_value().strip():
        return None
    return parse_secret(settings.secret.get_secret_value(), what=MASTER_SECRET_ENV)


def sqlalchemy_url(database_url: str) -> str:
    """Return a SQLAlchemy URL that selects the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if database_url.startswith(prefix):
            return "postgresql+psycopg://" + database_url[len(prefix) :]
    return database_url


def libpq_url(database_url: str) -> str:
    """Return a URL psycopg/libpq accept (no SQLAlchemy driver suffix)."""
    if database_url.startswith("postgresql+psycopg://"):
        return "postgresql://" + database_url[len("postgresql+psycopg://") :]
    return database_url


# --- The settings reference (docs/settings.md) -------------------------------------------------

#: The command that writes docs/settings.md (tests/unit/test_settings_doc.py names it).
REGENERATE = "elasticctl settings --markdown > docs/settings.md"
#: Packages whose module-level ``*_ENV`` constants are the variables a training process, its
#: launcher and ``elasticctl creds`` read (the control plane's are the fields of ``Settings``).
MEMBER_PACKAGES = ("rank_runtime", "schemas")


@dataclass(frozen=True, slots=True)
class EnvVariable:
    """One ``ELASTIC_*`` variable named by a ``*_ENV`` constant, with its ``#:`` comment."""

    name: str
    module: str
    constant: str
    description: str


def _type_name(annotation: Any) -> str:
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if get_origin(annotation) is Literal:
        return " or ".join(f"`{value}`" for value in get_args(annotation))
    args = [a for a in get_args(annotation) if a is not type(None)]
    if args and len(args) < len(get_args(annotation)):
        return _type_name(args[0])
    if annotation is SecretStr:
        return "secret string"
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(metadata: list[Any]) -> str:
    marks = []
    for item in metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            value = getattr(item, attr, None)
            if value is not None:
                marks.append(f"{sign} {value}")
    return ", ".join(marks)


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and float(f"{value:g}") == value:
        return f"`{value:g}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("``", "`").replace("|", "\\|")


def env_variables(packages: tuple[str, ...] = MEMBER_PACKAGES) -> list[EnvVariable]:
    """Every module-level ``NAME_ENV = "ELASTIC_..."`` of ``packages``, read from the source.

    The description is the ``#:`` comment right above the constant; a constant without one
    that directly follows another (no blank line) shares that one's (``TLS_CERT_ENV`` and
    ``TLS_KEY_ENV``). The modules are parsed, not imported (no torch at start-up).
    """
    found: list[EnvVariable] = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        locations = spec.submodule_search_locations if spec is not None else None
        if not locations:
            raise LookupError(f"package {package!r} not found")
        for path in sorted(Path(next(iter(locations))).glob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()
            previous: tuple[int, str] | None = None
            for node in ast.parse("\n".join(lines)).body:
                if not (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id.endswith("_ENV")
                    and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)
                    and node.value.value.startswith(ENV_PREFIX)
                ):
                    continue
                comment: list[str] = []
                row = node.lineno - 2
                while row >= 0 and lines[row].lstrip().startswith("#:"):
                    comment.insert(0, lines[row].lstrip()[2:].strip())
                    row -= 1
                description = " ".join(comment)
                if not description and previous is not None and previous[0] == node.lineno - 1:
                    description = previous[1]
                previous = (node.end_lineno or node.lineno, description)
                found.append(
                    EnvVariable(
                        name=node.value.value,
                        module=f"{package}.{path.stem}",
                        constant=node.targets[0].id,
                        description=description,
                    )
                )
    return found


def settings_markdown() -> str:
    """docs/settings.md: every control-plane setting and every variable of the rank runtime.

    Generated from ``Settings``' fields (type, bounds, default, description) and the ``*_ENV``
    constants of ``MEMBER_PACKAGES`` with their ``#:`` comments (``env_variables``).
    """
    out = [
        "# Settings",
        "",
        "<!-- Generated from the code; do not edit by hand. Regenerate it with",
        f"     {REGENERATE}",
        "     (tests/unit/test_settings_doc.py fails when this file differs from the output). -->",
        "",
        "Every setting is an environment variable. `elasticctl settings` prints the values the",
        "current environment gives the control plane (secrets hidden).",
        "",
        "## The control plane",
        "",
        "Read by `elasticctl serve`, `api`, `migrate`, `creds`, `demo` and the benchmarks, from",
        f"the fields of `controlplane.settings.Settings`: each field `name` is `{ENV_PREFIX}NAME`.",
        "A value that does not parse, or is out of bounds, stops the command with the reason.",
        "",
        "| variable | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, field in Settings.model_fields.items():
        kind = _type_name(field.annotation)
        bounds = _bounds(field.metadata)
        if bounds:
            kind = f"{kind} ({bounds})"
        if field.repr is False or field.annotation in (SecretStr, SecretStr | None):
            kind = f"{kind}, hidden in `repr`"
        out.append(
            f"| `{ENV_PREFIX}{name.upper()}` | {kind} | {_default(field.default)}"
            f" | {_cell(field.description or '')} |"
        )
    variables = env_variables()
    by_name: dict[str, list[EnvVariable]] = {}
    for variable in variables:
        by_name.setdefault(variable.name, []).append(variable)
    out += [
        "",
        "## Training processes, the launcher and `elasticctl creds`",
        "",
        "Read by the rank runtime (`rank_runtime/`) and the code both sides share (`schemas/`):",
        "the module-level `*_ENV` constants there, with their `#:` comments. `elasticctl run`",
        "sets a member's identity and credentials; set them yourself to start members another",
        "way. Command-line options (`elasticctl run --help`) are not repeated here.",
        "",
        "| variable | read in | meaning |",
        "| --- | --- | --- |",
    ]
    for name in sorted(by_name):
        entries = by_name[name]
        modules = ", ".join(f"`{v.module}`" for v in entries)
        descriptions = list(dict.fromkeys(v.description for v in entries))
        if len(descriptions) == 1:
            meaning = descriptions[0]
        else:
            meaning = " ".join(f"{v.module}: {v.description}" for v in entries)
        out.append(f"| `{name}` | {modules} | {_cell(meaning)} |")
    return "\n".join(out) + "\n"
