"""The bodies of ``elasticctl export``, ``import``, ``replay`` and ``timeline`` (``cli.py``
declares their options). Errors a user can fix raise ``CommandError``; progress goes to
stderr (rich) when stderr is a terminal or when asked for."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Any, BinaryIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)

from controlplane import gctune
from controlplane.core.fold import fold, fold_noting
from controlplane.core.goodput import GoodputCounter
from controlplane.core.goodput import goodput as goodput_of
from controlplane.core.replay import PolicyError, counterfactual
from controlplane.errors import ControlPlaneError, SchemaNotMigrated
from controlplane.postmortem import report
from controlplane.postmortem.logfile import LogFormatError, read_log
from controlplane.postmortem.replay import (
    FOLD_CHUNK,
    ReplayError,
    job_events,
    parse_overrides,
    parse_until,
    replay_file,
    replay_log,
)
from controlplane.postmortem.transfer import ImportSummary, export_log, import_log


class CommandError(Exception):
    """A failure to report in one line, with the exit status to leave with."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def progress_console(wanted: bool) -> Console | None:
    """A console on stderr for progress bars, when stderr is a terminal or ``wanted``."""
    if wanted or sys.stderr.isatty():
        return Console(stderr=True)
    return None


@contextmanager
def progress_bar(
    console: Console | None, description: str, total: float | None, *, count: bool = False
) -> Iterator[Callable[[float], None]]:
    """A callable that sets how far the task is (``completed``); a no-op without a console."""
    if console is None:
        yield lambda completed: None
        return
    columns = [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()]
    if count:
        columns.append(MofNCompleteColumn())
    with Progress(*columns, TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task(description, total=total)
        yield lambda completed: bar.update(task, completed=completed)
        if total is not None:
            bar.update(task, completed=total)


def _reproduce(name: str, *, seed: int, as_json: bool, show_progress: bool) -> None:
    """``elasticctl simulate --reproduce``: published figures next to simulated ones."""
    from controlplane.postmortem import simulate as sim

    names = list(sim.REPRODUCTIONS) if name == "all" else [name]
    if any(n not in sim.REPRODUCTIONS for n in names):
        raise CommandError(f"--reproduce: all, or one of {', '.join(sim.REPRODUCTIONS)}")
    console = progress_console(show_progress)
    out = []
    for one in names:
        with progress_bar(console, f"reproduce {one}", 1.0) as advance:
            out.append(sim.reproduce(one, seed=seed, progress=advance))
    if as_json:
        print(json.dumps({"reproductions": out}))
        return
    console_out = _stdout_console()
    for case in out:
        console_out.print(f"{case['name']}: {case['claim']}")
        console_out.print(f"  source: {case['source']}")
        console_out.print(f"  assumed: {case['assumptions']}")
        for key, published in case["published"].items():
            if published is None:
                continue
            bound = case["above"] and key == "ettr"
            verdict = "met" if bound else f"within {case['tolerance']:.0%}"
            if not case["within"][key]:
                verdict = f"NOT {verdict}"
            console_out.print(
                f"  {key}: published {'at least ' if bound else ''}{published:g}, simulated"
                f" {case['simulated'][key]:g} ({verdict})"
            )


@contextmanager
def progress_bars(
    console: Console | None, descriptions: list[str]
) -> Iterator[Callable[[int, float], None]]:
    """A callable that sets how far task ``i`` of several (fractions, side by side) is; a
    no-op without a console."""
    if console is None:
        yield lambda i, fraction: None
        return
    columns = [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()]
    with Progress(*columns, TimeRemainingColumn(), console=console) as bar:
        tasks = [bar.add_task(description, total=1.0) for description in descriptions]
        yield lambda i, fraction: bar.update(tasks[i], completed=fraction)
        for task in tasks:
            bar.update(task, completed=1.0)


def _stdout_console() -> Console:
    """Tables on stdout: the terminal's width, or a wide page when piped."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _open_store(database_url: str) -> Any:
    from controlplane.store import migrate
    from controlplane.store.postgres import PostgresEventStore, make_engine

    engine = make_engine(database_url, pool_size=1)
    try:
        migrate.check_schema(engine)
    except SchemaNotMigrated as exc:
        engine.dispose()
        raise CommandError(str(exc)) from exc
    except ControlPlaneError as exc:
        engine.dispose()
        raise CommandError(f"database: {exc}") from exc
    except Exception as exc:  # the driver's connection errors, worded by it
        engine.dispose()
        reason = getattr(exc, "orig", None) or exc
        raise CommandError(f"database: {str(reason).strip()}") from exc
    return PostgresEventStore(engine)


def export(
    database_url: str,
    out: BinaryIO,
    *,
    job_id: str | None,
    after: int,
    show_progress: bool,
) -> dict[str, Any]:
    """Write the log (of one job, or every job) after ``after`` to ``out``."""
    store = _open_store(database_url)
    console = progress_console(show_progress)
    try:
        head = store.last_position()
        with progress_bar(console, "export", max(head - after, 0) or None) as advance:
            summary = export_log(
                store, out, job_id=job_id, after=after, progress=lambda p: advance(p - after)
            )
        out.flush()
        if job_id is not None and summary.events == 0:
            known = ", ".join(store.job_ids()[:10])
            hint = f" (jobs in the log: {known})" if known else " (the log is empty)"
            raise CommandError(f"no event of job {job_id!r} after position {after}{hint}", 1)
    except ControlPlaneError as exc:
        raise CommandError(f"export failed: {exc}", 1) from exc
    finally:
        store.close()
    if console is not None:
        console.print(
            f"exported {summary.events} events (positions {summary.first_position}"
            f"..{summary.last_position}) of {len(summary.jobs)} job(s)"
        )
    return summary.as_dict()


@contextmanager
def _lines(path: str) -> Iterator[tuple[IO[bytes], int | None]]:
    """The file's binary stream and size; ``-`` is stdin."""
    if path == "-":
        yield sys.stdin.buffer, None
        return
    file = Path(path)
    try:
        stream = file.open("rb")
    except OSError as exc:
        raise CommandError(f"{path}: {exc.strerror or exc}") from exc
    with stream:
        yield stream, file.stat().st_size


def import_(database_url: str, path: str, *, batch: int, show_progress: bool) -> ImportSummary:
    """Import a log file into the database (idempotent: known event ids are skipped)."""
    store = _open_store(database_url)
    console = progress_console(show_progress)
    try:
        with ExitStack() as stack:
            stream, size = stack.enter_context(_lines(path))
            advance = stack.enter_context(progress_bar(console, "import", size))
            read = [0]

            def on_bytes(n: int) -> None:
                read[0] += n
                advance(read[0])

            events = read_log(stream, source=path, progress=on_bytes)
            return import_log(store, events, batch=batch)
    except LogFormatError as exc:
        raise CommandError(
            f"{exc} (batches before it are imported; importing again after fixing the file"
            " skips them)"
        ) from exc
    except ControlPlaneError as exc:
        raise CommandError(f"import failed: {exc}", 1) from exc
    finally:
        store.close()


def import_text(summary: ImportSummary) -> str:
    kept = "kept" if summary.positions_kept else "renumbered (the log was not empty)"
    text = (
        f"imported {summary.imported} of {summary.read} events"
        f", skipped {summary.duplicates} already in the log"
    )
    if summary.rejected:
        text += f", {summary.rejected} refused by the sequence rules (dead letters)"
    if summary.imported:
        text += f"; positions {summary.first_position}..{summary.last_position}, {kept}"
    return text


def replay(
    path: str,
    *,
    job_id: str | None,
    until: str | None,
    policy: str | None,
    as_json: bool,
    show_progress: bool,
) -> None:
    """Rebuild a job's view from a log file (to a point), or re-decide it under a policy."""
    try:
        point = parse_until(until) if until is not None else None
        overrides = parse_overrides(policy) if policy is not None else None
    except ReplayError as exc:
        raise CommandError(str(exc)) from exc
    console = progress_console(show_progress)
    out = _stdout_console()
    try:
        with ExitStack() as stack:
            stream, size = stack.enter_context(_lines(path))
            advance = stack.enter_context(progress_bar(console, "replay", size))
            stack.enter_context(gctune.relaxed())
            read = [0]

            def on_bytes(n: int) -> None:
                read[0] += n
                advance(read[0])

            if overrides is None:
                if path != "-" and Path(path).is_file():
                    # Opened again by each of its processes.
                    replayed = replay_file(
                        path, job_id=job_id, until=point, source=path, progress=on_bytes
                    )
                else:  # stdin, a pipe
                    events = read_log(stream, source=path, progress=on_bytes)
                    replayed = replay_log(events, job_id=job_id, until=point, chunk=FOLD_CHUNK)
                if as_json:
                    print(json.dumps(report.view_json(replayed)))
                else:
                    report.print_view(out, replayed)
                return
            log = job_events(read_log(stream, source=path, progress=on_bytes), job_id)
            if isinstance(point, int):
                log = [s for s in log if s.position <= point]
            elif point is not None:
                log = [s for s in log if s.recorded_at <= point]
            if not log:
                raise ReplayError(f"no event of the job up to {until}")
            result = counterfactual(log, overrides)
            baseline = counterfactual(log, {})
    except (LogFormatError, ReplayError, PolicyError) as exc:
        raise CommandError(str(exc)) from exc
    except ValueError as exc:  # the counterfactual's own complaints (e.g. no member events)
        raise CommandError(str(exc)) from exc
    if as_json:
        print(json.dumps(report.counterfactual_json(result, baseline)))
    else:
        report.print_counterfactual(out, result, baseline)


def timeline(database_url: str, job_id: str, *, as_json: bool) -> None:
    """Print a job's incident timelines, folded from the database's log."""
    store = _open_store(database_url)
    try:
        view = None
        chunk = []
        with gctune.relaxed():
            for stored in store.iter_events(job_id=job_id):
                chunk.append(stored)
                if len(chunk) >= FOLD_CHUNK:
                    view = fold(view, chunk)
                    chunk = []
            if chunk:
                view = fold(view, chunk)
        if view is None:
            known = ", ".join(store.job_ids()[:10]) or "none"
            raise CommandError(f"no job {job_id!r} in the log (jobs: {known})", 1)
    except ControlPlaneError as exc:
        raise CommandError(f"timeline failed: {exc}", 1) from exc
    finally:
        store.close()
    if as_json:
        print(json.dumps(report.timeline_json(view)))
    else:
        report.print_timelines(_stdout_console(), view)


def goodput(database_url: str, job_id: str, *, as_json: bool, now: datetime) -> None:
    """Print a job's goodput at ``now`` (its end, once it ended), from the database's log."""
    store = _open_store(database_url)
    try:
        view = None
        counter = GoodputCounter()
        chunk: list[Any] = []

        def flush() -> None:
            nonlocal view
            view, ignored = fold_noting(view, chunk)
            counter.count(chunk, ignored)
            chunk.clear()

        with gctune.relaxed():
            for stored in store.iter_events(job_id=job_id):
                chunk.append(stored)
                if len(chunk) >= FOLD_CHUNK:
                    flush()
            if chunk:
                flush()
        if view is None:
            known = ", ".join(store.job_ids()[:10]) or "none"
            raise CommandError(f"no job {job_id!r} in the log (jobs: {known})", 1)
    except ControlPlaneError as exc:
        raise CommandError(f"goodput failed: {exc}", 1) from exc
    finally:
        store.close()
    found = goodput_of(view, counter, now)
    if found is None:
        raise CommandError(f"job {job_id!r} is not registered yet", 1)
    if as_json:
        from controlplane.api.render import goodput as rendered

        print(rendered(found).model_dump_json())
    else:
        report.print_goodput(_stdout_console(), found)


def simulate(
    *,
    ranks: int,
    days: float,
    strategies: str,
    preset: str,
    spares: int,
    seed: int,
    trace: str | None,
    model: str | None,
    sweep: str | None,
    as_json: bool,
    show_progress: bool,
    workers: int = 0,
    reproduce: str | None = None,
    plot: str | None = None,
) -> None:
    """``elasticctl simulate``: each strategy's run (or a sweep of one model field), as a
    table or one JSON object; the runs in ``workers`` processes (0: one a core). With
    ``reproduce``, a published figure's run instead (``all``: each)."""
    from controlplane.postmortem import simulate as sim

    if reproduce is not None:
        _reproduce(reproduce, seed=seed, as_json=as_json, show_progress=show_progress)
        return

    try:
        planned = sim.plan(
            ranks=ranks, days=days, strategies=strategies, preset=preset, spares=spares,
            seed=seed, model=parse_overrides(model) if model else None, sweep=sweep,
            failures=sim.read_trace(Path(trace)) if trace else None, source=trace,
        )  # fmt: skip
    except (ValueError, ReplayError, OSError) as exc:
        raise CommandError(str(exc)) from exc
    console = progress_console(show_progress)
    labels = [f"simulate {label}" for label, _, _ in planned.runs()]
    with progress_bars(console, labels) as advance:
        out = sim.run_plan(planned, workers=workers or sim.cores(), progress=advance)
    runs = out["runs"]
    per_day = out["failures_per_day"]
    if plot is not None:
        from controlplane.postmortem.plots import PlotError, ettr_figure

        try:
            out["plot"] = str(ettr_figure(out, Path(plot)))
        except (PlotError, OSError) as exc:
            raise CommandError(str(exc)) from exc
    if as_json:
        print(json.dumps(out))
        return
    console_out = _stdout_console()
    console_out.print(
        f"{ranks:,} ranks, {days:g} days, {out['failures_source']}"
        f" ({per_day:g} failures a day), seed {seed}"
    )
    for run in runs:
        swept = "".join(f" {k}={v:g}" for k, v in run.get("sweep", {}).items())
        lost = ", ".join(f"{k} {v:,.0f}s" for k, v in run["breakdown_s"].items()
                         if v and k != "productive")  # fmt: skip
        console_out.print(
            f"{run['strategy']:>8}{swept}: ETTR {run['ettr']:.4f}, {run['incidents']} incidents"
            f" (mean downtime {run['mean_downtime_s']}s), lost: {lost}"
        )
    if "young_daly" in out:
        yd = out["young_daly"]
        console_out.print(
            f"Young/Daly: checkpoint every {yd['checkpoint_interval_s']:,}s,"
            f" backup every {yd['backup_interval_steps']} steps (MTBF {yd['mtbf_s']:,}s)"
        )
    if "plot" in out:
        console_out.print(f"ETTR against {sweep.partition('=')[0] if sweep else ''}: {out['plot']}")
