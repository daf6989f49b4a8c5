"""``elasticctl``: the control plane's command line."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controlplane.errors import ControlPlaneError, SchemaNotMigrated
from rank_runtime.launcher_cli import RUN_CONTEXT
from rank_runtime.launcher_cli import run as launcher_run
from schemas import logjson

if TYPE_CHECKING:
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
#: ``elasticctl run``: the launcher's command (``elastic-run``; rank_runtime/launcher_cli.py).
app.command("run", context_settings=RUN_CONTEXT)(launcher_run)


def _settings() -> Settings:
    from controlplane.settings import Settings

    settings = Settings()
    logjson.configure(settings.log_level, settings.log_format)
    return settings


def _log_warnings() -> None:
    """Log warnings and above to stderr, as ``ELASTIC_LOG_FORMAT`` says (text by default)."""
    logjson.configure(logging.WARNING, logjson.env_format(), text_format=logging.BASIC_FORMAT)


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
    (`elasticctl settings`; docs/settings.md). Waits for NATS and PostgreSQL while they are
    down; stops on SIGINT/SIGTERM.
    """
    from controlplane.app import serve as run

    settings = _settings()
    try:
        run(settings)
    except SchemaNotMigrated as exc:
        raise _fail(str(exc)) from exc
    except ControlPlaneError as exc:
        raise _fail(str(exc), 1) from exc


@app.command()
def api(
    host: Annotated[
        str | None, typer.Option(help="Address to listen on (default: ELASTIC_API_HOST).")
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, help="Port to listen on (default: ELASTIC_API_PORT)."),
    ] = None,
) -> None:
    """Serve the read-only REST API (/api/v1, /healthz, /metrics) over the PostgreSQL log.

    Reads ELASTIC_DATABASE_URL; ELASTIC_API_TOKENS (TOKEN:SCOPE[+SCOPE...], comma-separated)
    requires bearer tokens with the `read` scope. The OpenAPI document is at /openapi.json.
    """
    import uvicorn

    from controlplane.api import create_app
    from controlplane.api.auth import TokenSpecError

    settings = _settings()
    try:
        application = create_app(settings)
    except TokenSpecError as exc:
        raise _fail(str(exc)) from exc
    uvicorn.run(
        application,
        host=host if host is not None else settings.api_host,
        port=port if port is not None else settings.api_port,
        log_level=settings.log_level.lower(),
        access_log=False,
    )


