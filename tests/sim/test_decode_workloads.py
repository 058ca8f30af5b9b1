"""Decode workloads: the paper's GSM8K classes, the synthetic mixes, trace rescaling."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workloads.decode import from_trace, paper, synthetic
from bench.workloads.traces import TraceRequest


def test_paper_prompt_classes_and_gsm8k_outputs() -> None:
    reqs = paper(0, duration_s=10.0)
    assert 120 < len(reqs) < 240  # Poisson 18/s over 10 s
    p = np.array([r.prompt_tokens for r in reqs])
    in_class = ((p >= 30) & (p <= 80)) | ((p >= 120) & (p <= 250)) | ((p >= 350) & (p <= 512))
    assert in_class.mean() > 0.97
    assert 0.45 < ((p >= 30) & (p <= 80)).mean() < 0.75
    o = np.array([r.output_tokens for r in reqs])
    assert o.min() >= 20 and 60 < o.mean() < 140  # GSM8K answers, ~100 tokens
    assert all(r.max_tokens >= r.output_tokens for r in reqs)


def test_synthetic_mix_and_burst_rate() -> None:
    reqs = synthetic("medium", 20.0, 1, 60.0)
    assert {r.prompt_tokens for r in reqs} <= {50, 200, 800}
    assert {r.output_tokens for r in reqs} <= {20, 50, 200}
    assert len(reqs) / 60.0 == pytest.approx(0.6 * 20.0, rel=0.15)
    b = synthetic("burst", 20.0, 1, 90.0)
    t = np.array([r.arrival_s for r in b])
    in_burst = (t % 30.0) >= 20.0
    rate_in, rate_out = in_burst.sum() / 30.0, (~in_burst).sum() / 60.0
    assert rate_in / rate_out == pytest.approx(2.0, rel=0.3)
    with pytest.raises(ValueError, match="unknown synthetic scenario"):
        synthetic("paper", 1.0, 0)


def test_from_trace_rescales_to_the_target_rate() -> None:
    recs = [TraceRequest(float(i), 100, 10) for i in range(101)]
    out = from_trace(recs, 4.0, 0)
    assert out[-1].arrival_s == pytest.approx(25.0)
    assert from_trace(recs, None, 0)[-1].arrival_s == pytest.approx(100.0)
