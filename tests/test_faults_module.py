"""tokenmill/faults.py: the fault-point spec and when a point triggers."""

from __future__ import annotations

import pytest

from tokenmill import faults


@pytest.fixture
def armed(monkeypatch):
    def arm(text):
        monkeypatch.setenv(faults.ENV_VAR, text)
        faults.reset()

    yield arm
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    faults.reset()


def test_parse():
    assert faults.FaultSpec.parse("write@/results/:3") == faults.FaultSpec(
        "write", "/results/", 3, "kill"
    )
    assert faults.FaultSpec.parse("engine_step:2+:raise").repeat
    for bad in ("write", "write:0", "write:x", "write:1:explode", ":1"):
        with pytest.raises(ValueError, match="TOKENMILL_FAULT_POINT"):
            faults.FaultSpec.parse(bad)


def test_triggers_once_on_the_counted_matching_call(armed):
    armed("write@/results/:2:raise")
    faults.fault_point("write", "out/_plan/a.parquet")  # does not match the substring
    faults.fault_point("write", "out/results/a.parquet")  # 1st
    faults.fault_point("plan_window")  # another point
    with pytest.raises(faults.FaultInjected, match="write"):
        faults.fault_point("write", "out/results/b.parquet")  # 2nd
    faults.fault_point("write", "out/results/c.parquet")  # 3rd: once only


def test_repeat_triggers_from_the_count_on(armed):
    armed("engine_step:2+:raise")
    faults.fault_point("engine_step")
    for _ in range(3):
        with pytest.raises(faults.FaultInjected):
            faults.fault_point("engine_step")


def test_inert_when_unset(armed, monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    faults.reset()
    for _ in range(5):
        faults.fault_point("engine_step")
