"""The one engine block of the profiler and the one-engine benchmarks (engines.session): the
engine it starts, and its shutdown however the block ends (no engine starts here)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import engines.session as session


class _Core:
    def __init__(self) -> None:
        self.stopped = 0

    def shutdown(self) -> None:
        self.stopped += 1


def _fake(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def make_llm(model: Any, **kw: Any) -> Any:
        seen.update(kw, model=model)
        seen["core"] = _Core()
        return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=seen["core"]))

    monkeypatch.setattr(session, "make_llm", make_llm)
    return seen


def test_the_engine_runs_fairway_in_fcfs_order_and_stops_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _fake(monkeypatch)
    with session.llm_session(
        "m", cache_dir="c", pdserve={"profile": {"x": 1}}, kv_blocks=8, max_num_seqs=4
    ) as llm:
        assert seen["core"].stopped == 0 and llm.llm_engine.engine_core is seen["core"]
    assert seen["core"].stopped == 1
    assert seen["scheduler_cls"] == "engines.scheduler.FairwayScheduler"
    assert seen["pdserve"] == {"prefill_policy": "fcfs", "profile": {"x": 1}}
    assert (seen["model"], seen["cache_dir"], seen["kv_blocks"], seen["max_num_seqs"]) == (
        "m",
        "c",
        8,
        4,
    )


def test_the_engine_stops_when_the_measurement_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fake(monkeypatch)
    with pytest.raises(RuntimeError), session.llm_session("m", cache_dir="c"):
        raise RuntimeError("the run failed")
    assert seen["core"].stopped == 1
    assert seen["pdserve"] == {"prefill_policy": "fcfs"}
