"""Fault specifications: parsing, carrying them to members, firing once per job."""

from __future__ import annotations

import pytest

from rank_runtime.faults import (
    RECOVER,
    FaultSpecError,
    RandomFaults,
    StepFault,
    claim,
    encode,
    from_env,
    inject,
    poisons,
)
from rank_runtime.faults import parse as parse_fault


def test_every_kind_parses_and_round_trips():
    specs = ["crash@50:rank=1", "hang@7:rank=0", "slow@3:rank=2:1.5", "crash@recover:rank=3",
             "nan@25:rank=1"]  # fmt: skip
    parsed = [parse_fault(s) for s in specs]
    assert parsed == [StepFault("crash", 50, 1), StepFault("hang", 7, 0),
                      StepFault("slow", 3, 2, 1.5), StepFault("crash", RECOVER, 3),
                      StepFault("nan", 25, 1)]  # fmt: skip
    assert encode([p for p in parsed if isinstance(p, StepFault)]) == ",".join(specs)
    assert from_env({"ELASTIC_FAULTS": ",".join(specs)}) == parsed
    assert parse_fault("random:every=30:seed=4") == RandomFaults(30.0, 4)
    assert parse_fault("random:every=2.5") == RandomFaults(2.5, 0)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("crash@x:rank=1", "expected crash@STEP"),
        ("slow@3:rank=1", "needs its seconds"),
        ("crash@3:rank=1:2", "only a slow step"),
        ("random:every=0", "every must be > 0"),
        ("explode@1:rank=0", "expected crash@STEP"),
        ("hang@recover:rank=0", "only a crash can fire on recovery"),
        ("nan@recover:rank=0", "only a crash can fire on recovery"),
        ("nan@3:rank=0:2", "only a slow step"),
        ("nan@serve:rank=0", "tampers with what it serves"),
        ("nan@3", "nan@STEP:rank=R"),
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
