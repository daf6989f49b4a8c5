"""Settings, read from ``ELASTIC_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

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
    ingest_durable: str = Field("controlplane-ingest", description="Durable pull consumer name")
    ingest_batch: PositiveInt = Field(
        10_000, description="Most messages fetched and committed in one batch"
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
        1.0, description="How often a standby tries the ingest lock, and the holder checks it"
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
    api_host: str = Field("127.0.0.1", description="Address `elasticctl api` listens on")
    api_port: int = Field(8080, ge=0, le=65535, description="Port `elasticctl api` listens on")
    api_tokens: SecretStr | None = Field(
        None,
        description="Bearer tokens of the REST API and of /metrics, as TOKEN:SCOPE[+SCOPE...]"
        " entries separated by commas (scope `read` reads); unset: no authentication",
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
