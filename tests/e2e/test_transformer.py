"""The transformer example (FSDP2, ``examples/transformer.py``) recovered by real processes:
a rank killed with SIGKILL is replaced by the spare, which gets exactly its shards; without a
spare the world shrinks and the shards are re-partitioned in memory; with no hot copy left,
the cold checkpoint is restored through the same resharding."""

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
EXAMPLE = str(ROOT / "examples" / "transformer.py")
STEPS = 30
#: dp 2 x tp 2: the decider reasons in replicas (a replica: the two ranks of one dp index).
MESH_POLICY = POLICY + ',mesh={"dims":[["dp",2],["tp",2]]}'


async def _run(settings: Settings, cp, out: Path, faults: list[str], **options):  # type: ignore[no-untyped-def]
    job = f"job-gpt-{uuid.uuid4().hex[:6]}"
    code = await run_job(settings, job, out, faults, example=EXAMPLE, steps=STEPS, **options)
    return job, code, cp.views[job]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):  # type: ignore[no-untyped-def]
    return tmp_path_factory.mktemp("gpt-reference") / "clean.pt"


async def _ensure_reference(settings: Settings, cp, reference: Path) -> None:  # type: ignore[no-untyped-def]
    if reference.exists():  # noqa: ASYNC240 (a stat, once)
        return
    _, code, view = await _run(settings, cp, reference, [])
    assert code == 0 and view.state is JobState.COMPLETED, (code, view.state)
    # It learns: byte-level cross-entropy starts at ln 256 = 5.55.
    assert torch.load(reference)["loss"] < 4.5


def _assert_equal(reference: Path, out: Path) -> None:
    clean, recovered = torch.load(reference)["params"], torch.load(out)["params"]
    assert clean.keys() == recovered.keys()
    for name, tensor in clean.items():
        off = (recovered[name] - tensor).abs().max().item()
        assert torch.equal(recovered[name], tensor), f"{name}: off by up to {off:g}"


async def test_a_killed_rank_is_replaced_and_the_fsdp2_run_matches_a_fault_free_one(
    settings, pg_store, tmp_path, reference
):
    out = tmp_path / "replaced.pt"
    async with running_controlplane(settings) as cp:
        await _ensure_reference(settings, cp, reference)
        _, code, view = await _run(settings, cp, out, ["crash@15:rank=2"])
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    [incident] = view.incidents.values()
    [decision] = incident.decisions
    assert decision.mode == "replace" and "s0" in decision.world and decision.restore_step == 10
    assert timeline(incident).outcome == "recovered"
    assert code == 0
    _assert_equal(reference, out)


async def test_a_killed_tensor_parallel_rank_is_replaced_at_its_coordinate_or_its_replica_leaves(
    settings, pg_store, tmp_path
):
    """dp 2 x tp 2: the spare takes the lost rank's place in the mesh (its TP slice of the MLPs,
    its FSDP2 shard), and the run ends on the fault-free run's parameters."""
    clean, out, shrunk = (tmp_path / f"{n}-2d.pt" for n in ("clean", "replaced", "shrunk"))
    options = {"example_args": ("--tp", "2"), "policy": MESH_POLICY}
    async with running_controlplane(settings) as cp:
        _, code, view = await _run(settings, cp, clean, [], **options)
        assert code == 0 and view.state is JobState.COMPLETED
        _, code, view = await _run(settings, cp, out, ["crash@15:rank=3"], **options)
        assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
        [incident] = view.incidents.values()
        [decision] = incident.decisions
        assert decision.mode == "replace" and decision.world[3] == "s0"
        assert code == 0
        _assert_equal(clean, out)
        # Without a spare, the replica that lost a rank leaves whole (dp 2 -> 1, tp stays 2);
        # its survivor waits as a spare, unfenced, and the run ends near the fault-free loss.
        _, code, view = await _run(settings, cp, shrunk, ["crash@15:rank=3"], spares=0,
                                   **options)  # fmt: skip
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    [incident] = view.incidents.values()
    [decision] = incident.decisions
    assert decision.mode == "shrink" and len(decision.world) == 2, decision
    assert code == 0
    reference, ended = torch.load(clean)["loss"], torch.load(shrunk)["loss"]
    assert abs(ended - reference) <= 0.01 * abs(reference), (ended, reference)


async def test_without_a_spare_the_shards_are_repartitioned_and_the_loss_ends_near(
    settings, pg_store, tmp_path, reference
):
    out = tmp_path / "shrunk.pt"
    async with running_controlplane(settings) as cp:
        await _ensure_reference(settings, cp, reference)
        _, code, view = await _run(settings, cp, out, ["crash@15:rank=1"], spares=0)
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    [incident] = view.incidents.values()
    [decision] = incident.decisions
    assert decision.mode == "shrink" and len(decision.world) == 3
    assert code == 0
    clean, shrunk = torch.load(reference)["loss"], torch.load(out)["loss"]
    assert abs(shrunk - clean) <= 0.01 * abs(clean), (shrunk, clean)


async def test_with_no_hot_copy_the_cold_checkpoint_is_resharded_into_the_new_world(
    settings, pg_store, tmp_path, reference
):
    out = tmp_path / "cold.pt"
    checkpoints = tmp_path / "checkpoints"
    policy = POLICY.replace("redundancy=2", "redundancy=0") + ",checkpoint_every=1"
    async with running_controlplane(settings) as cp:
        await _ensure_reference(settings, cp, reference)
        _, code, view = await _run(settings, cp, out, ["crash@15:rank=1"], policy=policy,
                                   options=("--checkpoint-dir", str(checkpoints)))  # fmt: skip
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    [incident] = view.incidents.values()
    [decision] = incident.decisions
    assert (decision.restore_from, decision.restore_step) == ("checkpoint", 10)
    assert code == 0
    _assert_equal(reference, out)