@app.command()
def creds(
    job: Annotated[str, typer.Option(help="The job the nodes train (its id).")],
    out: Annotated[Path, typer.Option(help="Directory to write the credentials into.")],
    node: Annotated[
        list[str] | None, typer.Option(help="A node of the job (repeat it for each node).")
    ] = None,
    nodes: Annotated[
        int, typer.Option(min=0, help="Or: pretend nodes node0..nodeN-1 (`run --nodes N`).")
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Issue per-node NATS credentials (NKeys) from the installation secret, ELASTIC_SECRET.

    For each node of the job two NKey seeds: OUT/JOB/NODE/launcher.nk (the node's launcher:
    may publish elastic.evt.JOB.NODE.launcher.TYPE) and OUT/JOB/NODE/member.nk (its members:
    elastic.evt.JOB.NODE.member.TYPE), TYPE each member event type, one literal subject each
    (the server refuses any other), and their heartbeats on elastic.hb.JOB.NODE.launcher and
    elastic.hb.JOB.NODE.member. Both read only JOB's commands and
    receive only on an inbox of their own. Also OUT/controlplane.nk (ELASTIC_NATS_CREDS of
    `elasticctl serve`: the only one that reads events), OUT/JOB/job-secret and
    OUT/JOB/command-key (what the launcher hands its members), and OUT/nats-users.conf: the
    NATS server's users for every job issued into OUT (public keys only), to include in the
    `authorization` block of nats.conf. After adding a job: `nats-server --signal reload`.

    Give the launcher `ELASTIC_NATS_CREDS_DIR=OUT` (a real node needs only its own NODE
    directory and the job's two files). The same secret always gives the same credentials.
    """
    from controlplane import creds as credentials
    from schemas.auth import MASTER_SECRET_ENV, SecretError, parse_secret
    from schemas.creds import CredentialsError

    settings = _settings()
    text = os.environ.get(MASTER_SECRET_ENV)
    if not text:
        raise _fail(f"{MASTER_SECRET_ENV} is not set (e.g. `openssl rand -hex 32`)")
    names = list(node or []) + [f"node{j}" for j in range(nodes)]
    if not names:
        raise _fail("name the job's nodes: --node NODE (repeated) or --nodes N")
    try:
        issued = credentials.issue(
            parse_secret(text),
            out,
            job,
            names,
            events_stream=settings.stream,
            command_stream=settings.command_stream,
        )
    except (SecretError, CredentialsError) as exc:
        raise _fail(str(exc)) from exc
    result = {
        "job": job,
        "controlplane": str(issued.controlplane),
        "nodes": {
            n: {"launcher": str(c.launcher), "member": str(c.member)}
            for n, c in issued.nodes.items()
        },
        "server_users": str(issued.users_file),
        "users": issued.users,
    }
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(
            f"issued {len(issued.nodes)} node(s) of {job} into {out}; {issued.users} NATS "
            f"users in {issued.users_file} (reload nats-server to apply)"
        )


@app.command("settings")
def settings_command(
    markdown: Annotated[
        bool,
        typer.Option(
            "--markdown",
            help="Print the reference of every variable instead (docs/settings.md is its output).",
        ),
    ] = False,
) -> None:
    """Show the control plane's settings (ELASTIC_* environment variables).

    Without --markdown: the values this environment gives, one ELASTIC_NAME=VALUE line each
    (an unset one and a secret that is set as comments; secrets are never printed). With
    --markdown: the reference of every setting (type, default, meaning) and of every variable
    a training process reads, generated from the code:
    `elasticctl settings --markdown > docs/settings.md`.
    """
    from pydantic import SecretStr, ValidationError

    from controlplane.settings import ENV_PREFIX, Settings, settings_markdown

    if markdown:
        typer.echo(settings_markdown(), nl=False)
        return
    try:
        settings = Settings()
    except ValidationError as exc:
        raise _fail(f"bad settings: {exc}") from exc
    for name, field in Settings.model_fields.items():
        variable, value = f"{ENV_PREFIX}{name.upper()}", getattr(settings, name)
        if value is None:
            typer.echo(f"# {variable} unset")
        elif isinstance(value, SecretStr) or field.repr is False:
            typer.echo(f"# {variable} set (hidden)")
        else:
            typer.echo(f"{variable}={str(value).lower() if isinstance(value, bool) else value}")


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

    _log_warnings()
    result = run_ingest_bench(events=events, members=members, prefill=prefill, progress=not as_json)
    typer.echo(json.dumps(result))


@bench_app.command("backlog")
def bench_backlog(
    ranks: Annotated[int, typer.Option(min=2, help="Ranks: reports in a backup.")] = 16384,
    backups: Annotated[int, typer.Option(min=1, help="Backups timed (medians).")] = 3,
    part: Annotated[
        int, typer.Option(min=1, help="Messages to a transaction (ELASTIC_INGEST_PART).")
    ] = 512,
    collect: Annotated[
        bool, typer.Option(help="The garbage collector on while the steps are timed.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """One backup of a large job through the ingest's own steps, each timed: decode,
    pre-encode, append into PostgreSQL, fold (embedded PostgreSQL unless
    ELASTIC_DATABASE_URL is set)."""
    from controlplane.bench.backlog import run_backlog_bench

    _log_warnings()
    typer.echo(
        json.dumps(run_backlog_bench(ranks=ranks, backups=backups, part=part, collect=collect))
    )


@bench_app.command("rows")
def bench_rows(
    seconds: Annotated[float, typer.Option(min=5, help="How long the job trains.")] = 60.0,
    nproc: Annotated[int, typer.Option(min=1, help="Ranks.")] = 4,
    policy: Annotated[
        str, typer.Option(help="The job's policy (as `elasticctl run --policy`).")
    ] = "heartbeat_interval_s=0.25,backup_interval=50",
) -> None:
    """Rows the log gets per rank per minute, by type, while the example trains (embedded
    NATS and PostgreSQL unless ELASTIC_NATS_URL / ELASTIC_DATABASE_URL are set)."""
    from controlplane.bench.rows import run_rows_bench

    _log_warnings()
    typer.echo(json.dumps(run_rows_bench(seconds=seconds, nproc=nproc, policy=policy)))


@bench_app.command("mttr")
def bench_mttr(
    *,
    faults: Annotated[
        int | None,
        typer.Option(min=1, help="Ranks to kill, one after another (mlp 5, transformer 3)."),
    ] = None,
    backup_interval: Annotated[
        int | None,
        typer.Option(
            min=2,
            help="Steps between hot backups (and baseline checkpoints): mlp 10, transformer 10.",
        ),
    ] = None,
    baseline: Annotated[
        bool,
        typer.Option(help="Also run the torchrun restart-all baseline (and the ratio); mlp only."),
    ] = True,
    example: Annotated[
        str,
        typer.Option(
            help="mlp (examples/train.py, DDP + ZeRO) or transformer (examples/transformer.py,"
            " FSDP2, 1.1 GB of parameters and AdamW state by default)."
        ),
    ] = "mlp",
    example_args: Annotated[
        str | None,
        typer.Option(
            help="The example's options, replacing the bench's (e.g. '--vocab 65536 --dim 64')."
        ),
    ] = None,
    security: Annotated[
        str,
        typer.Option(
            help="off, on (ELASTIC_SECRET: authenticated rendezvous, signed commands), or both:"
            " on and off alternating, with security_ratio (on over off)."
        ),
    ] = "off",
    rounds: Annotated[
        int, typer.Option(min=1, help="Elastic runs per security mode (alternating for both).")
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Mean time to recover from a killed rank: in-process recovery against restart-all.

    Trains EXAMPLE's model on 4 ranks and kills a rank FAULTS times. The elastic run
    recovers in-process (a warm spare per fault, a control plane process, NATS and
    PostgreSQL: ELASTIC_NATS_URL / ELASTIC_DATABASE_URL when set, else embedded); the
    baseline (mlp only) restarts every process under torchrun from torch.save checkpoints on
    disk. MTTR is the time from the kill to the first step completed after it; the JSON has
    each phase's median (phases_median_s) and the restore's rate (restore_gbps). Needs a
    source checkout (the examples directory). Takes a few minutes.
    """
    import shlex

    from controlplane.bench import BenchError
    from controlplane.bench.mttr import run_mttr_bench

    _log_warnings()
    progress = None if as_json else (lambda m: typer.echo(m, err=True))
    try:
        result = run_mttr_bench(
            faults=faults,
            backup_interval=backup_interval,
            baseline=baseline,
            security=security,
            rounds=rounds,
            example=example,
            example_args=None if example_args is None else shlex.split(example_args),
            progress=progress,
        )
    except BenchError as exc:
        raise _fail(str(exc), 1) from exc
    typer.echo(json.dumps(result))


@bench_app.command("fuzz")
def bench_fuzz(
    *,
    cases: Annotated[int, typer.Option(min=1, help="Fuzz cases to publish.")] = 100_000,
    seed: Annotated[int, typer.Option(help="Seed of the cases (same seed, same cases).")] = 0,
    ranks: Annotated[int, typer.Option(min=1, help="Ranks of the job training alongside.")] = 2,
    steps: Annotated[int, typer.Option(min=1, help="Steps of the job training alongside.")] = 300,
    timeout: Annotated[float, typer.Option(min=10, help="Give up after this many seconds.")] = 900,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Feed the real ingest hostile bytes while a real job trains; every case must end
    stored or dead-lettered.

    Starts `elasticctl serve` (its own process; NATS and PostgreSQL from ELASTIC_NATS_URL /
    ELASTIC_DATABASE_URL when set, else embedded) and a small job (`elasticctl run` of
    examples/train.py, RANKS ranks, STEPS steps). Once the job trains, publishes CASES
    messages over the raw NATS protocol to fuzz jobs of their own: valid member events and
    mutated ones (NUL and lone surrogates in any string, bytes that are not UTF-8, integers
    beyond int64, NaN and infinities, wrong types, truncated JSON, random bytes, subjects that
    contradict the envelope, forged types, implausible seqs, deep nesting, oversized).

    Prints JSON: cases (acknowledged by JetStream), stored, dead_lettered, unaccounted (must
    be 0), crashes (serve exited: must be 0), stalls (gaps over 2 s between commits while input
    flowed: must be 0), job_completed (must be true), and how the cases were made and refused.
    Exits 1 when one of those does not hold. Progress goes to stderr. Needs a source checkout.
    """
    from controlplane.bench import BenchError
    from controlplane.bench.fuzz import run_fuzz_bench

    _log_warnings()
    try:
        result = run_fuzz_bench(
            cases=cases,
            seed=seed,
            ranks=ranks,
            steps=steps,
            timeout_s=timeout,
            progress=lambda m: typer.echo(m, err=True),
        )
    except BenchError as exc:
        raise _fail(str(exc), 1) from exc
    typer.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))
    held = not (result["unaccounted"] or result["crashes"] or result["stalls"])
    if not held or not result["job_completed"]:
        raise typer.Exit(1)


@bench_app.command("decide")
def bench_decide(
    members: Annotated[int, typer.Option(min=2, help="Members heartbeating at 1 Hz.")] = 4096,
    faults: Annotated[
        int, typer.Option(min=1, help="Faults to inject, alternating crash and hang.")
    ] = 20,
    mesh: Annotated[
        str | None,
        typer.Option(
            help="The job's mesh, outermost first, e.g. dp=64,tp=8,pp=8 (tp node-local); its"
            " size must be --members. The decider then reasons in replicas."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Measure fault-to-decision latency through the real service.

    Members heartbeat at 1 Hz through NATS into a control plane process; crashes (an exit
    reported) and hangs (heartbeats stop) alternate. Latency runs from the exit report, or
    the heartbeat timeout's expiry, to the commit of the decision (command_*: to the command
    reaching the members). Uses ELASTIC_NATS_URL /
    ELASTIC_DATABASE_URL when set; otherwise embedded NATS and PostgreSQL in a temp dir.
    """
    from controlplane.bench.decide import parse_mesh, run_decide_bench

    parsed = None
    if mesh is not None:
        try:
            parsed = parse_mesh(mesh)
        except ValueError as exc:  # pydantic's ValidationError is one
            raise typer.BadParameter(str(exc), param_hint="--mesh") from exc
        if parsed.size != members:
            raise typer.BadParameter(
                f"the mesh {parsed.describe()} has {parsed.size} ranks; --members is {members}",
                param_hint="--mesh",
            )
    _log_warnings()
    result = run_decide_bench(members=members, faults=faults, progress=not as_json, mesh=parsed)
    typer.echo(json.dumps(result))


@bench_app.command("scale")
def bench_scale(
    *,
    ranks: Annotated[
        int, typer.Option(min=2, help="Simulated ranks (8 a node, 16 nodes a rack).")
    ] = 4096,
    seconds: Annotated[float, typer.Option(min=5.0, help="The window with faults.")] = 60.0,
    steady_seconds: Annotated[
        float, typer.Option(min=5.0, help="The window before, without faults (table growth).")
    ] = 30.0,
    faults: Annotated[
        int, typer.Option(min=1, help="Faults in the window, alternating crash and hang.")
    ] = 6,
    heartbeat_interval: Annotated[
        float, typer.Option(min=0.01, help="Each member's heartbeat interval, seconds.")
    ] = 0.25,
    hang_timeout: Annotated[
        float, typer.Option(min=0.02, help="The policy's heartbeat timeout in training, seconds.")
    ] = 0.75,
    backup_interval: Annotated[
        int, typer.Option(min=1, help="Steps (one a second) between backups.")
    ] = 10,
    heartbeats: Annotated[
        str,
        typer.Option(
            help="node: each node's launcher relays its members' heartbeats in one message an"
            " interval (as `elasticctl run` does); member: each member sends its own.",
        ),
    ] = "node",
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """The control plane at a job's size: hang detection, decisions, storage, CPU.

    Simulated members heartbeat on NATS core at --heartbeat-interval (relayed by each node's
    launcher with --heartbeats node, the default), rank 0 records a step a
    second, every rank backs up every --backup-interval steps; after --steady-seconds without
    faults, crashes and hangs are injected through the real service (a control plane
    process) for --seconds. Prints hang_detect_p50_s / _p99_s, decide_p50_ms / _p99_ms (to
    the decision's commit), db_bytes_per_rank_day (the tables' growth without faults),
    db_payload_bytes_per_fault, controlplane_cpu_cores, lost, duplicated. Uses ELASTIC_NATS_URL /
    ELASTIC_DATABASE_URL when set; otherwise embedded NATS and PostgreSQL in a temp dir.
    """
    from controlplane.bench.scale import BenchScaleError, run_scale_bench

    if heartbeats not in ("node", "member"):
        raise typer.BadParameter(
            f"{heartbeats!r}: expected node or member", param_hint="--heartbeats"
        )
    if hang_timeout <= heartbeat_interval:
        raise typer.BadParameter(
            f"{hang_timeout:g}s is not longer than the heartbeat interval"
            f" ({heartbeat_interval:g}s)",
            param_hint="--hang-timeout",
        )
    _log_warnings()
    try:
        result = run_scale_bench(
            ranks=ranks,
            seconds=seconds,
            steady_seconds=steady_seconds,
            faults=faults,
            heartbeat_interval_s=heartbeat_interval,
            hang_timeout_s=hang_timeout,
            backup_interval=backup_interval,
            heartbeats=heartbeats,
            progress=not as_json,
        )
    except BenchScaleError as exc:
        raise _fail(str(exc), 1) from exc
    typer.echo(json.dumps(result))


@bench_app.command("takeover")
def bench_takeover(
    *,
    ranks: Annotated[
        int, typer.Option(min=2, help="Simulated ranks of the running job (8 a node).")
    ] = 16_384,
    days: Annotated[
        float, typer.Option(min=0.0, help="Days of that job's log written first (the history).")
    ] = 30.0,
    history_rows: Annotated[
        int | None,
        typer.Option(
            min=0, help="Rows of history instead (default: what --days of the job writes)."
        ),
    ] = None,
    api_wait: Annotated[
        float, typer.Option(min=1.0, help="How long the API's cold start is waited for, seconds.")
    ] = 120.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """A standby taking over from a leader killed on a long log, and the API's cold start.

    Writes a history of as many rows as --days of a --ranks job writes (steps, backup
    catalogs, liveness summaries, each rank's recovery events at eight incidents a day) and
    what a leader would have recorded of it (the view snapshot, the steps chunks); then
    --ranks simulated members train against a leader with a standby beside it; the leader is
    killed (SIGKILL) and a member crashes at once. Prints takeover_decision_s (the kill to the
    standby's decision committed), standby_startup_s and what it started from,
    api_first_answer_s (a cold start of the API) and api_history_loss_s. Uses
    ELASTIC_NATS_URL / ELASTIC_DATABASE_URL when set; otherwise embedded NATS and PostgreSQL.
    """
    from controlplane.bench.takeover import BenchTakeoverError, run_takeover_bench

    if history_rows is not None and 0 < history_rows < 4:
        raise typer.BadParameter(f"{history_rows}: 0 or at least 4", param_hint="--history-rows")
    _log_warnings()
    try:
        result = run_takeover_bench(
            ranks=ranks, days=days, history_rows=history_rows, api_wait_s=api_wait,
            progress=not as_json,
        )  # fmt: skip
    except BenchTakeoverError as exc:
        raise _fail(str(exc), 1) from exc
    typer.echo(json.dumps(result))


@bench_app.command("api")
def bench_api(
    *,
    events: Annotated[
        int, typer.Option(min=1000, help="Events in the log of the 64-worker job.")
    ] = 1_000_000,
    ranks: Annotated[
        int | None,
        typer.Option(
            min=2,
            help="Serve instead the history of --days of a job of this many ranks (as bench"
            " takeover writes it, with its incidents and its view snapshot).",
        ),
    ] = None,
    days: Annotated[float, typer.Option(min=0.001, help="Days of history with --ranks.")] = 1.0,
    clients: Annotated[int, typer.Option(min=1, help="Concurrent clients.")] = 32,
    seconds: Annotated[float, typer.Option(min=1.0, help="Measured time per route.")] = 10.0,
    client: Annotated[
        str,
        typer.Option(help="raw (a minimal keep-alive HTTP/1.1 client) or httpx (asyncio)."),
    ] = "raw",
    compare_plain: Annotated[
        bool,
        typer.Option(
            "--compare-plain",
            help="Measure again without the hot routes (ELASTIC_API_HOT_ROUTES=false), on the"
            " same log: `plain` and `hot_routes_speedup` in the JSON.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Measure the REST API's latency on a big log (the timeline and events routes).

    The log: --events events of a job of 64 workers and spares that train, back up and
    recover from a crash now and then (decided by the real decider); or, with --ranks, the
    history of --days of a job of that many ranks (a step a second, catalogs, liveness
    summaries, each rank's recovery at eight incidents a day, decided by the real decider;
    as many rows as that job writes), with the view snapshot and steps chunks a leader
    would have recorded. Then `elasticctl api` starts as its own process (from the snapshot:
    cold_start_s), and CLIENTS concurrent clients call each route for SECONDS: a random
    incident's timeline; a page of events after a random cursor, some filtered by type or
    member. Prints p50/p99 per route, requests/s, the API's CPU per request, and the log's
    rows and bytes. Uses ELASTIC_DATABASE_URL when set (the database is migrated and
    written to); otherwise an embedded PostgreSQL.
    """
    from controlplane.bench import BenchError
    from controlplane.bench.api import run_api_bench

    _log_warnings()
    if client not in ("raw", "httpx"):
        raise _fail(f"--client must be raw or httpx, not {client!r}")
    try:
        result = run_api_bench(
            events=events, ranks=ranks, days=days, clients=clients, seconds=seconds,
            client=client, progress=not as_json, compare_plain=compare_plain,
        )  # fmt: skip
    except (BenchError, ValueError) as exc:
        raise _fail(str(exc), 1) from exc
    typer.echo(json.dumps(result))


@bench_app.command("backup")
def bench_backup(
    *,
    example: Annotated[
        str | None,
        typer.Option(
            help="ddp: examples/train.py's DDP + ZeRO split on --world gloo ranks (bytes sent"
            " per backup against the sizing formula); transformer: examples/tinygpt.py under"
            " FSDP2 (blocking_ms_per_gb, replication_gbps against tcp_loopback_gbps, overhead);"
            " mlp: one process, the overhead with and without security. Default: ddp, or mlp"
            " with --security."
        ),
    ] = None,
    params_mb: Annotated[
        float | None,
        typer.Option(
            "--params-mb",
            min=0.01,
            help="Model parameters, in MiB (default: ddp 4, transformer 100, mlp 4).",
        ),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option(
            min=1, help="Training steps timed (default: ddp 200, transformer 80, mlp 1000)."
        ),
    ] = None,
    every: Annotated[int, typer.Option(min=1, help="Steps between two backups.")] = 10,
    world: Annotated[int, typer.Option(min=2, help="Ranks of the ddp example.")] = 4,
    batch: Annotated[
        int | None,
        typer.Option(min=1, help="Samples per step (default: mlp 64, transformer 8 of 64 tokens)."),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Peers each backup is sent to (default: the policy's redundancy, 2; mlp: 0,"
            " or 2 with --security).",
        ),
    ] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Transfers timed per path (transformer).")] = 5,
    security: Annotated[
        str | None,
        typer.Option(
            help="mlp: replicate without the job's secret (off), with it (on: sha256 digests"
            " and MACs), or both in one run (both: overhead_off, overhead_on, within_10pct)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Measure what backups cost: bytes sent to peers, memory, step time, transfer speed.

    Each example backs up as a training job's Session does: what only a rank has goes to its
    peers, what every rank has alike (a DDP model) stays in its own memory. See
    docs/benchmarks.md and docs/operations.md ("Sizing backup memory").
    """
    from rank_runtime.bench_backup import run_backup_bench

    try:
        result = run_backup_bench(
            example=example,
            params_mb=params_mb,
            steps=steps,
            every=every,
            batch=batch,
            replicas=replicas,
            world=world,
            rounds=rounds,
            security=security,
            progress=not as_json,
        )
    except ValueError as exc:
        raise _fail(str(exc), 2) from exc
    typer.echo(json.dumps(result))


@app.command()
def demo(
    *,
    steps: Annotated[int, typer.Option(min=2, help="Training steps.")] = 80,
    backup_interval: Annotated[
        int, typer.Option(min=1, help="Steps between two hot backups.")
    ] = 10,
    crash_at: Annotated[
        int, typer.Option(min=0, help="Step after which a rank is killed (SIGKILL); 0: none.")
    ] = 25,
    crash_rank: Annotated[int, typer.Option(min=0, help="The rank that crashes.")] = 1,
    hang_at: Annotated[
        int, typer.Option(min=0, help="Step after which a rank hangs (SIGSTOP); 0: none.")
    ] = 55,
    hang_rank: Annotated[int, typer.Option(min=0, help="The rank that hangs.")] = 2,
    nan_at: Annotated[
        int,
        typer.Option(
            min=0,
            help="Step whose loss turns NaN on a rank (a loss anomaly: the world rolls back to"
            " the backup before it and skips the step's batch; the reference skips it too);"
            " 0: none.",
        ),
    ] = 0,
    nan_rank: Annotated[int, typer.Option(min=0, help="The rank whose loss turns NaN.")] = 1,
    nproc: Annotated[int, typer.Option(min=1, help="Ranks (the world size).")] = 4,
    spares: Annotated[int, typer.Option(min=0, help="Warm spares.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the model and the data.")] = 0,
    heartbeat_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds of heartbeat silence that make a hang.")
    ] = 5.0,
    timeout: Annotated[
        float, typer.Option(min=1, help="Longest wait (s) for a training run to finish.")
    ] = 300.0,
    start_timeout: Annotated[
        float, typer.Option(min=1, help="Longest wait (s) for services to come up.")
    ] = 60.0,
    reference: Annotated[
        bool, typer.Option(help="Run the fault-free reference and compare the final loss.")
    ] = True,
    reference_ranks: Annotated[
        int, typer.Option(min=1, help="Ranks of the fault-free reference run.")
    ] = 1,
    loss_tolerance: Annotated[
        float, typer.Option(min=0, help="Accepted relative difference of the final losses.")
    ] = 0.01,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Where the servers keep their data and the logs (default: a temp dir)."),
    ] = None,
    keep: Annotated[
        bool,
        typer.Option("--keep", help="Leave the stack up for browsing until Ctrl-C; keep state."),
    ] = False,
    api_port: Annotated[int, typer.Option(min=0, help="Port of the API (0: a free one).")] = 0,
    plain: Annotated[
        bool, typer.Option("--plain", help="Plain progress lines even on a terminal.")
    ] = False,
    script: Annotated[
        Path | None, typer.Option(help="Training script (default: examples/train.py).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary as one JSON object on stdout.")
    ] = False,
    export: Annotated[
        Path | None,
        typer.Option(help="Write the job's log to FILE (`elasticctl export`'s JSONL) at the end."),
    ] = None,
    metrics_out: Annotated[
        Path | None,
        typer.Option(
            help="Write the final scrapes of the API's and the control plane's /metrics to FILE"
            ' at the end (one JSON object: {"api": TEXT, "controlplane": TEXT}).'
        ),
    ] = None,
    nats_cluster: Annotated[
        int,
        typer.Option(
            help="NATS nodes: 1 (one server), or a JetStream cluster of 3 or 5 with the streams"
            " replicated on every node."
        ),
    ] = 1,
    nats_kill_at: Annotated[
        int,
        typer.Option(
            min=0,
            help="Step after which the NATS node leading the events stream is killed (SIGKILL;"
            " with --nats-cluster 3 or 5); 0: none.",
        ),
    ] = 0,
    standby: Annotated[
        bool,
        typer.Option(
            "--standby",
            help="Run a second control plane that stands by and takes over when the first"
            " one's lock is gone.",
        ),
    ] = False,
    control_plane_exit: Annotated[
        str | None,
        typer.Option(
            help="Make the leading control plane exit, as a kill would, on the way out of the"
            " first recovery's decision: `record` (recorded, its commands not published) or"
            " `publish` (JetStream acknowledged them, no member acked yet); needs --standby.",
        ),
    ] = None,
) -> None:
    """See the whole loop work on this machine: faults injected, detected, recovered.

    Starts NATS (JetStream) and PostgreSQL from their PyPI packages on free ports under a
    state directory (or uses ELASTIC_NATS_URL / ELASTIC_DATABASE_URL when set: that database is
    migrated and written to), the control plane (`elasticctl serve`) and the API with the
    timeline page (`elasticctl api`). Launches examples/train.py as 4 ranks + 1 warm spare on
    the CPU, kills one rank (--crash-at: the spare takes its place) and stops another
    (--hang-at: found by its silent heartbeats; the world shrinks to 3), showing the step, the
    job's state and the incidents as it goes. --nan-at STEP (off by default) also makes that
    step's loss NaN on --nan-rank: an incident of kind anomaly, the same world rolled back to
    the newest backup before the step, whose batch it skips (the policy's anomaly_skip_steps,
    1). Alongside, a fault-free reference runs the same script, seed and steps on one rank
    (skipping the batches the rollback skips). The summary gives, per incident, the detect, decide,
    ack, restore and resume phases, the downtime and the steps lost; the job's goodput (its
    wall time by term and its ETTR, as `elasticctl goodput` gives them); the final loss
    against the reference; the URL of the job's timeline page.

    --nats-cluster 3 runs NATS as a three-node JetStream cluster (the streams at R3, every
    client given every node); --nats-kill-at STEP kills the node leading the events stream
    after STEP, and the run goes on on the other two. --standby runs a second control plane;
    --control-plane-exit record|publish makes the first one exit while it recovers the first
    fault, and the standby finishes the recovery. The summary's `log` says whether the log
    holds every event the members sent, once each.

    --json prints the summary as one JSON object on stdout (progress goes to stderr). --keep
    leaves the stack up for browsing until Ctrl-C. Ctrl-C (or SIGTERM) stops everything at any
    point. Exit status 0 when every fault recovered and the loss matches the reference, 1 when
    not, 130/143 when interrupted. A failed run keeps every process's log and the event log
    (events.jsonl, for `elasticctl replay`) in a directory it names. Two to three minutes on a
    busy 2-core machine.
    """
    from controlplane.demo import EXAMPLE, DemoConfig, DemoError, run_demo

    config = DemoConfig(
        steps=steps,
        backup_interval=backup_interval,
        nproc=nproc,
        spares=spares,
        crash_at=crash_at,
        crash_rank=crash_rank,
        hang_at=hang_at,
        hang_rank=hang_rank,
        nan_at=nan_at,
        nan_rank=nan_rank,
        seed=seed,
        heartbeat_timeout_s=heartbeat_timeout,
        start_timeout_s=start_timeout,
        train_timeout_s=timeout,
        reference=reference,
        reference_ranks=reference_ranks,
        loss_tolerance=loss_tolerance,
        state_dir=state_dir,
        keep=keep,
        as_json=as_json,
        api_port=api_port,
        live=False if plain else None,
        script=script.resolve() if script is not None else EXAMPLE,
        export=export,
        metrics_out=metrics_out,
        nats_cluster=nats_cluster,
        nats_kill_at=nats_kill_at,
        standby=standby or control_plane_exit is not None,
        control_exit=control_plane_exit,
    )
    _log_warnings()
    try:
        code = run_demo(config)
    except (ValueError, DemoError) as exc:
        raise _fail(str(exc)) from exc
    raise typer.Exit(code)


@app.command()
def chaos(
    *,
    minutes: Annotated[
        float, typer.Option(min=0.1, help="Minutes over which faults are injected.")
    ] = 5.0,
    every: Annotated[
        float,
        typer.Option(min=5, help="Mean seconds between two faults (each jittered by a quarter)."),
    ] = 25.0,
    seed: Annotated[int, typer.Option(help="Seed of the plan, the targets and the job.")] = 0,
    kinds: Annotated[
        str,
        typer.Option(
            help="Comma-separated fault kinds to mix: crash, hang, node, slow (of ranks),"
            " cut-control, cut-peers (a worker's host partitioned: root and `ip netns`), nats,"
            " postgres, control (of the infrastructure). Default: all of them, the partitions"
            " where this process can make network namespaces."
        ),
    ] = "",
    nproc: Annotated[int, typer.Option(min=2, help="Worker pods (the world size).")] = 4,
    spares: Annotated[int, typer.Option(min=0, help="Spare pods at the start.")] = 2,
    step_time: Annotated[
        float,
        typer.Option(
            min=0, help="Seconds each step's forward pass lasts at least (examples/train.py)."
        ),
    ] = 0.1,
    backup_interval: Annotated[
        int, typer.Option(min=1, help="Steps between two hot backups.")
    ] = 10,
    heartbeat_timeout: Annotated[
        float, typer.Option(min=0.5, help="Seconds of heartbeat silence that make a hang.")
    ] = 3.0,
    slow_for: Annotated[float, typer.Option(min=1, help="Seconds a `slow` fault lasts.")] = 20.0,
    settle_timeout: Annotated[
        float,
        typer.Option(min=10, help="Longest wait (s) for a fault to settle before it failed."),
    ] = 90.0,
    loss_tolerance: Annotated[
        float, typer.Option(min=0, help="Accepted relative difference of the final losses.")
    ] = 0.01,
    start_timeout: Annotated[
        float, typer.Option(min=1, help="Longest wait (s) for services to come up.")
    ] = 60.0,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Where the servers keep their data and the logs (default: a temp dir)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as one JSON object on stdout.")
    ] = False,
) -> None:
    """Inject a seeded mix of rank and infrastructure faults into a training job, and report
    what became of each.

    Starts the stack of `elasticctl demo` (NATS as a three-node JetStream cluster, PostgreSQL,
    the control plane and a standby; external servers are not used), then trains
    examples/train.py as one launcher per pretend node: --nproc worker pods and --spares pods
    of a warm spare, each step at least --step-time long. From --seed it plans a fault every
    --every seconds (jittered) for --minutes, the kinds in shuffled rounds, and injects them
    one at a time, each once the one before settled and a spare is ready: crash (SIGKILL of a
    worker), hang (SIGSTOP), node (a worker's pod killed, launcher and member: nothing
    reports an exit), slow (a worker stopped half of every 50 ms for --slow-for seconds:
    its compute twice as long, to be recorded as slow), cut-control and cut-peers (a
    worker's host cut from the control plane, or from its peers, for 20 s: every pod then
    runs on a host of its own, a network namespace; needs root), nats (the node leading the events
    stream killed, started again 10 s later), postgres (stopped, started again 5 s later),
    control (the leading control plane killed: the standby takes over, a new standby starts).
    Each lost worker's node is replaced by a new pod with a warm spare.

    The report gives per fault its kind, target, step, outcome (recovered: the incidents it
    caused recovered; tolerated: the job went on stepping with no incident, and a slow
    worker was recorded as slow; failed; undetected), how it was detected, the downtime and
    the steps lost; then the totals, the log's audit (events lost, stored twice), the final
    loss against a fault-free reference (the same steps on one rank) and the job's goodput
    (`elasticctl goodput`). The job runs about --minutes plus a fifth (steps take longer than
    --step-time); progress goes to stderr. Exit status 0 when every injected fault was
    handled, the job completed, the log is whole and the loss matches; 1 when not; 130/143
    when interrupted. A failed run keeps every process's log and the event log (events.jsonl,
    for `elasticctl replay`) in a directory it names.
    """
    from controlplane.chaos import ChaosConfig, default_kinds, run_chaos
    from controlplane.demo import DemoError

    config = ChaosConfig(
        minutes=minutes,
        every_s=every,
        seed=seed,
        kinds=tuple(k.strip() for k in kinds.split(",") if k.strip()) or default_kinds(),
        nproc=nproc,
        spares=spares,
        step_time_s=step_time,
        backup_interval=backup_interval,
        heartbeat_timeout_s=heartbeat_timeout,
        slow_for_s=slow_for,
        settle_timeout_s=settle_timeout,
        loss_tolerance=loss_tolerance,
        start_timeout_s=start_timeout,
        state_dir=state_dir,
        as_json=as_json,
    )
    _log_warnings()
    try:
        code = run_chaos(config)
    except (ValueError, DemoError) as exc:
        raise _fail(str(exc)) from exc
    raise typer.Exit(code)


# --------------------------------------------------------------------------- post-mortems
# export / import / replay / timeline: the bodies are in controlplane/postmortem/commands.py.

_PROGRESS_HELP = "Show progress on stderr even when it is not a terminal."


@app.command("export")
def export_log(
    *,
    job: Annotated[str | None, typer.Option(help="Only this job (default: every job).")] = None,
    after: Annotated[int, typer.Option(min=0, help="Only events after this position.")] = 0,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to FILE, not stdout.")
    ] = None,
    progress: Annotated[bool, typer.Option("--progress", help=_PROGRESS_HELP)] = False,
) -> None:
    """Write the log (ELASTIC_DATABASE_URL) as JSONL, in position order.

    One stored event per line: the envelope as published plus `position` and `recorded_at`.
    Streams a page at a time, up to the head the log had when the export began.
    `elasticctl export --job J > log.jsonl`.
    """
    from controlplane.postmortem import commands
    from controlplane.settings import Settings

    settings = Settings()  # no logging set-up: stdout may be the log itself
    try:
        if output is None:
            commands.export(settings.database_url, sys.stdout.buffer, job_id=job, after=after,
                            show_progress=progress)  # fmt: skip
        else:
            with output.open("wb") as out:
                commands.export(settings.database_url, out, job_id=job, after=after,
                                show_progress=progress)  # fmt: skip
    except commands.CommandError as exc:
        raise _fail(str(exc), exc.code) from exc


@app.command("import")
def import_log(
    path: Annotated[str, typer.Argument(help="A log file from `elasticctl export` (- : stdin).")],
    *,
    batch: Annotated[int, typer.Option(min=1, help="Events per transaction.")] = 5000,
    progress: Annotated[bool, typer.Option("--progress", help=_PROGRESS_HELP)] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Import a JSONL log into the database (ELASTIC_DATABASE_URL; migrated).

    Idempotent: events already in the log (by event_id) are skipped, so importing twice
    stores nothing twice. Each event keeps its recorded_at; into an empty database a complete
    export keeps its positions too. The per-source sequence rules apply as on ingest.
    """
    from controlplane.postmortem import commands
    from controlplane.settings import Settings

    settings = Settings()  # no logging set-up: stdout may be the log itself
    try:
        summary = commands.import_(settings.database_url, path, batch=batch,
                                   show_progress=progress)  # fmt: skip
    except commands.CommandError as exc:
        raise _fail(str(exc), exc.code) from exc
    typer.echo(json.dumps(summary.as_dict()) if as_json else commands.import_text(summary))


@app.command()
def replay(
    path: Annotated[str, typer.Argument(help="A log file from `elasticctl export` (- : stdin).")],
    *,
    job: Annotated[
        str | None, typer.Option(help="The job to replay (needed when the log holds several).")
    ] = None,
    until: Annotated[
        str | None,
        typer.Option(
            help="Stop after this position (an integer) or time (ISO 8601, UTC by default)."
        ),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            help="Counterfactual: re-decide under the job's policy changed by key=value,..."
            " (policy fields, e.g. redundancy=1,recovery_deadline_s=30; heartbeat_timeout=X"
            " sets the train phase's timeout, heartbeat_timeout.PHASE=X another phase's)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    progress: Annotated[bool, typer.Option("--progress", help=_PROGRESS_HELP)] = False,
) -> None:
    """Rebuild a job's view from a log file, with no server (or re-decide it: --policy).

    Prints the state, generation, world, members, state machine and incidents with their
    timelines, at the end of the log or at --until. With --policy, re-runs the decider over
    the recorded member events under that policy and shows the recorded and the
    counterfactual incidents side by side (docs/operations.md, "Post-mortems").
    """
    from controlplane.postmortem import commands

    try:
        commands.replay(path, job_id=job, until=until, policy=policy, as_json=as_json,
                        show_progress=progress)  # fmt: skip
    except commands.CommandError as exc:
        raise _fail(str(exc), exc.code) from exc


@app.command()
def simulate(
    *,
    ranks: Annotated[
        int,
        typer.Option(
            min=8, max=65_536, help="Ranks of the job, a multiple of 8 (8 a node, 16 nodes a rack)."
        ),
    ] = 16_384,
    days: Annotated[float, typer.Option(min=0.001, help="Simulated days.")] = 30.0,
    strategy: Annotated[
        str,
        typer.Option(
            help="Comma-separated: spares (hot backups, warm spare nodes; waits for a repair"
            " when none is left), shrink (no spares: the world shrinks, grows back after"
            " repairs), mixed (spares, then shrink), restart (checkpoint-restart, no control"
            " plane). Several are run on the same failures and shown side by side."
        ),
    ] = "spares,mixed,restart",
    preset: Annotated[
        str,
        typer.Option(
            help="Failure rates: llama3 (419 in 54 days on 16,384 GPUs), rsc (MTTF 1.8 h at"
            " 16,384 GPUs), seed512 (8 a day on 512 GPUs), none; per node-day, so they scale"
            " with --ranks."
        ),
    ] = "llama3",
    spares: Annotated[int, typer.Option(min=0, help="Spare nodes (8 ranks each).")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the failures drawn.")] = 0,
    trace: Annotated[
        str | None,
        typer.Option(
            help='A failure trace instead of the preset: JSON lines {"at_s": S, "kind":'
            ' "crash"|"hang"|"node"|"rack", "node": N} ("rack": N for a rack).'
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="The job and recovery model changed by key=value,... (step_s, backup_interval,"
            " backup_cost_s, heartbeat_timeout_s, state_gb, transfer_gbps, reinit_s, repair_s,"
            " restart_s, checkpoint_interval_s, checkpoint_cost_s, ...; docs/simulate.md)."
        ),
    ] = None,
    sweep: Annotated[
        str | None,
        typer.Option(
            help="Run once per value of a model field, of ranks or of spares, e.g."
            " backup_interval=5,10,20,50, checkpoint_interval_s=600,1200,2400,"
            " ranks=512,2048,8192 or spares=0,1,2,4; the best ETTR is reported next to"
            " Young/Daly's interval sqrt(2 x cost x MTBF)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    workers: Annotated[
        int,
        typer.Option(
            min=0,
            help="Processes to run the strategies (and sweep values) side by side in; 0: one"
            " a core.",
        ),
    ] = 0,
    reproduce: Annotated[
        str | None,
        typer.Option(
            help="Run a published figure's reproduction instead (all, seed512-restart,"
            " seed512-rebuild, seed512-elastic, llama3-restart): the published and the"
            " simulated figures, the assumptions, and whether they agree within 20%.",
        ),
    ] = None,
    plot: Annotated[
        str | None,
        typer.Option(
            help="With --sweep: draw ETTR against the swept value, a line a strategy, to this"
            " PNG file (the plot extra: matplotlib).",
        ),
    ] = None,
    progress: Annotated[bool, typer.Option("--progress", help=_PROGRESS_HELP)] = False,
) -> None:
    """Simulate a job's days with failures: the real fold and decider decide every incident.

    Members, time and failures are simulated; detection, placement, restore points and
    shrinking are the control plane's own decisions (core.decide) on the log it would have
    recorded; the recovery phases after a decision come from a model (--model). Prints ETTR
    and the lost-time breakdown per strategy (docs/simulate.md).
    """
    from controlplane.postmortem import commands

    try:
        commands.simulate(
            ranks=ranks, days=days, strategies=strategy, preset=preset, spares=spares,
            seed=seed, trace=trace, model=model, sweep=sweep, as_json=as_json,
            show_progress=progress, workers=workers, reproduce=reproduce, plot=plot,
        )  # fmt: skip
    except commands.CommandError as exc:
        raise _fail(str(exc), exc.code) from exc


@app.command()
def storage(
    *,
    job: Annotated[str | None, typer.Option(help="Only this job.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """What the log takes on disk, per job (ELASTIC_DATABASE_URL).

    The events table with its indexes and TOAST (every partition together, then each: the
    kept events, and each span of observations retention may drop), the dead letters, and
    for each job its events, the bytes of its rows (their out-of-line payloads included), of
    which observations, its share of the table with its indexes (in proportion to its
    rows), the time it spans, and the same by event type, largest first. Reads every event
    once (a full scan).
    """
    from controlplane.errors import StoreError
    from controlplane.settings import Settings
    from controlplane.store.postgres import PostgresEventStore

    settings = Settings()
    try:
        store = PostgresEventStore.from_url(settings.database_url)
        try:
            found = store.storage()
        finally:
            store.close()
    except StoreError as exc:
        raise _fail(str(exc), 1) from exc
    jobs = [j for j in found.jobs if job is None or j.job_id == job]
    if job is not None and not jobs:
        raise _fail(f"no job {job!r} in the log", 1)
    report = {
        "events_total_bytes": found.events_total_bytes,
        "events_table_bytes": found.events_table_bytes,
        "events_index_bytes": found.events_index_bytes,
        "dead_letters_bytes": found.dead_letters_bytes,
        "partitions": [
            {
                "name": p.name,
                "expiring": p.expiring,
                "positions": None if p.lo is None else [p.lo, p.hi],
                "rows_estimate": p.rows,
                "total_bytes": p.total_bytes,
                "table_bytes": p.table_bytes,
                "index_bytes": p.index_bytes,
            }
            for p in found.partitions
        ],
        "jobs": [
            {
                "job_id": j.job_id,
                "events": j.events,
                "row_bytes": j.row_bytes,
                "expiring_bytes": j.expiring_bytes,
                "share_bytes": found.share_bytes(j),
                "first_at": j.first_at.isoformat(),
                "last_at": j.last_at.isoformat(),
                "by_type": {
                    t: {"events": n, "row_bytes": b}
                    for t, (n, b) in sorted(j.by_type.items(), key=lambda kv: -kv[1][1])
                },
            }
            for j in jobs
        ],
    }
    if as_json:
        typer.echo(json.dumps(report))
        return
    typer.echo(
        f"events table {_mb(found.events_total_bytes)} (rows {_mb(found.events_table_bytes)},"
        f" indexes {_mb(found.events_index_bytes)}); dead letters"
        f" {_mb(found.dead_letters_bytes)}"
    )
    for p in found.partitions:
        where = "kept" if p.lo is None or p.hi is None else f"positions {p.lo:,}..{p.hi - 1:,}"
        typer.echo(f"  {p.name:<28} {where:<32} {_mb(p.total_bytes):>12}")
    for j in jobs:
        typer.echo(
            f"{j.job_id}: {j.events:,} events, rows {_mb(j.row_bytes)} (observations"
            f" {_mb(j.expiring_bytes)}), share {_mb(found.share_bytes(j))},"
            f" {j.first_at.isoformat()} .. {j.last_at.isoformat()}"
        )
        for type_, (n, size) in sorted(j.by_type.items(), key=lambda kv: -kv[1][1]):
            typer.echo(f"  {type_:<22} {n:>12,} {_mb(size):>12}")


@app.command()
def retention(
    *,
    days: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Drop observations older than this many days (default: ELASTIC_RETENTION_DAYS;"
            " 0 drops nothing).",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would be dropped; change nothing.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Drop old observations from the log (ELASTIC_DATABASE_URL): schedule it (daily).

    Step records and interval liveness summaries are kept in spans of the log (partitions of
    about a day each); a span whose every row is older than --days (ELASTIC_RETENTION_DAYS,
    30) and that the log has moved past is dropped as a table: never a mass DELETE, and
    readers and the ingest go on meanwhile. Decisions, faults, incidents, members' reports,
    backup catalogs and the summaries a decision read are never dropped; neither are, from a
    dropped span, each process's first and last step of each generation (a recovery's first
    step is its timeline's end), a step every 2,500 steps, each job's last interval summary,
    or what a fault cites. It also opens the next span ahead of the ingest. What a replay or
    the API can show of a period after its observations went: docs/operations.md,
    "Retention of observations".
    """
    from datetime import UTC, datetime, timedelta

    from controlplane.errors import StoreError
    from controlplane.settings import Settings
    from controlplane.store.postgres import PostgresEventStore

    settings = Settings()
    keep = settings.retention_days if days is None else days
    try:
        store = PostgresEventStore.from_url(settings.database_url)
        try:
            opened = [] if dry_run else store.open_spans()
            if keep > 0:
                done = store.retain(datetime.now(UTC) - timedelta(days=keep), dry_run=dry_run)
            else:
                done = None
            spans = store.spans() if done is None else done.kept
        finally:
            store.close()
    except StoreError as exc:
        raise _fail(str(exc), 1) from exc

    def span(s: Any) -> dict[str, Any]:
        return {
            "name": s.name, "positions": [s.lo, s.hi], "rows": s.rows,
            "total_bytes": s.total_bytes,
            "newest_at": None if s.newest_at is None else s.newest_at.isoformat(),
        }  # fmt: skip

    dropped_bytes = 0 if done is None else sum(s.total_bytes for s in done.dropped)
    report: dict[str, Any] = {
        "retention_days": keep,
        "older_than": None if done is None else done.older_than.isoformat(),
        "dry_run": dry_run,
        "dropped": [] if done is None else [span(s) for s in done.dropped],
        "dropped_rows": 0 if done is None else sum(s.rows for s in done.dropped),
        "dropped_bytes": dropped_bytes,
        "pinned_rows": 0 if done is None else done.pinned,
        "spans": [span(s) for s in spans],
        "opened": [list(s) for s in opened],
    }
    if as_json:
        typer.echo(json.dumps(report))
        return
    if done is None:
        typer.echo("retention 0 days: nothing dropped")
    else:
        verb = "would drop" if dry_run else "dropped"
        typer.echo(
            f"{verb} {len(done.dropped)} span(s) older than {done.older_than.isoformat()}:"
            f" {report['dropped_rows']:,} rows, {_mb(dropped_bytes)};"
            f" {done.pinned:,} row(s) kept from them"
        )
    for s in spans:
        newest = "empty" if s.newest_at is None else f"newest {s.newest_at.isoformat()}"
        typer.echo(
            f"  {s.name:<28} positions {s.lo:,}..{s.hi - 1:,}  {s.rows:>10,} rows"
            f"  {_mb(s.total_bytes):>10}  {newest}"
        )
    for lo, hi in opened:
        typer.echo(f"opened span for positions {lo:,}..{hi - 1:,}")


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.1f} MB" if nbytes >= 100_000 else f"{nbytes:,} B"


@app.command()
def timeline(
    job: Annotated[str, typer.Argument(help="The job.")],
    *,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """A job's incident timelines, from the database (ELASTIC_DATABASE_URL).

    Each incident's points with the events behind them (by position), phase durations,
    downtime and steps lost.
    """
    from controlplane.postmortem import commands
    from controlplane.settings import Settings

    settings = Settings()  # no logging set-up: stdout may be the log itself
    try:
        commands.timeline(settings.database_url, job, as_json=as_json)
    except commands.CommandError as exc:
        raise _fail(str(exc), exc.code) from exc


@app.command()
def goodput(
    job: Annotated[str, typer.Argument(help="The job.")],
    *,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """A job's goodput: where its wall time went, from the database (ELASTIC_DATABASE_URL).

    The wall time runs from the job's registration to its end (completed or stopped), or to
    now while it runs, and is split into disjoint terms, each bounded by events of the log
    (docs/design.md, "Goodput accounting"):

    productive: steps beyond the highest step any older generation reported.
    recomputation: steps at or below it (redone after a restore to an older backup; a
    restored world's first step is in resume).
    backup: each backup's copy into CPU memory, which holds the loop (the slowest rank's
    backup.snapshot seconds), taken out of the steps it lies between.
    stragglers: the steps' wait for members the control plane recorded slow (member.slow):
    each step waits its slowest one's sustained compute time less the baseline (from
    member.slow over its detection window, then from the liveness summaries until it is back
    under the threshold), taken out of the steps it lies in.
    detection: an incident's fault (its earliest evidence) to fault.detected.
    decision: fault.detected to the reallocation.issued that counts (the last).
    restore: that decision to the last member's restore.completed (acks and restores).
    resume: that restore to the new generation's first train.step.
    waiting: registration to the job's first train.step (members joining, the first group
    forming, the first build and step).
    idle: the rest (a world's time after its last step, until its fault or the job's end).

    ETTR is productive / wall. Per incident: its window by phase, the recomputation of the
    generation it started, and their sum as its cost; per generation (its generation.started
    to the next one's): the same terms.
    """
    from datetime import UTC, datetime

    from controlplane.postmortem import commands
    from controlplane.settings import Settings

    settings = Settings()  # no logging set-up: stdout may be read by a program
    try:
        commands.goodput(settings.database_url, job, as_json=as_json, now=datetime.now(UTC))
    except commands.CommandError as exc:
        raise _fail(str(exc), exc.code) from exc


@bench_app.command("replay")
def bench_replay(
    *,
    events: Annotated[int, typer.Option(min=100, help="Events in the log file.")] = 200_000,
    members: Annotated[int, typer.Option(min=2, help="Members of the synthetic job.")] = 64,
    ranks: Annotated[
        int | None,
        typer.Option(
            min=2,
            help="Replay instead the history of --days of a job of this many ranks (as bench"
            " api and bench takeover generate it); also prints rank_seconds_per_s.",
        ),
    ] = None,
    days: Annotated[float, typer.Option(min=0.001, help="Days of history with --ranks.")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print only the JSON result.")] = False,
) -> None:
    """Rebuild a job's view from a JSONL log file: read, validate and fold, in events/s.

    Writes a synthetic job's log (controlplane.synth), or with --ranks the history of --days
    of a job of that many ranks, to a temporary file, then times `elasticctl replay`'s path
    over it (median of three runs; no server involved).
    """
    from controlplane.bench.replay import run_replay_bench

    result = run_replay_bench(
        events=events, members=members, ranks=ranks, days=days, progress=not as_json
    )
    typer.echo(json.dumps(result))


#: What the ``server`` extra installs (the control plane's own packages): a trainer install
#: (``pip install elastic-controlplane``) runs ``elasticctl run`` without them.
SERVER_PACKAGES = frozenset({
    "alembic", "fastapi", "httptools", "prometheus_client", "psycopg", "pydantic_settings",
    "rich", "sqlalchemy", "starlette", "uvicorn", "uvloop",
})  # fmt: skip


def main() -> None:
    """Entry point of the ``elasticctl`` script."""
    try:
        app()
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in SERVER_PACKAGES:
            raise
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
        typer.echo(
            f"elasticctl {command}: needs the server extra (no module {exc.name!r}):"
            " pip install 'elastic-controlplane[server]'",
            err=True,
        )
        raise SystemExit(2) from None
