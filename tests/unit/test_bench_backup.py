"""``elasticctl bench backup``: the sizing formula against a hand computation; the DDP example
on real gloo ranks (the model's bytes are not what goes to peers; what does is R times the
unique snapshot); the mlp bench with security off and on in one run, through real peer stores
in a process of their own."""

from __future__ import annotations

import pytest

from rank_runtime.bench_backup import run_backup_bench, sizing


def test_the_formula_for_ddp_with_zero():
    # 1,000 parameters, fp32 (4 B), Adam (8 B/param), 4 ranks, 2 peers, 2 steps kept.
    got = sizing("zero", params=1000, param_bytes=4, optimizer_bytes=8, world=4, redundancy=2)
    unique, replicated = 8 * 1000 / 4, 4 * 1000
    assert got["unique"] == unique == 2000
    assert got["replicated"] == replicated
    assert got["sent_per_backup"] == 2 * unique
    assert got["own_unique"] == 2 * unique and got["own_replicated"] == 2 * replicated
    # Per shard held: 2 steps kept and the buffer the next copy arrives in; nothing serialized.
    assert got["held"] == 3 * 2 * unique and got["sending"] == 0
    assert got["total"] == 2 * unique + 2 * replicated + 6 * unique == 24_000


def test_the_formula_for_fsdp_plain_ddp_and_an_uneven_zero_partition():
    seven_b = sizing("sharded", params=7e9, param_bytes=2, optimizer_bytes=8, world=64,
                     redundancy=2)  # fmt: skip
    assert seven_b["unique"] == pytest.approx(10 * 7e9 / 64)
    assert seven_b["replicated"] == 0
    assert seven_b["total"] == pytest.approx(8 * 10 * 7e9 / 64)  # (2 + 3R) U
    plain = sizing("replicated", params=100, param_bytes=4, optimizer_bytes=8, world=8,
                   redundancy=2)  # fmt: skip
    assert plain["unique"] == 0 and plain["sent_per_backup"] == 0
    assert plain["total"] == 2 * 12 * 100
    uneven = sizing("zero", params=100, param_bytes=4, optimizer_bytes=8, world=4,
                    redundancy=1, partition=70, held_unique=8 * 10)  # fmt: skip
    assert uneven["unique"] == 8 * 70 and uneven["held"] == 3 * 80
    with pytest.raises(ValueError, match="kind must be one of"):
        sizing("tp", params=1, param_bytes=4, optimizer_bytes=8, world=1, redundancy=0)


def test_the_ddp_example_sends_no_model_bytes_only_the_unique_state():
    result = run_backup_bench(example="ddp", params_mb=0.2, world=3, steps=20, every=5,
                              replicas=2, progress=False)  # fmt: skip
    assert result["kind"] == "zero" and result["world"] == 3 and result["redundancy"] == 2
    # The model is searched for in what was sent and held, and found where it is kept.
    assert result["model_replicated"] is False
    assert result["model_chunks"] > 0
    assert result["model_chunks_in_sent"] == 0 and result["model_chunks_in_held"] == 0
    assert result["model_chunks_in_own_replicated"] == result["model_chunks"]
    assert result["sent_keys"] == ["rng", "state", "zero"]
    # What goes to peers per backup: R times the unique snapshot, nothing else.
    assert result["bytes_replicated_per_backup"] == [2 * b for b in result["unique_bytes"]]
    # The formula predicts the sum within the snapshots' fixed costs (RNG, headers: ~6 KB).
    total, formula = (result["bytes_replicated_per_backup_total"],
                      result["formula_bytes_replicated_per_backup_total"])  # fmt: skip
    assert formula <= total <= formula + 2 * 3 * 8 * 1024
    # ZeRO's partitions together hold every parameter's Adam state, once.
    assert sum(result["partition_params"]) == result["params"]
    assert sum(result["zero_tensor_bytes"]) >= 8 * result["params"]
    for measured in result["backup_memory"]:
        assert measured["replicated"] >= 2 * result["model_bytes"]
        assert measured["total"] == (measured["unique"] + measured["replicated"]
                                     + measured["held"] + measured["sending"])  # fmt: skip


def test_security_off_and_on_are_measured_in_one_run():
    result = run_backup_bench(params_mb=0.05, steps=20, every=5, batch=8, security="both",
                              progress=False)  # fmt: skip
    assert result["security"] == "both" and result["replicas"] == 2
    assert result["replication_errors"] == 0
    for mode in ("off", "on"):
        assert result[f"step_s_backup_{mode}"] > 0 and result[f"replicate_s_{mode}"] > 0
        assert isinstance(result[f"overhead_{mode}"], float)
    on, off = result["step_s_backup_on"], result["step_s_backup_off"]
    ratio = on / off - 1
    # Both step times are rounded to 1e-6 s (steps of a few ms here): the ratio from them is
    # off by up to that much relative to each, besides security_cost's own 4 digits.
    slack = (1 + ratio) * 0.5e-6 * (1 / on + 1 / off) + 0.5e-4
    assert result["security_cost"] == pytest.approx(ratio, abs=slack)
    assert result["within_10pct"] is (abs(ratio) <= 0.10)


def test_an_unknown_security_mode_or_example_is_refused():
    with pytest.raises(ValueError, match="security must be one of"):
        run_backup_bench(example="mlp", steps=10, security="maybe", progress=False)
    with pytest.raises(ValueError, match="security applies to --example mlp"):
        run_backup_bench(example="ddp", steps=10, security="on", progress=False)
    with pytest.raises(ValueError, match="example must be one of"):
        run_backup_bench(example="gpt5", progress=False)


# torch.distributed.optim scripts its functional optimizers when first imported.
@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
def test_the_transformer_counts_what_the_step_waits_for_the_copy_left_to_a_thread():
    result = run_backup_bench(example="transformer", params_mb=1.0, steps=40, every=5, rounds=2,
                              progress=False)  # fmt: skip
    assert result["kind"] == "sharded" and result["replication_errors"] == 0
    # Parameters and both AdamW moments, as the formula says, and the RNG and sampler beside.
    assert 0 <= result["unique_bytes"] - result["formula_unique_bytes"] < 32 * 1024
    assert result["take_s"] > 0 and result["settle_s"] >= 0 and result["snapshot_gbps"] > 0
    # The blocking figure is the take and the settle together (a median of their sums).
    blocking = result["blocking_ms_per_gb"] * result["unique_bytes"] / 1e12
    assert blocking >= result["take_s"] * 0.999
    assert result["take_share"] == pytest.approx(
        blocking / (result["every"] * result["step_s_no_backup"]), abs=1e-4
    )
