"""The pipeline example (PP x DP, ``examples/pipeline.py``) recovered by real processes: 2
stages x dp 2 on CPU/gloo; a last-stage rank killed with SIGKILL is replaced by the spare at
its coordinate, which gets exactly its FSDP2 shards of its stage, and the run ends on the
fault-free run's parameters."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from controlplane.core.timeline import timeline
from controlplane.settings import Settings
from schemas.common import JobState
from tests.e2e.test_recovery import POLICY, run_job
from tests.integration.helpers import running_controlplane

pytestmark = [pytest.mark.usefixtures("clean_stream"), pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "pipeline.py")
STEPS = 30
#: dp outermost, pp inner (the example's order): rank r is stage r % 2 of replica r // 2, and
#: a replica (the decider's unit) is one whole pipeline.
MESH_POLICY = POLICY + ',mesh={"dims":[["dp",2],["pp",2]]}'
#: dp 1, pp 1: the last stage of the second pipeline.
LAST_STAGE_RANK = 3


async def _run(settings: Settings, cp, out: Path, faults: list[str], spares: int = 1):  # type: ignore[no-untyped-def]
    job = f"job-pp-{uuid.uuid4().hex[:6]}"
    code = await run_job(settings, job, out, faults, example=EXAMPLE, steps=STEPS,
                         policy=MESH_POLICY, spares=spares)  # fmt: skip
    return code, cp.views[job]


async def test_a_killed_last_stage_rank_is_replaced_or_its_pipeline_leaves(
    settings, pg_store, tmp_path
):
    clean, out, shrunk = (tmp_path / f"{n}.pt" for n in ("clean", "replaced", "shrunk"))
    async with running_controlplane(settings) as cp:
        code, view = await _run(settings, cp, clean, [])
        assert code == 0 and view.state is JobState.COMPLETED, (code, view.state)
        # Without a spare the damaged pipeline leaves whole (dp 2 -> 1); each stage's shards
        # are re-partitioned from peer memory into the remaining one, by parameter name.
        code, view = await _run(settings, cp, shrunk, [f"crash@15:rank={LAST_STAGE_RANK}"],
                                spares=0)  # fmt: skip
        assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
        [incident] = view.incidents.values()
        [decision] = incident.decisions
        assert decision.mode == "shrink" and len(decision.world) == 2, decision
        assert code == 0
        ended, clean_loss = torch.load(shrunk)["loss"], torch.load(clean)["loss"]
        assert abs(ended - clean_loss) <= 0.01 * abs(clean_loss), (ended, clean_loss)
        code, view = await _run(settings, cp, out, [f"crash@15:rank={LAST_STAGE_RANK}"])
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    [incident] = view.incidents.values()
    [decision] = incident.decisions
    assert decision.mode == "replace" and decision.restore_step == 10, decision
    assert decision.world[LAST_STAGE_RANK] == "s0", decision.world
    assert timeline(incident).outcome == "recovered"
    assert code == 0
    reference, recovered = torch.load(clean), torch.load(out)
    # It learns: byte-level cross-entropy starts at ln 256 = 5.55.
    assert reference["loss"] < 4.5, reference["loss"]
    assert recovered["loss"] == reference["loss"]
    # Both stages' parameters, under the whole model's names (embeddings to head).
    params = reference["params"]
    assert {"tok.weight", "blocks.0.ln1.weight", "blocks.3.mlp.2.bias", "head.weight"} <= set(
        params
    )
    assert params.keys() == recovered["params"].keys()
    for name, tensor in params.items():
        off = (recovered["params"][name] - tensor).abs().max().item()
        assert torch.equal(recovered["params"][name], tensor), f"{name}: off by up to {off:g}"
