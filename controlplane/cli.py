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


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def run(
    ctx: typer.Context,
    script: Annotated[str, typer.Argument(help="The training script (its arguments follow).")],
    *,
    nproc: Annotated[int, typer.Option(min=1, help="Workers to start (the world size).")] = 1,
    spares: Annotated[int, typer.Option(min=0, help="Warm spares to keep ready.")] = 0,
    nodes: Annotated[int, typer.Option(min=1, help="Pretend nodes to lay members over.")] = 1,
    racks: Annotated[int, typer.Option(min=1, help="Racks the nodes are spread over.")] = 1,
    job_id: Annotated[str | None, typer.Option(help="Job id (default: a fresh one).")] = None,
    fault: Annotated[
        list[str] | None,
        typer.Option(
            help="crash@STEP:rank=R, hang@STEP:rank=R, slow@STEP:rank=R:SECONDS or"
            " random:every=SECONDS[:seed=N]; repeatable."
        ),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(help="Policy as key=value,... (e.g. backup_interval=5,redundancy=2)."),
    ] = None,
) -> None:
    """Launch a training script's members on this machine and report what happens to them.

    Each member runs SCRIPT with ELASTIC_JOB_ID, ELASTIC_NODE, ELASTIC_RACK, ELASTIC_MEMBER,
    ELASTIC_ROLE, ELASTIC_NATS_URL and ELASTIC_POLICY set; the script uses rank_runtime.Elastic.
    Every exit is reported to the control plane at once. Exits 0 when every member the
    launcher did not kill itself exited 0.
    """
    from rank_runtime import launcher
    from rank_runtime.faults import FaultSpecError
    from schemas.events import JobPolicy

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    settings = _settings()
    try:
        launcher.script_path(script)
        values = _policy_values(policy) if policy else {}
        values.setdefault("world_size", nproc)
        min_world = values.get("min_world", 1)
        values.setdefault("max_world", max(nproc, min_world if isinstance(min_world, int) else 1))
        job_policy = JobPolicy.model_validate(values, strict=False)
        result = launcher.run(
            [script, *ctx.args],
            nproc=nproc,
            spares=spares,
            nodes=nodes,
            racks=racks,
            job_id=job_id,
            nats_url=settings.nats_url,
            policy=job_policy,
            fault_specs=fault or [],
        )
    except (FaultSpecError, FileNotFoundError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    typer.echo(json.dumps({"job_id": result.job_id, "exits": result.exits,
                           "killed": result.killed}))  # fmt: skip
    if not result.ok:
        raise typer.Exit(1)


def _policy_values(text: str) -> dict[str, object]:
    """``a=1,b=2.5`` -> {"a": 1, "b": 2.5}; JSON values (objects too) are accepted."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in parts)):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"policy entry {part!r}: expected key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


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


@bench_app.command("backup")
def bench_backup(
    *,
    params_mb: Annotated[
        float, typer.Option("--params-mb", min=0.01, help="Model parameters, in MiB.")
    ] = 4.0,
    steps: Annotated[int, typer.Option(min=1, help="Training steps timed per variant.")] = 1000,
    every: Annotated[int, typer.Option(min=1, help="Steps between two snapshots.")] = 10,
    batch: Annotated[int, typer.Option(min=1, help="Samples per step.")] = 64,
    replicas: Annotated[
        int,
        typer.Option(
            min=0, help="Checksum and stream each snapshot this many times in the background."
        ),
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Measure what a hot snapshot every N steps costs a training loop, and its copy speed.

    A small MLP trains with Adam on synthetic data (one CPU thread; on the GPU when there is
    one, snapshotting into pinned memory). Reports the step time with and without snapshots,
    their ratio, and the snapshot's throughput against a plain tensor copy of the same bytes.
    """
    from rank_runtime.bench_backup import run_backup_bench

    result = run_backup_bench(
        params_mb=params_mb,
        steps=steps,
        every=every,
        batch=batch,
        replicas=replicas,
        progress=not as_json,
    )
    typer.echo(json.dumps(result))


def main() -> None:
    """Entry point of the ``elasticctl`` script."""
    app()
