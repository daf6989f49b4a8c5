"""``elasticctl bench backup`` on a tiny model: security off and on in one run, through real
peer stores in a process of their own."""

from __future__ import annotations

import pytest

from rank_runtime.bench_backup import run_backup_bench


def test_security_off_and_on_are_measured_in_one_run():
    result = run_backup_bench(params_mb=0.05, steps=20, every=5, batch=8, security="both",
                              progress=False)  # fmt: skip
    assert result["security"] == "both" and result["replicas"] == 2
    assert result["replication_errors"] == 0
    for mode in ("off", "on"):
        assert result[f"step_s_backup_{mode}"] > 0 and result[f"replicate_s_{mode}"] > 0
        assert isinstance(result[f"overhead_{mode}"], float)
    ratio = result["step_s_backup_on"] / result["step_s_backup_off"] - 1
    assert result["security_cost"] == pytest.approx(ratio, abs=1e-3)
    assert result["within_10pct"] is (abs(ratio) <= 0.10)


def test_an_unknown_security_mode_is_refused():
    with pytest.raises(ValueError, match="security must be one of"):
        run_backup_bench(steps=10, security="maybe", progress=False)
