"""Fault specifications: parsing, carrying them to members, firing once per job."""

from __future__ import annotations

import pytest

from rank_runtime.faults import (
    RECOVER,
    FaultSpecError,
    RandomFaults,
    Slowdown,
    StepFault,
    claim,
    encode,
    from_env,
    inject,
    poisons,
    slowdown,
    spike,
)
from rank_runtime.faults import parse as parse_fault


def test_every_kind_parses_and_round_trips():
    specs = ["crash@50:rank=1", "hang@7:rank=0", "slow@3:rank=2:1.5x", "slow@4:rank=1:2s",
             "slow@5:rank=0:2x:for=30", "crash@recover:rank=3", "nan@25:rank=1",
             "spike@25:rank=1:10"]  # fmt: skip
    parsed = [parse_fault(s) for s in specs]
    assert parsed == [StepFault("crash", 50, 1), StepFault("hang", 7, 0),
                      StepFault("slow", 3, 2, factor=1.5), StepFault("slow", 4, 1, seconds=2.0),
                      StepFault("slow", 5, 0, factor=2.0, duration=30.0),
                      StepFault("crash", RECOVER, 3), StepFault("nan", 25, 1),
                      StepFault("spike", 25, 1, factor=10.0)]  # fmt: skip
    assert encode([p for p in parsed if isinstance(p, StepFault)]) == ",".join(specs)
    # The factor's ``x`` may be left out: ``slow@STEP:rank=R:FACTOR``.
    assert parse_fault("slow@20:rank=1:1.5") == StepFault("slow", 20, 1, factor=1.5)
    assert from_env({"ELASTIC_FAULTS": ",".join(specs)}) == parsed
    assert parse_fault("random:every=30:seed=4") == RandomFaults(30.0, 4)
    assert parse_fault("random:every=2.5") == RandomFaults(2.5, 0)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("crash@x:rank=1", "expected crash@STEP"),
        ("slow@3:rank=1", "needs its factor"),
        ("slow@3:rank=1:1", "above 1"),
        ("slow@3:rank=1:101", "at most 100"),
        ("slow@3:rank=1:0s", "needs its seconds"),
        ("slow@3:rank=1:2s:for=5", "takes no for="),
        ("slow@3:rank=1:1.5:for=0", "for= must be > 0"),
        ("slow@3:rank=1:1.5:for=x", "expected crash@STEP"),
        ("crash@3:rank=1:2", "only a slow step"),
        ("hang@3:rank=1:for=2", "only a slow step"),
        ("random:every=0", "every must be > 0"),
        ("explode@1:rank=0", "expected crash@STEP"),
        ("hang@recover:rank=0", "only a crash can fire on recovery"),
        ("nan@recover:rank=0", "only a crash can fire on recovery"),
        ("nan@3:rank=0:2", "only a slow step"),
        ("nan@serve:rank=0", "tampers with what it serves"),
        ("nan@3", "nan@STEP:rank=R"),
        ("spike@3:rank=0", "needs its factor"),
        ("spike@3:rank=0:1", "above 1"),
        ("spike@3:rank=0:2s", "needs its factor"),
        ("spike@3:rank=0:2:for=3", "needs its factor"),
        ("spike@recover:rank=0:2", "fires after a step"),
    ],
)
def test_bad_specs_say_what_is_expected(spec, says):
    with pytest.raises(FaultSpecError, match=says):
        parse_fault(spec)


def test_a_fault_fires_once_per_job(tmp_path):
    fault = StepFault("crash", 5, 1)
    assert claim(fault, str(tmp_path))
    assert not claim(fault, str(tmp_path))  # the rank that replays step 5 does not crash again
    assert claim(StepFault("crash", 5, 2), str(tmp_path))
    assert claim(fault, None)  # without a directory there is no memory


def test_a_nan_fault_spoils_its_step_once_and_is_no_signal(tmp_path):
    faults = [StepFault("nan", 25, 1)]
    assert not poisons(faults, 24, 1, str(tmp_path))
    assert not poisons(faults, 25, 0, str(tmp_path))
    inject(faults, 25, 1, str(tmp_path))  # not a crash: the step's own check fires it
    assert poisons(faults, 25, 1, str(tmp_path))
    assert not poisons(faults, 25, 1, str(tmp_path))  # a replay of step 25 is clean


def test_a_spike_fires_once_on_its_rank_after_its_step_and_is_no_signal(tmp_path):
    faults = [parse_fault("spike@25:rank=1:10")]
    assert spike(faults, 24, 1, str(tmp_path)) == 1.0
    assert spike(faults, 25, 0, str(tmp_path)) == 1.0
    inject(faults, 25, 1, str(tmp_path))  # not a crash: the member multiplies its parameters
    assert spike(faults, 25, 1, str(tmp_path)) == 10.0
    assert spike(faults, 25, 1, str(tmp_path)) == 1.0  # a replay of step 25 is clean


def test_a_lasting_slowdown_fires_once_and_sleeps_its_share_of_each_step(tmp_path):
    faults = [parse_fault("slow@5:rank=1:1.5:for=10"), parse_fault("crash@9:rank=1")]
    assert slowdown(faults, 4, 1, str(tmp_path), now=0.0) is None  # not yet
    assert slowdown(faults, 5, 0, str(tmp_path), now=0.0) is None  # another rank
    slow = slowdown(faults, 5, 1, str(tmp_path), now=100.0)
    assert slow is not None and slow.factor == 1.5 and slow.until == 110.0
    assert slow.pause(0.2, now=105.0) == pytest.approx(0.1)  # (1.5 - 1) x its compute time
    assert slow.pause(0.2, now=110.0) == 0.0  # its for= is over
    # The spare that takes rank 1 and replays step 5 after a recovery is not slow.
    assert slowdown(faults, 5, 1, str(tmp_path), now=120.0) is None
    assert Slowdown(2.0).pause(0.3, now=1e9) == pytest.approx(0.3)  # no for=: until the end
