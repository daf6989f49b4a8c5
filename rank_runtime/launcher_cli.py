"""The launcher's command line: ``elastic-run`` (the same command as ``elasticctl run``).

It imports nothing of the control plane, so a node that only trains runs it from a trainer
install (``pip install elastic-controlplane``, without the ``server`` extra); the control
plane's ``elasticctl`` registers this same command as its ``run``. ``python -m
rank_runtime.launcher_cli`` runs it too. The launcher itself is ``rank_runtime.launcher``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Annotated, Any

import typer

from schemas import logjson
from schemas.overrides import parse_overrides

if TYPE_CHECKING:
    from schemas.events import JobPolicy

#: Where the launcher finds NATS without ``ELASTIC_NATS_URL``.
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
#: The script's own arguments follow it, options of its own included.
RUN_CONTEXT: dict[str, Any] = {"allow_extra_args": True, "ignore_unknown_options": True}


def _fail(ctx: typer.Context, message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"{ctx.command_path}: {message}", err=True)
    return typer.Exit(code)


def run(
    ctx: typer.Context,
    script: Annotated[str, typer.Argument(help="The training script (its arguments follow).")],
    *,
    nproc: Annotated[
        int,
        typer.Option(
            min=0,
            help="Workers to start (the world size). 0 with --spares K: a launcher of spares"
            " only, beside the launchers of the job's workers (set the job's world_size in"
            " --policy).",
        ),
    ] = 1,
    spares: Annotated[int, typer.Option(min=0, help="Warm spares to keep ready.")] = 0,
    nodes: Annotated[int, typer.Option(min=1, help="Pretend nodes to lay members over.")] = 1,
    racks: Annotated[int, typer.Option(min=1, help="Racks the nodes are spread over.")] = 1,
    job_id: Annotated[str | None, typer.Option(help="Job id (default: a fresh one).")] = None,
    fault: Annotated[
        list[str] | None,
        typer.Option(
            help="crash@STEP:rank=R, hang@STEP:rank=R, stall@STEP:rank=R (its loop stops, its"
            " heartbeats go on), slow@STEP:rank=R:FACTOR[:for=SECONDS]"
            " (that process FACTOR times slower from STEP on), slow@STEP:rank=R:SECONDSs (one"
            " slow step), nan@STEP:rank=R (the step's loss and the rank's parameters NaN),"
            " spike@STEP:rank=R:FACTOR (the rank's parameters times FACTOR after STEP),"
            " crash@recover:rank=R (on a reallocation, before acking it),"
            " tamper@serve:rank=R (its peer store serves forged copies) or"
            " random:every=SECONDS[:seed=N]; repeatable."
        ),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(help="Policy as key=value,... (e.g. backup_interval=5,redundancy=2)."),
    ] = None,
    checkpoint_dir: Annotated[
        str | None,
        typer.Option(
            help="Directory for cold checkpoints (every member must reach it), written every"
            " checkpoint_every backups of the policy; the fallback when no hot copy survives."
        ),
    ] = None,
    node: Annotated[
        str | None,
        typer.Option(
            help="The node (machine, pod) this launcher runs on, for a job with a launcher per"
            " node: its members are <node>-w0..., <node>-s0... on that node (--nodes is"
            " ignored); set world_size in --policy to the job's total."
        ),
    ] = None,
    rack: Annotated[
        str | None, typer.Option(help="With --node: the rack that node is in (default rack0).")
    ] = None,
    rack_label: Annotated[
        str | None,
        typer.Option(
            help="With --node, in a Kubernetes pod: the rack is this label of the node the pod"
            " runs on (e.g. topology.kubernetes.io/zone), read from the API server with the"
            " pod's service account (`get` on nodes); the node's name from"
            " ELASTIC_K8S_NODE_NAME (downward API: spec.nodeName). Characters a rack name"
            " cannot hold become '-'.",
        ),
    ] = None,
    fence: Annotated[
        bool,
        typer.Option(
            "--fence/--no-fence",
            help="Kill members a newer generation leaves out (the default). --no-fence is for"
            " tests: a hung member resumed is not killed (it leaves at the end of its step).",
        ),
    ] = True,
) -> None:
    """Launch a training script's members on this machine and report what happens to them.

    Each member runs SCRIPT with ELASTIC_JOB_ID, ELASTIC_NODE, ELASTIC_RACK, ELASTIC_MEMBER,
    ELASTIC_ROLE, ELASTIC_NATS_URL and ELASTIC_POLICY set; the script uses rank_runtime.Elastic.
    Every exit is reported to the control plane at once. The exit status is the job's
    outcome (docs/operations.md, "Launcher exit codes"): 0 when the job completed, whatever
    members died and were replaced on the way (they are reported, not failed), or, with no
    word from the control plane on how it ended, when no member of this launcher failed
    without being replaced; 1 when the job stopped, or a member failed and the job did not go
    on without it; 2 for bad usage; 3 when a member failed and no command of the job ever
    came (no control plane, or none it could trust); 128+N when the launcher was stopped by
    signal N (forwarded to its members), unless the job completed.
    """
    from rank_runtime import launcher
    from rank_runtime.faults import FaultSpecError
    from rank_runtime.identity import NATS_URL_ENV

    logjson.configure(logging.INFO, logjson.env_format(), text_format="%(message)s")
    if nproc + spares == 0:
        raise _fail(ctx, "nothing to launch: --nproc and --spares are both 0")
    if rack_label is not None:
        if rack is not None or node is None:
            raise _fail(ctx, "--rack-label goes with --node, instead of --rack")
        from rank_runtime import k8s

        try:
            rack = k8s.rack_name(k8s.node_label(rack_label))
        except k8s.NodeLabelError as exc:
            raise _fail(ctx, str(exc)) from exc
        typer.echo(f"node {node}: rack {rack} (label {rack_label})", err=True)
    try:
        launcher.script_path(script)
        job_policy = launch_policy(policy, nproc)
        result = launcher.run(
            [script, *ctx.args],
            nproc=nproc,
            spares=spares,
            nodes=nodes,
            racks=racks,
            job_id=job_id,
            nats_url=os.environ.get(NATS_URL_ENV, DEFAULT_NATS_URL),
            policy=job_policy,
            fault_specs=fault or [],
            checkpoint_dir=checkpoint_dir,
            node=node,
            rack=rack,
            fence=fence,
        )
    except (FaultSpecError, FileNotFoundError, ValueError) as exc:
        raise _fail(ctx, str(exc)) from exc
    typer.echo(json.dumps({"job_id": result.job_id, "exits": result.exits,
                           "killed": result.killed, "replaced": result.replaced,
                           "outcome": result.outcome, "exit_code": result.code}))  # fmt: skip
    if result.code != 0:
        raise typer.Exit(result.code)


def launch_policy(text: str | None, nproc: int) -> JobPolicy:
    """The policy ``elastic-run --policy TEXT`` asks for: ``world_size`` defaults to the
    launcher's workers (a launcher of spares only must name it), ``max_world`` to no less than
    the world."""
    from schemas.events import JobPolicy

    values = parse_overrides(text) if text else {}
    if nproc == 0 and "world_size" not in values:
        raise ValueError(
            "a launcher of spares only (--nproc 0) needs the job's world_size in --policy"
        )
    values.setdefault("world_size", nproc)
    sizes = (values["world_size"], values.get("min_world", 1))
    values.setdefault("max_world", max([nproc, *(v for v in sizes if isinstance(v, int))]))
    return JobPolicy.model_validate(values, strict=False)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(context_settings=RUN_CONTEXT)(run)


def main() -> None:
    """Entry point of the ``elastic-run`` script."""
    app(prog_name="elastic-run")


if __name__ == "__main__":
    main()
