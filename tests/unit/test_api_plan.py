"""``GET /api/v1/simulate``: the planning simulator behind the page, bounded per request."""

from __future__ import annotations

import time

import httpx

from controlplane.api.app import create_app
from controlplane.postmortem import simulate as sim
from controlplane.settings import Settings
from controlplane.store.memory import InMemoryEventStore

URL = "/api/v1/simulate"


def _client() -> httpx.AsyncClient:
    app = create_app(Settings(api_refresh_s=0, api_tokens=None), InMemoryEventStore())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api")


async def test_a_sweep_answers_what_the_command_prints():
    query = {"ranks": 64, "days": 2, "strategy": "mixed,restart", "preset": "seed512",
             "spares": 1, "seed": 3, "sweep": "backup_interval=5,20"}  # fmt: skip
    async with _client() as api:
        began = time.perf_counter()
        answer = await api.get(URL, params=query)
        first = time.perf_counter() - began
        assert answer.status_code == 200, answer.text
        began = time.perf_counter()
        again = await api.get(URL, params=query)
        assert again.json() == answer.json() and time.perf_counter() - began < first
    out = answer.json()
    planned = sim.plan(ranks=64, days=2, strategies="mixed,restart", preset="seed512", spares=1,
                       seed=3, sweep="backup_interval=5,20")  # fmt: skip
    expected = sim.run_plan(planned)
    for run in (*out["runs"], *expected["runs"]):
        run.pop("simulated_in_s")
    assert out == expected
    assert [(r["strategy"], r["sweep"]) for r in out["runs"]] == [
        ("mixed", {"backup_interval": 5.0}), ("restart", {"backup_interval": 5.0}),
        ("mixed", {"backup_interval": 20.0}), ("restart", {"backup_interval": 20.0}),
    ]  # fmt: skip
    assert out["best"]["ettr"] == max(r["ettr"] for r in out["runs"])


async def test_bad_or_too_large_requests_are_problems_naming_the_command():
    async with _client() as api:
        bad = await api.get(URL, params={"strategy": "pray"})
        assert bad.status_code == 422 and "strategy" in bad.json()["detail"]
        field = await api.get(URL, params={"sweep": "nope=1,2"})
        assert field.status_code == 422 and "sweep" in field.json()["detail"]
        whole = await api.get(URL, params={"sweep": "backup_interval=2.5"})
        assert whole.status_code == 422 and "must be a whole number" in whole.json()["detail"]
        small = await api.get(URL, params={"sweep": "ranks=1"})
        assert (
            small.status_code == 422
            and "ranks='1': must be a multiple of 8" in small.json()["detail"]
        )
        # A part of a node: a replica is a node's eight ranks.
        part = await api.get(URL, params={"ranks": 294, "strategy": "mixed"})
        assert part.status_code == 422 and "ranks" in str(part.json()["detail"])
        large = await api.get(URL, params={"ranks": 4096, "days": 30, "preset": "rsc"})
        detail = large.json()["detail"]
        assert large.status_code == 422 and "rank-incidents" in detail
        assert "elasticctl simulate --ranks 4096 --days 30" in detail
        assert (await api.get(URL, params={"ranks": 8192})).status_code == 422
