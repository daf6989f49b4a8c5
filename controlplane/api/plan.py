"""``GET /api/v1/simulate``: the planning simulator (``elasticctl simulate``) behind the
page's plan view, at a size a request can afford.

A run costs about its incidents times its ranks (each incident folds a backup of every rank
and takes the decider's turns over every member): a request whose expected failures, summed
over its runs on the decider, times its ranks pass ``MAX_RANK_INCIDENTS`` is refused (422)
with the command line that runs it. One simulation runs at a time (a worker thread); the
same query answers from a small cache, since the same inputs give the same result.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from typing import Annotated, Any, Literal

from anyio import to_thread
from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from controlplane.postmortem import simulate as sim
from schemas.api import Problem

#: The most ranks a request simulates, and its budget of expected incidents x ranks (a few
#: seconds on a 2-core machine: about 70 us a rank and incident).
MAX_RANKS = 4_096
MAX_RANK_INCIDENTS = 50_000
_CACHED = 32


_STRATEGY = "(" + "|".join(sim.STRATEGIES) + ")"
_FIELD = "(" + "|".join((*sim.SIZES, *sim.Model.__dataclass_fields__)) + ")"
_NUMBER = r"[0-9]{1,9}(\.[0-9]{1,6})?"


class PlanParams(BaseModel):
    """The query of ``GET /simulate`` (``elasticctl simulate``'s options, bounded)."""

    model_config = ConfigDict(extra="ignore")

    ranks: int = Field(
        512, ge=sim.NODE_RANKS, le=MAX_RANKS, multiple_of=sim.NODE_RANKS,
        description="Ranks, a multiple of 8 (8 a node, 16 nodes a rack).",
    )  # fmt: skip
    days: float = Field(7.0, gt=0, le=30, description="Simulated days.")
    strategy: str = Field(
        "spares,mixed,restart",
        max_length=40,
        pattern=rf"^{_STRATEGY}(,{_STRATEGY}){{0,3}}$",
        description="Comma-separated: spares, shrink, mixed, restart.",
    )
    preset: Literal["llama3", "rsc", "seed512", "none"] = Field(
        "seed512", description="Failure rates (per node-day)."
    )
    spares: int = Field(2, ge=0, le=64, description="Spare nodes.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the failures drawn.")
    sweep: str | None = Field(
        None,
        max_length=200,
        pattern=rf"^{_FIELD}={_NUMBER}(,{_NUMBER}){{0,7}}$",
        description="FIELD=V1,V2,... (up to 8): a model field, ranks or spares (a value a"
        " field cannot take, e.g. a fraction of a step: 422).",
    )


def plan_routes(router: APIRouter) -> None:
    """Add ``GET /simulate`` to ``router``."""
    lock = asyncio.Lock()
    cache: OrderedDict[sim.Plan, dict[str, Any]] = OrderedDict()

    @router.get(
        "/simulate",
        summary="A planning simulation: ETTR and lost time by strategy, or against a sweep",
        responses={
            200: {"content": {"application/json": {"schema": {"type": "object"}}}},
            422: {
                "model": Problem,
                "description": "A parameter is not valid, or the run is larger than a"
                " request may take (the detail gives the command that runs it).",
            },
        },
        response_class=JSONResponse,
    )
    async def simulate(params: Annotated[PlanParams, Query()]) -> JSONResponse:
        """``elasticctl simulate`` at a size a request can afford (docs/simulate.md): a job
        of ``ranks`` ranks for ``days`` under the ``preset``'s failures, each strategy's run
        with every incident decided by the real decider; with ``sweep``, once per value.
        The answer is the command's JSON (``runs``, each with ETTR and its lost-time
        breakdown; ``young_daly``; ``best`` for a sweep). Larger runs: 422, with the
        command that runs them."""
        try:
            planned = sim.plan(
                ranks=params.ranks, days=params.days, strategies=params.strategy,
                preset=params.preset, spares=params.spares, seed=params.seed,
                sweep=params.sweep,
            )  # fmt: skip
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        cost = _rank_incidents(planned)
        if cost > MAX_RANK_INCIDENTS:
            raise HTTPException(
                422,
                f"about {cost:,.0f} rank-incidents, over the {MAX_RANK_INCIDENTS:,} a request"
                f" may take: run `elasticctl simulate {_command(params)}`",
            )
        async with lock:
            out = cache.get(planned)
            if out is None:
                out = await to_thread.run_sync(lambda: sim.run_plan(planned))
                cache[planned] = out
                while len(cache) > _CACHED:
                    cache.popitem(last=False)
            cache.move_to_end(planned)
        return JSONResponse(out, headers={"Cache-Control": "no-store"})


def _rank_incidents(planned: sim.Plan) -> float:
    """The expected failures of the plan's runs on the decider, each times its ranks."""
    rates = sim.PRESETS[planned.preset].rates
    total = 0.0
    for _, kwargs, _ in planned.runs():
        if kwargs["strategy"] == "restart":
            continue
        nodes = math.ceil(kwargs["ranks"] / sim.NODE_RANKS) + kwargs["spares"]
        per_day = rates.per_day(nodes, math.ceil(nodes / sim.RACK_NODES))
        # The job's start folds every rank once, as an incident does.
        total += (per_day * planned.days + 1) * kwargs["ranks"]
    return total


def _command(params: PlanParams) -> str:
    words = [
        f"--ranks {params.ranks}", f"--days {params.days:g}", f"--strategy {params.strategy}",
        f"--preset {params.preset}", f"--spares {params.spares}", f"--seed {params.seed}",
    ]  # fmt: skip
    if params.sweep:
        words.append(f"--sweep {params.sweep}")
    return " ".join(words)
