"""A NaN on one rank, with real processes, NATS and PostgreSQL: the rank reports its non-finite
step, the control plane rolls the whole world back in process to the backup before it and
skips the step's batch, and the job ends where a fault-free run that skips the same batch
ends."""

from __future__ import annotations

import uuid

import pytest
import torch

from controlplane.core.goodput import GoodputCounter, goodput
from controlplane.core.replay import redecide
from controlplane.core.timeline import timeline
from schemas.common import JobState
from tests.e2e.test_recovery import POLICY, run_job
from tests.integration.helpers import running_controlplane

pytestmark = [pytest.mark.usefixtures("clean_stream"), pytest.mark.timeout(300)]

NAN_STEP = 25


async def test_a_nan_on_one_rank_rolls_back_and_ends_where_a_run_skipping_its_batch_ends(
    settings, pg_store, tmp_path
):
    torch.set_num_threads(1)
    reference_out, faulty_out = tmp_path / "reference.pt", tmp_path / "nan.pt"
    reference = f"job-skip-{uuid.uuid4().hex[:6]}"
    faulty = f"job-nan-{uuid.uuid4().hex[:6]}"
    async with running_controlplane(settings) as cp:
        # Fault-free, skipping the batch the rollback is to skip.
        code = await run_job(settings, reference, reference_out, [], spares=0,
                             example_args=("--skip-steps", str(NAN_STEP)))  # fmt: skip
        assert code == 0 and cp.views[reference].state is JobState.COMPLETED
        assert cp.views[reference].incidents == {}
        code = await run_job(settings, faulty, faulty_out, [f"nan@{NAN_STEP}:rank=1"], spares=0)
        view = cp.views[faulty]
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    assert code == 0
    [incident] = view.incidents.values()
    assert incident.kind == "anomaly" and incident.anomaly_step == NAN_STEP
    [decision] = incident.decisions
    assert decision.mode == "rollback" and decision.restore_step == 20
    assert decision.skip == ((NAN_STEP, NAN_STEP),)
    line = timeline(incident)
    assert line.outcome == "recovered" and all(v is not None for v in line.phases.values())
    print(f"rollback: downtime {line.downtime_s:.2f}s, phases {line.phases}")

    log = pg_store.read(job_id=faulty)
    [detected] = [s.event.payload for s in log if s.event.type == "anomaly.detected"]
    assert (detected.kind, detected.step, detected.members) == ("non_finite_loss", NAN_STEP,
                                                                ["w1"])  # fmt: skip
    assert not [s for s in log if s.event.type == "fault.detected"]  # no member failed
    first = next(s.event.payload for s in log if s.event.type == "generation.started")
    assert decision.world == tuple(first.world)  # the same world, every rank restored
    # Every step of the new generation but the skipped one, and none of it after the skip.
    steps = {s.event.payload.step for s in log
             if s.event.type == "train.step" and s.event.generation == decision.generation}  # fmt: skip
    assert NAN_STEP not in steps and {21, 24, 26, 40} <= steps
    # The replay re-decides the rollback.
    assert all(batch.matches for batch in redecide(log))
    counter = GoodputCounter()
    counter.count(log)
    result = goodput(view, counter, view.history[-1].at)
    assert result is not None and result.recomputed_steps == NAN_STEP - 1 - 20

    clean, rolled = torch.load(reference_out), torch.load(faulty_out)
    assert abs(rolled["loss"] - clean["loss"]) <= 0.01 * abs(clean["loss"]), (rolled, clean)
    # In fact bit for bit: the same batches at the same steps, and the state restored exact.
    for name, tensor in clean["params"].items():
        assert torch.equal(rolled["params"][name], tensor), name


SPIKE_STEP = 25
SPIKE_POLICY = f"{POLICY},loss_spike_k=10,loss_spike_window=8"


async def test_a_loss_spike_is_found_in_the_jobs_loss_and_rolled_back_past_its_batch(
    settings, pg_store, tmp_path
):
    """``spike@25:rank=1:10``: rank 1's parameters are multiplied by 10 once step 25 is done
    (an update gone wrong that stays finite). No rank reports anything: the control plane finds
    the job's loss of step 26 above median + 10 x MAD of the 8 before it, rolls the world
    back to the backup of step 20 and skips step 26's batch; the job ends where a fault-free
    run skipping that batch ends."""
    torch.set_num_threads(1)
    reference_out, faulty_out = tmp_path / "reference.pt", tmp_path / "spike.pt"
    faulty = f"job-spike-{uuid.uuid4().hex[:6]}"
    reference = f"job-skip-{uuid.uuid4().hex[:6]}"
    async with running_controlplane(settings) as cp:
        code = await run_job(settings, faulty, faulty_out, [f"spike@{SPIKE_STEP}:rank=1:10"],
                             spares=0, policy=SPIKE_POLICY)  # fmt: skip
        view = cp.views[faulty]
        assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
        [incident] = view.incidents.values()
        [decision] = incident.decisions
        skip = ",".join(f"{a}-{b}" for a, b in decision.skip)
        # Fault-free with the same policy (no spike found in a healthy loss), skipping what
        # the rollback skipped.
        clean_code = await run_job(settings, reference, reference_out, [], spares=0,
                                   policy=SPIKE_POLICY, example_args=("--skip-steps", skip))  # fmt: skip
        assert clean_code == 0 and cp.views[reference].incidents == {}
    assert code == 0
    assert incident.kind == "anomaly" and incident.anomaly_step == SPIKE_STEP + 1
    assert decision.mode == "rollback" and decision.restore_step == 20
    assert decision.skip == ((SPIKE_STEP + 1, SPIKE_STEP + 1),)
    assert timeline(incident).outcome == "recovered"

    log = pg_store.read(job_id=faulty)
    [detected] = [s.event.payload for s in log if s.event.type == "anomaly.detected"]
    assert (detected.kind, detected.step, detected.members) == ("loss_spike", SPIKE_STEP + 1, [])
    assert detected.loss is not None and detected.threshold is not None
    assert detected.loss > detected.threshold
    assert not [s for s in log if s.event.type in ("fault.detected", "train.anomaly")]
    assert all(batch.matches for batch in redecide(log))

    clean, rolled = torch.load(reference_out), torch.load(faulty_out)
    assert abs(rolled["loss"] - clean["loss"]) <= 0.01 * abs(clean["loss"]), (rolled, clean)
    for name, tensor in clean["params"].items():
        assert torch.equal(rolled["params"][name], tensor), name
