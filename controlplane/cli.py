"""``elasticctl``: the control plane's command line."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from controlplane.errors import ControlPlaneError, SchemaNotMigrated
from controlplane.settings import Settings

app = typer.Typer(
    help="Control plane for fault-tolerant, elastic PyTorch training.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
schemas_app = typer.Typer(help="The wire contracts (events, commands).", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks; each prints one JSON object.", no_args_is_help=True)
app.add_typer(schemas_app, name="schemas")
app.add_typer(bench_app, name="bench")


def _settings() -> Settings:
    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return settings


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"elasticctl: {message}", err=True)
    return typer.Exit(code)


@app.command()
def migrate(
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Create or upgrade the PostgreSQL schema (ELASTIC_DATABASE_URL)."""
    from controlplane.store import migrate as migrations
    from controlplane.store.postgres import make_engine

    settings = _settings()
    engine = make_engine(settings.database_url, pool_size=1)
    try:
        before = migrations.current_revision(engine)
        after = migrations.upgrade(engine)
    except Exception as exc:
        raise _fail(f"migration failed: {exc}") from exc
    finally:
        engine.dispose()
    if as_json:
        typer.echo(json.dumps({"from": before, "to": after}))
    else:
        typer.echo(f"database at revision {after} (was {before or 'empty'})")


@app.command()
def serve() -> None:
    """Run the control plane: ingest events from NATS into PostgreSQL and fold job views.

    Reads ELASTIC_NATS_URL, ELASTIC_DATABASE_URL and the other ELASTIC_* settings
    (see README). Waits for NATS and PostgreSQL while they are down; stops on SIGINT/SIGTERM.
    """
    from controlplane.app import serve as run

    settings = _settings()
    try:
        run(settings)
    except SchemaNotMigrated as exc:
        raise _fail(str(exc)) from exc
    except ControlPlaneError as exc:
        raise _fail(str(exc), 1) from exc


@schemas_app.command("export")
def schemas_export(
    directory: Annotated[Path, typer.Argument(help="Directory to write *.schema.json into.")],
) -> None:
    """Write the JSON Schema of every event and command."""
    from schemas.export import export_json_schemas

    for path in export_json_schemas(directory):
        typer.echo(str(path))


@bench_app.command("ingest")
def bench_ingest(
    events: Annotated[int, typer.Option(min=1, help="Events to publish.")] = 200_000,
    members: Annotated[int, typer.Option(min=1, help="Publishing members (sources).")] = 64,
    prefill: Annotated[
        bool,
        typer.Option(
            "--prefill",
            help="Publish everything first, then time the control plane draining the stream.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Publish events through NATS into PostgreSQL and measure throughput, loss and duplicates.

    Uses ELASTIC_NATS_URL / ELASTIC_DATABASE_URL when set (the database must be migrated and
    is written to); otherwise starts embedded NATS and PostgreSQL in a temporary directory.
    """
    from controlplane.bench.ingest import run_ingest_bench

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = run_ingest_bench(events=events, members=members, prefill=prefill, progress=not as_json)
    typer.echo(json.dumps(result))


@bench_app.command("decide")
def bench_decide(
    members: Annotated[int, typer.Option(min=2, help="Members heartbeating at 1 Hz.")] = 4096,
    faults: Annotated[
        int, typer.Option(min=1, help="Faults to inject, alternating crash and hang.")
    ] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Measure fault-to-decision latency through the real service.

    Members heartbeat at 1 Hz through NATS into a control plane process; crashes (an exit
    reported) and hangs (heartbeats stop) alternate. Latency runs from the exit report, or
    the heartbeat timeout's expiry, to the commit of the decision. Uses ELASTIC_NATS_URL /
    ELASTIC_DATABASE_URL when set; otherwise embedded NATS and PostgreSQL in a temp dir.
    """
    from controlplane.bench.decide import run_decide_bench

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = run_decide_bench(members=members, faults=faults, progress=not as_json)
    typer.echo(json.dumps(result))


def main() -> None:
    """Entry point of the ``elasticctl`` script."""
    app()
