"""``pdserve bench migration``'s pure parts: the per-cell summary of its trials (medians,
the stall over the stream's ITL, failed trials kept apart), the table and the plot."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from bench.live.migration import Trial, plot, summarize
from pdserve.commands.bench_migration import _ints, table


def trials() -> list[Trial]:
    parts = {"detect_s": 0.001, "prefill_s": 0.02, "first_token_s": 0.03}
    return [
        Trial("prefill_cache", 256, 16, True, 0.05, 0.005, None, parts),
        Trial("prefill_cache", 256, 16, True, 0.07, 0.005, None, parts),
        Trial("prefill_cache", 256, 16, True, 0.06, 0.004, None, parts),
        Trial("recompute", 256, 16, False, float("nan"), float("nan"), "no [DONE]", None),
        Trial("recompute", 256, 16, True, 0.12, 0.006, None, parts | {"prefill_s": 0.0}),
    ]


def test_cells_take_medians_of_the_completed_trials_and_count_the_failed() -> None:
    rows = {r["variant"]: r for r in summarize(trials())}
    cached, recomputed = rows["prefill_cache"], rows["recompute"]
    assert (cached["trials"], cached["failed"]) == (3, 0)
    assert cached["stall_s"] == pytest.approx(0.06) and cached["itl_s"] == pytest.approx(0.005)
    assert cached["stall_over_itl"] == pytest.approx(12.0)
    assert cached["prefill_s"] == pytest.approx(0.02)
    assert (recomputed["trials"], recomputed["failed"]) == (2, 1)
    assert recomputed["stall_s"] == pytest.approx(0.12) and recomputed["prefill_s"] == 0.0


def test_the_table_and_the_plot(tmp_path: Path) -> None:
    res = {"rows": summarize(trials())}
    text = table(res)
    assert "prefill_cache" in text and "2/2" not in text and "1/2" in text and "3/3" in text
    out = tmp_path / "m.png"
    plot(res, out)
    assert out.stat().st_size > 1000


def test_the_grid_options_are_checked() -> None:
    assert _ints("256, 1024", "--prompts") == [256, 1024]
    for bad in ("", "a,2", "1"):
        with pytest.raises(typer.BadParameter):
            _ints(bad, "--prompts")
