"""Trace loaders (Mooncake, Azure) on the shipped copies and on bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.sim.profiles import load_profile
from bench.workloads.prefill_scenarios import azure_workload, mooncake_workload
from bench.workloads.traces import (
    TraceFormatError,
    TraceRequest,
    load_azure,
    load_mooncake,
    scale_arrivals,
)

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"
MOONCAKE = DATA / "mooncake" / "synthetic_trace.jsonl"
AZURE = DATA / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


def test_mooncake_shipped_trace() -> None:
    reqs = load_mooncake(MOONCAKE)
    assert len(reqs) == 3993
    assert reqs[0].arrival_s == 0.0
    times = [r.arrival_s for r in reqs]
    assert all(b > a for a, b in zip(times, times[1:], strict=False))  # ties were spread
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 512) for r in reqs)


def test_mooncake_ties_are_spread_over_the_gap(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 1000, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1000, "input_length": 10, "output_length": 1, "hash_ids": [2]}\n'
        '{"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": [3]}\n'
    )
    assert [r.arrival_s for r in load_mooncake(p)] == [0.0, 0.5, 1.0]
    assert [r.arrival_s for r in load_mooncake(p, spread_ties=False)] == [0.0, 0.0, 1.0]
    assert [r.hash_ids for r in load_mooncake(p, limit=2)] == [(1,), (2,)]


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"timestamp": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ("not json", "not JSON"),
    ],
)
def test_mooncake_bad_input_names_the_field(tmp_path: Path, line: str, field: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(TraceFormatError, match=field):
        load_mooncake(p)


def test_azure_shipped_trace() -> None:
    reqs = load_azure(AZURE)
    assert len(reqs) == 19366
    assert reqs[0] == TraceRequest(0.0, 374, 44)
    assert reqs[1].arrival_s == pytest.approx(4.314579)
    assert all(r.hash_ids == () for r in reqs)


def test_azure_bad_input_names_the_field(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,x,3\n")
    with pytest.raises(TraceFormatError, match="ContextTokens"):
        load_azure(p)
    p.write_text("TIMESTAMP,Tokens\n")
    with pytest.raises(TraceFormatError, match="missing column"):
        load_azure(p)


def test_scale_arrivals() -> None:
    r = [TraceRequest(2.0, 10, 1)]
    assert scale_arrivals(r, 0.5)[0].arrival_s == 1.0
    with pytest.raises(ValueError, match="factor"):
        scale_arrivals(r, 0)


def test_trace_workloads_cap_long_prompts_and_scale_load() -> None:
    prof = load_profile("a6000_llama31_8b")
    trace = load_mooncake(MOONCAKE, limit=60)
    w = mooncake_workload(trace, prof, load=0.5, max_context=8192)
    assert w.meta["capped"] == sum(1 for r in trace if r.input_tokens > 8192) > 0
    assert max(r.prompt_tokens for r in w.requests) == 8192
    assert all(len(r.block_hashes) == r.prompt_tokens // 512 for r in w.requests)
    w2 = mooncake_workload(trace, prof, load=1.0, max_context=8192)
    span = lambda wl: wl.requests[-1].arrival_s  # noqa: E731
    assert span(w) == pytest.approx(2 * span(w2))
    az = azure_workload(load_azure(AZURE, limit=50), prof, load=0.9)
    assert all(r.block_hashes == () for r in az.requests)
    assert any("cache-free" in n for n in az.notes)
