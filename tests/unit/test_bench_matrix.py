"""``pdserve bench compare --matrix`` (bench.live.matrix): cells, run order, rates, aggregation,
goals and the report, with the live per-system run stood in by a function."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import pdserve.cli  # noqa: F401  (registers the commands)
from bench.live import matrix as mx
from bench.live.matrix import Cell, parse_cells
from bench.workloads.replay import LiveRequest
from pdserve.apps import app

runner = CliRunner()
BASE: dict[str, Any] = {
    "applications": [{"args": {"prefill": {"num_replicas": 2}, "decode": {"num_replicas": 1}}}]
}


def test_all_cells_are_layout_x_load_x_workload() -> None:
    cells = mx.all_cells()
    assert len(cells) == 2 * 4 * 4 == len(set(cells))
    assert Cell("two_prefill", "open0.9", "burst") in cells
    assert parse_cells(None) == cells and parse_cells(" ") == cells


def test_cells_parse_names_and_wildcards() -> None:
    got = parse_cells("two_prefill/closed8/rag, pair/open0.9/burst")
    assert [c.name for c in got] == ["two_prefill/closed8/rag", "pair/open0.9/burst"]
    assert got[1].load_factor == 0.9 and got[1].concurrency is None
    assert got[0].concurrency == 8 and got[0].load_factor is None
    wild = parse_cells("pair/*/rag,pair/closed8/rag")  # a repeat is kept once
    assert [c.load for c in wild] == ["closed8", "open0.5", "open0.9", "open1.2"]


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("pair/open0.7/rag", "'open0.7'"),
        ("three/closed8/rag", "'three'"),
        ("pair/closed8/chat", "'chat'"),
        ("pair/closed8", "pair/closed8"),
    ],
)
def test_a_bad_cell_is_an_error_naming_it(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match="bad cell") as e:
        parse_cells(f"pair/closed8/rag,{spec}")
    assert named in str(e.value) and "pair/closed8/rag'" not in str(e.value)


def test_the_cli_refuses_a_bad_cell_with_exit_2_before_anything_starts(tmp_path: Path) -> None:
    r = runner.invoke(
        app,
        ["bench", "compare", "--matrix", "--out", str(tmp_path), "--cells", "pair/open2/rag"],
    )
    assert r.exit_code == 2, r.output
    assert "pair/open2/rag" in r.output and "--cells" in r.output
    r = runner.invoke(
        app, ["bench", "compare", "--matrix", "--out", str(tmp_path), "--systems", "pdserve"]
    )
    assert r.exit_code == 2 and "peer-connector" in r.output
    r = runner.invoke(app, ["bench", "compare", "--matrix", "--out", str(tmp_path), "--rate", "2"])
    assert r.exit_code == 2 and "--rate" in r.output
    assert not any(tmp_path.iterdir())


def test_the_order_alternates_between_repeats() -> None:
    assert mx.run_order(["A", "B"], 4) == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    assert mx.run_order(["A", "B", "C"], 2) == [["A", "B", "C"], ["C", "B", "A"]]
    with pytest.raises(ValueError):
        mx.run_order(["A", "B"], 0)


def test_closed_cells_run_before_the_open_cells_they_set_the_rate_of() -> None:
    cells = parse_cells("pair/open0.5/rag,pair/closed8/rag,pair/open1.2/rag")
    assert [c.load for c in mx.schedule(cells)] == ["closed8", "open0.5", "open1.2"]


def test_layouts_set_the_replica_counts_and_leave_the_base_alone() -> None:
    cfg = mx.layout_config(BASE, "pair")
    assert cfg["applications"][0]["args"]["prefill"]["num_replicas"] == 1
    assert BASE["applications"][0]["args"]["prefill"]["num_replicas"] == 2
    assert mx.LAYOUTS["two_prefill"] == (2, 1)


def test_cache_pressure_arithmetic() -> None:
    # the bench model in float32: 2 x 6 layers x 4 KV heads x 64 x 4 bytes
    per_token = mx.kv_bytes_per_token(6, 4, 64, 4)
    assert per_token == 12288
    p = mx.cache_pressure_mix(2**30, per_token)
    assert p.tokens_per_replica == 87381 and p.doc_tokens == 1536
    assert p.tokens_per_replica < p.working_set_tokens < 2 * p.tokens_per_replica
    assert p.documents == 86 and p.requests == 172
    reqs = mx.workload_requests(Cell("two_prefill", "open0.9", "cache_pressure"), 1.0, 0,
                                pressure=p)  # fmt: skip
    touched = {r.label for r in reqs}
    assert len(touched) * p.doc_tokens > p.tokens_per_replica


def test_multi_tenant_floods_at_ten_times_the_quiet_rate() -> None:
    reqs = mx.workload_requests(Cell("pair", "open0.9", "multi_tenant"), 2.2, 0)
    quiet = [r for r in reqs if r.label == "tenant:quiet"]
    flood = [r for r in reqs if r.label == "tenant:flood"]
    assert len(flood) == 10 * len(quiet)
    assert [r.at_s for r in reqs] == sorted(r.at_s for r in reqs)
    keyed = mx.with_keys(reqs, {"quiet": "kq", "flood": "kf"})
    assert {r.key for r in keyed if r.label == "tenant:quiet"} == {"kq"}
    assert {r.key for r in keyed if r.label == "tenant:flood"} == {"kf"}
    assert all(r.key is None for r in mx.with_keys(keyed, None))


def test_burst_keeps_its_spike_and_takes_the_cells_mean_rate() -> None:
    reqs = mx.workload_requests(Cell("pair", "open0.9", "burst"), 2.0, 0)
    assert (len(reqs) - 1) / reqs[-1].at_s == pytest.approx(2.0)
    spike = [r.at_s for r in reqs if r.label.startswith("spike")]
    calm = [r.at_s for r in reqs if r.label.startswith("calm")]
    spike_rate = (len(spike) - 1) / (spike[-1] - spike[0])
    calm_rate = (len(calm) - 1) / (calm[-1] - calm[0])
    assert spike_rate > 2 * calm_rate


def test_open_rates_come_from_the_peers_closed_loop_capacity_and_arrivals_are_shared(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, str, int, list[LiveRequest], int | None]] = []

    def stand_in(system: str, cell: Cell, cfg: dict, reqs: list[LiveRequest],
                 conc: int | None, out: Path) -> dict[str, Any]:  # fmt: skip
        rep = sum(1 for s in seen if s[0] == system and s[1] == cell.name)
        seen.append((system, cell.name, rep, reqs, conc))
        # the peer completes 2 requests/s closed-loop (then 4, 3: median 3)
        rps = {0: 2.0, 1: 4.0, 2: 3.0}[rep] if system == mx.REFERENCE else 9.0
        return _figs(rps=rps)

    built: list[tuple[str, float | None, int]] = []

    def build(cell: Cell, rate: float | None, seed: int) -> list[LiveRequest]:
        built.append((cell.name, rate, seed))
        return mx.workload_requests(cell, rate, seed)

    res = mx.run_matrix(
        parse_cells("pair/open0.5/rag,pair/closed8/rag"), tmp_path, run_system=stand_in,
        build=build, base=BASE, repeats=3, seed=7, progress=False,
    )  # fmt: skip
    assert res["capacity_rps"] == {"pair/closed8/rag": 3.0}  # the peer's, not pdserve's 9
    assert res["cells"]["pair/open0.5/rag"]["rate_rps"] == pytest.approx(1.5)
    assert built == [("pair/closed8/rag", None, s) for s in (7, 8, 9)] + [
        ("pair/open0.5/rag", pytest.approx(1.5), s) for s in (7, 8, 9)
    ]
    for cell in ("pair/closed8/rag", "pair/open0.5/rag"):
        for rep in range(3):
            pair = [s[3] for s in seen if s[1] == cell and s[2] == rep]
            assert len(pair) == 2 and pair[0] == pair[1]  # same prompts, same arrival times
    open_runs = [s for s in seen if s[1] == "pair/open0.5/rag"]
    assert all(s[4] is None for s in open_runs)
    reqs = open_runs[0][3]
    assert (len(reqs) - 1) / reqs[-1].at_s == pytest.approx(1.5, rel=0.25)
    # ABA order: pdserve first in repeats 1 and 3, the peer first in repeat 2
    order = [s[0] for s in seen if s[1] == "pair/closed8/rag"]
    assert order == ["pdserve", mx.REFERENCE, mx.REFERENCE, "pdserve", "pdserve", mx.REFERENCE]
    assert res["order"] == ["AB", "BA", "AB"]


def test_an_open_cell_runs_its_closed_cell_whole_first_and_draws_from_every_repeat(
    tmp_path: Path,
) -> None:
    calls: list[tuple[str, str]] = []

    def stand_in(system: str, cell: Cell, cfg: dict, reqs: list, conc: int | None,
                 out: Path) -> dict[str, Any]:  # fmt: skip
        calls.append((system, cell.name))
        rep = sum(1 for c in calls if c == (system, cell.name)) - 1
        return _figs(rps=(4.0, 6.0)[rep] if system == mx.REFERENCE else 9.0)

    res = mx.run_matrix(
        parse_cells("two_prefill/open1.2/rag"), tmp_path, run_system=stand_in,
        build=lambda c, r, s: mx.workload_requests(c, r, s), base=BASE, repeats=2,
        progress=False,
    )  # fmt: skip
    closed, opened = "two_prefill/closed8/rag", "two_prefill/open1.2/rag"
    # the closed cell runs whole, in its AB/BA order, before the open cell
    assert calls == [
        ("pdserve", closed), (mx.REFERENCE, closed), (mx.REFERENCE, closed), ("pdserve", closed),
        ("pdserve", opened), (mx.REFERENCE, opened), (mx.REFERENCE, opened), ("pdserve", opened),
    ]  # fmt: skip
    # the median of both repeats (4, 6), not the first run's 4: 1.2 x 5
    assert res["cells"][opened]["rate_rps"] == pytest.approx(6.0)
    assert res["cells"][closed]["status"] == "ok" and res["capacity_runs"] == []
    # no rate from fewer than every repeat of the reference
    one = [{"system": mx.REFERENCE, "repeat": 0, "figures": _figs(rps=4.0)}]
    assert mx.closed_capacity(one, 2) is None and mx.closed_capacity(one, 1) == 4.0
    gap = [*one, {"system": mx.REFERENCE, "repeat": 2, "figures": _figs(rps=6.0)}]
    assert mx.closed_capacity(gap, 2) is None and mx.closed_capacity(gap, 3) is None


def test_redo_runs_cells_again_and_an_open_cell_draws_its_rate_anew(tmp_path: Path) -> None:
    cap = {"rps": 2.0}
    ran: list[str] = []

    def stand_in(system: str, cell: Cell, cfg: dict, reqs: list, conc: int | None,
                 out: Path) -> dict[str, Any]:  # fmt: skip
        ran.append(cell.name)
        out.mkdir(parents=True)  # as the live runner's records
        return _figs(rps=cap["rps"] if system == mx.REFERENCE else 5.0)

    def go(cells: str, **kw: Any) -> dict[str, Any]:
        ran.clear()
        return mx.run_matrix(
            parse_cells(cells), tmp_path, run_system=stand_in,
            build=lambda c, r, s: mx.workload_requests(c, r, s, limit=4), base=BASE,
            repeats=1, progress=False, **kw,
        )  # fmt: skip

    res = go("pair/open0.9/rag")
    assert res["cells"]["pair/open0.9/rag"]["rate_rps"] == pytest.approx(1.8)
    # the closed cell again, at a new capacity: the open cell keeps its rate, and the report
    # says how far it now stands from today's capacity
    cap["rps"] = 4.0
    res = go("pair/closed8/rag", resume=True, redo=True)
    assert ran == ["pair/closed8/rag"] * 2
    assert res["capacity_rps"]["pair/closed8/rag"] == 4.0
    assert res["cells"]["pair/open0.9/rag"]["rate_rps"] == pytest.approx(1.8)
    assert len(res["replaced"]["pair/closed8/rag"]) == 1
    assert (tmp_path / "pair-closed8-rag.replaced1" / "r0-pdserve").is_dir()
    assert (tmp_path / "pair-closed8-rag" / "r0-pdserve").is_dir()
    md = (tmp_path / "report.md").read_text()
    assert "pair/open0.9/rag drawn at 2.000 (now 4.000, 0.50x)" in md
    # the open cell again: its rate from today's capacity, and no drift left to report
    res = go("pair/open0.9/rag", resume=True, redo=True)
    assert ran == ["pair/open0.9/rag"] * 2
    assert res["cells"]["pair/open0.9/rag"]["rate_rps"] == pytest.approx(3.6)
    assert res["replaced"]["pair/open0.9/rag"][0]["rate_rps"] == pytest.approx(1.8)
    assert len(res["replaced"]["pair/closed8/rag"]) == 1  # earlier attempts are kept
    md = (tmp_path / "report.md").read_text()
    assert "drawn at" not in md and "pair/closed8/rag (1x), pair/open0.9/rag (1x)" in md
    # the CLI: --redo needs a matrix to resume and the cells to run again
    for args in (["--redo"], ["--redo", "--resume"], ["--redo", "--cells", "pair/closed8/rag"]):
        r = runner.invoke(app, ["bench", "compare", "--matrix", "--out", str(tmp_path), *args])
        assert r.exit_code == 2 and "needs --resume and --cells" in r.output, r.output


def test_redo_repeat_runs_one_repeat_again_on_the_same_arrivals(tmp_path: Path) -> None:
    ran: list[tuple[str, int, str]] = []
    arrivals: dict[tuple[str, int], list] = {}

    def stand_in(system: str, cell: Cell, cfg: dict, reqs: list, conc: int | None,
                 out: Path) -> dict[str, Any]:  # fmt: skip
        rep = int(out.name.split("-")[0][1:])
        ran.append((cell.name, rep, system))
        if [r.at_s for r in reqs] != arrivals.setdefault((cell.name, rep), [r.at_s for r in reqs]):
            raise AssertionError("a repeat run again on other arrivals")  # recorded as failed
        out.mkdir(parents=True)
        return _figs(rps=2.0 if system == mx.REFERENCE else 3.0)

    def go(cells: str, **kw: Any) -> dict[str, Any]:
        ran.clear()
        return mx.run_matrix(
            parse_cells(cells) if cells else [], tmp_path, run_system=stand_in,
            build=lambda c, r, s: mx.workload_requests(c, r, s, limit=4), base=BASE,
            repeats=3, progress=False, **kw,
        )  # fmt: skip

    res = go("pair/open0.9/rag")
    assert not [r for c in res["cells"].values() for r in c["runs"] if r.get("error")]
    rate = mx.previous_matrix(tmp_path, mx.DEFAULT_SYSTEMS, 0)["cells"]["pair/open0.9/rag"]
    # the second repeat of the open cell again, in that repeat's order (BA), and nothing else
    res = go("", resume=True, redo_repeats=mx.parse_repeats("pair/open0.9/rag#2", 3))
    order = mx.run_order(mx.DEFAULT_SYSTEMS, 3)[1]
    assert ran == [("pair/open0.9/rag", 1, s) for s in order]
    cell = res["cells"]["pair/open0.9/rag"]
    assert cell["rate_rps"] == rate["rate_rps"] and not [r for r in cell["runs"] if r.get("error")]
    assert sorted((r["repeat"], r["system"]) for r in cell["runs"]) == sorted(
        (rep, s) for rep in range(3) for s in mx.DEFAULT_SYSTEMS
    )
    (kept,) = res["replaced"]["pair/open0.9/rag"]
    assert kept["repeat"] == 1 and {r["system"] for r in kept["runs"]} == set(order)
    folder = tmp_path / "pair-open0.9-rag"
    assert {p.name for p in folder.iterdir() if "replaced" in p.name} == {
        f"r1-{s}.replaced1" for s in order
    }
    assert "pair/open0.9/rag #2 (1x)" in (tmp_path / "report.md").read_text()
    # again: a second attempt of the same repeat keeps the first
    res = go("", resume=True, redo_repeats=mx.parse_repeats("pair/open0.9/rag #2", 3))
    assert len(res["replaced"]["pair/open0.9/rag"]) == 2
    assert (folder / f"r1-{order[0]}.replaced2").is_dir()
    assert "pair/open0.9/rag #2 (2x)" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("pair/closed8/rag#4", "N from 1 to 3"),
        ("pair/closed8/rag", "expected layout/load/workload#N"),
        ("pair/*/rag#1", "expected layout/load/workload#N"),
        ("pair/closed9/rag#1", "unknown load 'closed9'"),
    ],
)
def test_a_bad_redo_repeat_is_an_error_naming_it(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match="bad repeat") as e:
        mx.parse_repeats(spec, 3)
    assert spec in str(e.value) and named in str(e.value)


def test_the_cli_redo_repeat_needs_resume_and_a_good_repeat(tmp_path: Path) -> None:
    def compare(*args: str) -> Any:
        return runner.invoke(app, ["bench", "compare", "--out", str(tmp_path), *args])

    r = compare("--matrix", "--redo-repeat", "pair/closed8/rag#1")
    assert r.exit_code == 2 and "needs --resume" in r.output, r.output
    r = compare("--matrix", "--resume", "--redo-repeat", "pair/closed8/rag#7")
    assert r.exit_code == 2 and "N from 1 to 3" in r.output, r.output
    r = compare("--redo-repeat", "pair/closed8/rag#1")
    assert r.exit_code == 2 and "--redo-repeat: only with" in r.output, r.output


def _figs(rps: float = 1.0, **over: float | None) -> dict[str, Any]:
    f: dict[str, Any] = {
        "throughput": 100.0,
        "requests_per_s": rps,
        "ttft_p50": 1.0,
        "ttft_p99": 2.0,
        "itl_p99": 0.1,
        "cached_token_ratio": 0.5,
        "quiet_ttft_p99": None,
        "errors": 0,
    }
    return f | over


def test_median_and_spread_of_paired_ratios_worked_example() -> None:
    # pdserve's TTFT p99 over the peer's, paired by repeat: 1/2, 3/2, 2/4 -> 0.5, 1.5, 0.5
    runs = [
        {"system": "pdserve", "repeat": 0, "figures": _figs(ttft_p99=1.0)},
        {"system": mx.REFERENCE, "repeat": 0, "figures": _figs(ttft_p99=2.0)},
        {"system": mx.REFERENCE, "repeat": 1, "figures": _figs(ttft_p99=2.0)},
        {"system": "pdserve", "repeat": 1, "figures": _figs(ttft_p99=3.0)},
        {"system": "pdserve", "repeat": 2, "figures": _figs(ttft_p99=2.0)},
        {"system": mx.REFERENCE, "repeat": 2, "figures": _figs(ttft_p99=4.0)},
        # a repeat where the peer failed pairs with nothing
        {"system": "pdserve", "repeat": 3, "figures": _figs(ttft_p99=100.0)},
        {"system": mx.REFERENCE, "repeat": 3, "figures": None, "error": "x"},
    ]
    r = mx.cell_ratios(runs, "pdserve")
    assert r["ttft_p99"] == {"median": 0.5, "min": 0.5, "max": 1.5, "n": 3}
    assert r["throughput"]["median"] == 1.0
    assert r["quiet_ttft_p99"] == {"median": None, "min": None, "max": None, "n": 0}
    assert mx.spread([4.0, 1.0, 2.0, 3.0]) == {"median": 2.5, "min": 1.0, "max": 4.0, "n": 4}
    # a run recorded before ``served`` was a figure: its requests less its errors
    old = [
        {"system": "pdserve", "repeat": 0, "figures": {"requests": 132, "errors": 1}},
        {"system": mx.REFERENCE, "repeat": 0, "figures": {"requests": 132, "errors": 0}},
    ]
    assert mx.cell_ratios(old, "pdserve")["served"]["median"] == 131 / 132


def test_goal_verdicts() -> None:
    ok = {"throughput": 1.1, "ttft_p50": 0.6, "ttft_p99": 0.69, "quiet_ttft_p99": 0.4}
    g = mx.goals(Cell("two_prefill", "open0.9", "cache_pressure"), ok)
    assert g == {
        "throughput >= 1.0x": True,
        "ttft_p50 <= 1.0x": True,
        "ttft_p99 <= 1.0x": True,
        "ttft_p50 <= 0.7x": True,
        "ttft_p99 <= 0.7x": True,
    }
    g = mx.goals(Cell("two_prefill", "open0.9", "burst"), ok | {"ttft_p99": 0.8})
    assert g["ttft_p99 <= 1.0x"] is True and g["ttft_p99 <= 0.7x"] is False
    g = mx.goals(Cell("pair", "open0.9", "burst"), ok)  # the 0.7x goal is two_prefill's
    assert "ttft_p50 <= 0.7x" not in g
    g = mx.goals(Cell("pair", "closed8", "rag"), {"throughput": 0.99, "ttft_p50": None})
    assert g == {"throughput >= 1.0x": False, "ttft_p50 <= 1.0x": None, "ttft_p99 <= 1.0x": None}
    g = mx.goals(Cell("pair", "closed8", "multi_tenant"), ok | {"quiet_ttft_p99": 0.51})
    assert g["quiet tenant ttft_p99 <= 0.5x"] is False
    # open loop: the same arrivals, so the goal is the requests answered; every request
    # answered by both is met whatever the tokens/s over the wall time (the last request's
    # end); one refused request is a miss however small its share; a closed loop goes by
    # tokens/s
    tput = "throughput >= 1.0x"
    all_served = {"throughput": 0.99, "served": 1.0}
    one_refused = {"throughput": 0.9995, "served": 131 / 132}
    assert mx.goals(Cell("two_prefill", "open0.9", "burst"), all_served)[tput] is True
    assert mx.goals(Cell("two_prefill", "open0.5", "rag"), one_refused)[tput] is False
    assert mx.goals(Cell("two_prefill", "closed8", "rag"), all_served)[tput] is False
    assert mx.goals(Cell("two_prefill", "open0.5", "rag"), {"throughput": 0.99})[tput] is False


def test_a_failing_cell_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    ran: list[str] = []

    def stand_in(system: str, cell: Cell, cfg: dict, reqs: list, conc: int | None,
                 out: Path) -> dict[str, Any]:  # fmt: skip
        ran.append(cell.name)
        if cell.workload == "multi_tenant" and system == "pdserve":
            raise RuntimeError("serve run failed")
        quiet = 0.5 if system == "pdserve" else 1.0
        return _figs(ttft_p50=0.5 if system == "pdserve" else 1.0, quiet_ttft_p99=quiet)

    cells = parse_cells("pair/closed8/multi_tenant,two_prefill/closed8/rag,pair/open0.9/rag")
    res = mx.run_matrix(
        cells, tmp_path, run_system=stand_in,
        build=lambda c, r, s: mx.workload_requests(c, r, s, limit=4), base=BASE, repeats=2,
        progress=False,
    )  # fmt: skip
    assert res["simulated"] is False
    c = res["cells"]
    assert c["pair/closed8/multi_tenant"]["status"] == "failed"
    assert "serve run failed" in c["pair/closed8/multi_tenant"]["errors"][0]
    assert c["two_prefill/closed8/rag"]["status"] == "ok"
    assert c["pair/open0.9/rag"]["status"] == "ok"  # capacity from the peer's own runs
    assert len(ran) == 4 * 2 * 2  # pair/closed8/rag runs whole first, then every cell
    rag = c["two_prefill/closed8/rag"]
    assert rag["ratios"]["pdserve"]["ttft_p50"]["median"] == 0.5
    assert rag["goals"]["ttft_p50 <= 1.0x"] is True
    # every run's raw figures are kept
    assert len(rag["runs"]) == 4 and all(r["figures"]["throughput"] == 100.0 for r in rag["runs"])

    md = (tmp_path / "report.md").read_text()
    png = tmp_path / "heatmap.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [ln for ln in md.splitlines() if ln.startswith("| pair/") or ln.startswith("| two_")]
    for cell in cells:
        assert any(ln.startswith(f"| {cell.name} | ") for ln in rows), cell.name
    assert "| pair/closed8/multi_tenant | failed |" in md
    assert "0.50 (0.50-0.50)" in md and "min-max" in md
    assert "simulated: false" in md
    assert (tmp_path / "matrix.json").exists()


def test_a_matrix_of_another_system_names_it_and_shows_each_runs_host_probe(tmp_path: Path) -> None:
    def stand_in(system: str, cell: Cell, cfg: dict, reqs: list, conc: int | None,
                 out: Path) -> dict[str, Any]:  # fmt: skip
        probe = [0.5, 0.55] if system == "pdserve-nofs" else [0.9, 1.2]
        return _figs(ttft_p50=0.4 if system == "pdserve-nofs" else 1.0) | {"host_probe_s": probe}

    res = mx.run_matrix(
        parse_cells("pair/closed8/rag"), tmp_path, run_system=stand_in,
        build=lambda c, r, s: mx.workload_requests(c, r, s, limit=4), base=BASE, repeats=1,
        systems=("pdserve-nofs", "peer-connector"), progress=False,
    )  # fmt: skip
    md = (tmp_path / "report.md").read_text()
    assert "Ratios are `pdserve-nofs` over `peer-connector`" in md
    assert "pdserve over" not in md
    # each run's host probe, before / after, in its row of the raw figures
    runs = [ln for ln in md.splitlines() if ln.startswith("| pair/closed8/rag | 1 |")]
    assert [ln.rsplit("|", 3)[-3].strip() for ln in runs] == ["0.50/0.55", "0.90/1.20"]
    assert [ln.rsplit("|", 2)[-2].strip() for ln in runs] == ["-", "-"]  # no during-run probe
    assert mx.main_ratios(res["cells"]["pair/closed8/rag"])["ttft_p50"]["median"] == 0.4
    assert mx.main_system(["pdserve-nofs", "pdserve", "peer-connector"]) == "pdserve"


def test_a_failed_capacity_run_fails_the_open_cells_it_sets(tmp_path: Path) -> None:
    def stand_in(system: str, cell: Cell, cfg: dict, reqs: list, conc: int | None,
                 out: Path) -> dict[str, Any]:  # fmt: skip
        if cell.load == "closed8":
            raise RuntimeError("no head")
        return _figs()

    res = mx.run_matrix(
        parse_cells("pair/open0.9/rag,pair/closed8/burst"), tmp_path, run_system=stand_in,
        build=lambda c, r, s: [], base=BASE, repeats=1, progress=False,
    )  # fmt: skip
    cell = res["cells"]["pair/open0.9/rag"]
    assert cell["status"] == "failed" and "no capacity" in cell["error"]
    assert res["cells"]["pair/closed8/burst"]["status"] == "failed"
    assert "| pair/open0.9/rag | failed: no capacity" in (tmp_path / "report.md").read_text()


def test_figures_from_a_replay_summary() -> None:
    summary = {
        "requests": 10,
        "errors": 2,
        "wall_s": 4.0,
        "throughput_tps": 50.0,
        "ttft": {"p50": 0.1, "p99": 0.9},
        "itl": {"p99": 0.02},
        "cached_token_ratio": 0.3,
    }
    f = mx.figures(summary, quiet_ttfts=[0.5, 0.2, 0.4])
    assert f["requests_per_s"] == 2.0 and f["throughput"] == 50.0
    assert f["quiet_ttft_p99"] == 0.5 and f["ttft_p99"] == 0.9
    assert f["served"] == 8  # requests less errors
    assert mx.figures(summary)["quiet_ttft_p99"] is None


def test_multi_tenant_config_requires_keys_and_turns_the_fair_share_on() -> None:
    from bench.live.compare import SYSTEMS, pdserve_config

    base = {"applications": [{"args": {"prefill": {"scheduler_config": {"profile": "auto"}}}}]}
    cfg = mx.tenant_config(pdserve_config(base, SYSTEMS["pdserve"]), {"sha256:ab": "quiet"})
    args = cfg["applications"][0]["args"]
    assert args["ingress"]["auth"] == "keys"
    assert args["tenants"]["key_hashes"] == {"sha256:ab": "quiet"}
    assert args["prefill"]["scheduler_config"] == {"profile": "auto", "fair_share": True}
    assert "operator_key_hashes" not in args["tenants"]
    stock = mx.tenant_config(pdserve_config(base, SYSTEMS["pdserve-fcfs-rr"]), {})
    assert "scheduler_config" not in stock["applications"][0]["args"]["prefill"]
    # the operator's key, with which the bench reads the stats of an app that needs keys
    op = mx.tenant_config(pdserve_config(base, SYSTEMS["pdserve"]), {}, ["sha256:cd"])
    assert op["applications"][0]["args"]["tenants"]["operator_key_hashes"] == ["sha256:cd"]
    # pdserve-nofs: the same tenants and keys, Fairway without the fair share
    nofs = SYSTEMS["pdserve-nofs"]
    off = mx.tenant_config(pdserve_config(base, nofs), {}, fair_share=nofs.fair_share)
    assert off["applications"][0]["args"]["prefill"]["scheduler_config"]["fair_share"] is False


def test_cpu_roles_of_both_systems_processes() -> None:
    assert mx.cpu_role("ray::ServeReplica:pdserve:prefill") == "prefill"
    assert mx.cpu_role("ray::ServeReplica:peer:Decode:bench") == "decode"
    assert mx.cpu_role("VLLM::EngineCore") == "engine processes"  # the peer's, either role
    assert mx.cpu_role("VLLM::Worker") == "engine processes"
    assert mx.cpu_role("ray::ServeReplica:peer:OpenAiIngress") == "http"
    assert mx.cpu_role("ray::ProxyActor") == "http"
    assert mx.cpu_role("ray::ServeController.listen_for_change") == "serve controller"
    assert mx.cpu_role("gcs_server") == "ray and other"


def test_breakdown_of_one_run_parts_of_the_ttft_and_cpu_by_role() -> None:
    summary = {
        "requests": 10,
        "errors": 2,
        "ttft": {"mean": 1.5},
        "cpu_s_by_kind": {
            "ray::ServeReplica:pdserve:prefill": 30.0,
            "ray::ServeReplica:pdserve:decode": 20.0,
            "ray::ServeReplica:pdserve:ingress": 4.0,
            "ray::ProxyActor": 2.0,
            "gcs_server": 1.0,
        },
    }
    ph = {k: {"n": 5, "mean": 0.01} for k in mx.OVERHEAD_TO_FIRST}
    ph |= {"prefill_engine": {"n": 5, "mean": 1.2}, "decode_first_engine": {"n": 5, "mean": 0.25}}
    ph |= {"decode": {"n": 5, "mean": 9.0}}  # after the first token: not in the overhead
    b = mx.breakdown(summary, {"ingress": {"phases_s": ph}})
    assert b["ttft_mean_s"] == 1.5
    assert b["overhead_to_first_s"] == pytest.approx(0.05)
    assert (b["prefill_engine_s"], b["decode_first_engine_s"], b["phases_n"]) == (1.2, 0.25, 5)
    assert b["cpu_s_by_role"] == {
        "prefill": 30.0,
        "decode": 20.0,
        "engine processes": 0.0,
        "http": 6.0,
        "serve controller": 0.0,
        "ray and other": 1.0,
    }
    assert b["cpu_s_per_request"] == pytest.approx(57.0 / 8)  # per completed request
    # the peer: no stats, so no phases; its CPU still broken down
    peer = mx.breakdown({"requests": 8, "cpu_s_by_kind": {"VLLM::Worker": 16.0}}, None)
    assert "prefill_engine_s" not in peer and peer["cpu_s_per_request"] == 2.0


def test_the_report_says_where_the_time_goes_when_runs_carry_a_breakdown(tmp_path: Path) -> None:
    def stand_in(system: str, cell: Cell, cfg: dict, reqs: list, conc: int | None,
                 out: Path) -> dict[str, Any]:  # fmt: skip
        cpu = {"ray::ServeReplica:pdserve:prefill": 40.0} if system == "pdserve" else {}
        cpu |= {} if system == "pdserve" else {"VLLM::EngineCore": 60.0}
        stats = {"ingress": {"phases_s": {"prefill_engine": {"n": 3, "mean": 0.7}}}}
        summary = {"requests": 20, "ttft": {"mean": 0.9}, "cpu_s_by_kind": cpu}
        return _figs() | {
            "breakdown": mx.breakdown(summary, stats if system == "pdserve" else None)
        }

    mx.run_matrix(
        parse_cells("pair/closed8/rag"), tmp_path, run_system=stand_in,
        build=lambda c, r, s: mx.workload_requests(c, r, s, limit=4), base=BASE, repeats=2,
        progress=False,
    )  # fmt: skip
    md = (tmp_path / "report.md").read_text()
    assert "## Where the time goes" in md
    rows = {
        ln.split(" | ")[1]: ln for ln in md.splitlines() if ln.startswith("| pair/closed8/rag | ")
    }
    # TTFT mean 900 ms; pdserve's prefill engine 700 ms; 40 CPU-s in prefill, 2.00 per request
    assert rows["pdserve"].startswith("| pair/closed8/rag | pdserve | 2 | 900 | 0 | 700 | - | 40 |")
    assert rows["pdserve"].endswith("| 2.00 |")
    assert "| peer-connector | 2 | 900 | - | - | - | 0 | 0 | 60 |" in rows["peer-connector"]


class _Clock:
    """A stand-in clock that one run advances by ``step`` seconds."""

    def __init__(self, step: float) -> None:
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        return self.t


def test_a_budget_stops_the_matrix_and_resume_runs_only_what_it_lacks(tmp_path: Path) -> None:
    clock = _Clock(step=60.0)
    ran: list[tuple[str, str, int, tuple[float, ...] | None]] = []
    cap = {"rps": 2.0}
    fail_once = {("two_prefill/closed8/rag", "pdserve", 0)}

    def stand_in(system: str, cell: Cell, cfg: dict, reqs: list[LiveRequest],
                 conc: int | None, out: Path) -> dict[str, Any]:  # fmt: skip
        rep = sum(1 for r in ran if r[0] == system and r[1] == cell.name)
        ran.append((system, cell.name, rep, tuple(r.at_s for r in reqs) if conc is None else None))
        clock.t += clock.step
        if (cell.name, system, rep) in fail_once:
            fail_once.clear()
            raise RuntimeError("head did not start")
        return _figs(rps=cap["rps"] if system == mx.REFERENCE else 5.0)

    def build(cell: Cell, rate: float | None, seed: int) -> list[LiveRequest]:
        return mx.workload_requests(cell, rate, seed, limit=6)

    cells = parse_cells("pair/open0.5/rag,two_prefill/closed8/rag")
    # the closed cells first (pair/closed8/rag for the open cell's rate), then the open one:
    # 5 runs fit in 5 minutes, the 6th never starts
    res = mx.run_matrix(
        cells, tmp_path, run_system=stand_in, build=build, base=BASE, repeats=1,
        progress=False, budget_s=300.0, clock=clock, code="abc1234",
    )  # fmt: skip
    assert len(ran) == 5 and "budget" in res["stopped"]
    c = res["cells"]
    assert c["two_prefill/closed8/rag"]["status"] == "failed"  # pdserve failed: no pair
    assert c["pair/open0.5/rag"]["status"] == "incomplete"  # pdserve ran, the peer not yet
    assert c["pair/open0.5/rag"]["rate_rps"] == pytest.approx(1.0)
    assert all(r["code"] == "abc1234" for r in c["pair/open0.5/rag"]["runs"])
    md = (tmp_path / "report.md").read_text()
    assert "cells with every run done: 1 of 32; stopped: budget" in md  # pair/closed8/rag
    assert "abc1234 (5)" in md
    # 64 runs make the whole matrix at one repeat, four have figures; every run so far took
    # the stand-in clock's minute (the failed one too): 60 minutes left
    assert all(r["run_s"] == 60.0 for r in c["pair/closed8/rag"]["runs"])
    assert (
        "runs left for all 32 cells at 1 repeat: 60; about 1.0 h at the median run so far "
        "(1.0 min, of 5 runs with their time recorded)" in md
    )

    # Resume with two repeats: the capacity is not measured again, and a new capacity would
    # not change the open cell's rate (every repeat keeps the same arrivals' rate); the
    # failed run runs again; nothing that has figures runs again.
    cap["rps"] = 8.0
    first_open_arrival = next(r[3] for r in ran if r[1] == "pair/open0.5/rag")
    ran.clear()
    res = mx.run_matrix(
        parse_cells("pair/open0.5/rag"), tmp_path, run_system=stand_in, build=build,
        base=BASE, repeats=2, progress=False, resume=True, clock=clock, code="def5678",
    )  # fmt: skip
    assert [(s, c_) for s, c_, _, _ in ran] == [
        (mx.REFERENCE, "pair/open0.5/rag"),  # repeat 1's missing half
        (mx.REFERENCE, "pair/open0.5/rag"),  # repeat 2: BA
        ("pdserve", "pair/open0.5/rag"),
    ]
    assert ran[0][3] == first_open_arrival  # repeat 1's very arrivals
    assert ran[1][3] != first_open_arrival  # repeat 2 draws its own
    c = res["cells"]
    assert c["pair/open0.5/rag"]["rate_rps"] == pytest.approx(1.0)
    assert c["pair/open0.5/rag"]["status"] == "ok"
    assert c["pair/open0.5/rag"]["ratios"]["pdserve"]["throughput"]["n"] == 2
    # the closed cell, not selected now, stays in the report with what it had; its failed
    # run was dropped (so that a later resume that selects it runs it again)
    assert "two_prefill/closed8/rag" in c and len(c["two_prefill/closed8/rag"]["runs"]) == 1
    assert "stopped" not in res
    md = (tmp_path / "report.md").read_text()
    assert "abc1234 (4)" in md and "def5678 (3)" in md
    ran.clear()
    res = mx.run_matrix(
        parse_cells("two_prefill/closed8/rag"), tmp_path, run_system=stand_in, build=build,
        base=BASE, repeats=1, progress=False, resume=True, clock=clock,
    )  # fmt: skip
    assert [(s, c_) for s, c_, _, _ in ran] == [("pdserve", "two_prefill/closed8/rag")]
    assert res["cells"]["two_prefill/closed8/rag"]["status"] == "ok"


def test_resume_refuses_a_matrix_of_other_systems_or_seed(tmp_path: Path) -> None:
    mx.run_matrix(
        parse_cells("pair/closed8/rag"), tmp_path, run_system=lambda *a: _figs(),
        build=lambda c, r, s: [], base=BASE, repeats=1, progress=False, seed=3,
    )  # fmt: skip
    with pytest.raises(ValueError, match="seed 3, not 4"):
        mx.previous_matrix(tmp_path, mx.DEFAULT_SYSTEMS, 4)
    with pytest.raises(ValueError, match="systems"):
        mx.previous_matrix(tmp_path, ["pdserve-twp", mx.REFERENCE], 3)
    assert mx.previous_matrix(tmp_path / "none", mx.DEFAULT_SYSTEMS, 3) is None
    # the CLI: an existing matrix needs --resume (or another folder); --resume needs --matrix
    r = runner.invoke(app, ["bench", "compare", "--matrix", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--resume" in r.output, r.output
    r = runner.invoke(
        app, ["bench", "compare", "--matrix", "--resume", "--seed", "4", "--out", str(tmp_path)]
    )
    assert r.exit_code == 2 and "seed 3, not 4" in r.output, r.output
    r = runner.invoke(app, ["bench", "compare", "--resume", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--redo-repeat: only with" in r.output, r.output


def test_the_during_run_probe_reports_median_and_max_per_kind_and_the_steal() -> None:
    f = mx.probe_figures([(0.010, 0.020), (0.030, 0.005), (0.012, 0.008)], 1.5)
    assert f["rounds"] == 3 and f["steal_s"] == 1.5
    assert f["hash_ms"] == pytest.approx([12.0, 30.0])
    assert f["copy_ms"] == pytest.approx([8.0, 20.0])
    assert mx.during_cell(f) == "12/8 (30/20), 1.5 s"
    none = mx.probe_figures([], None)
    assert none["hash_ms"] is None and mx.during_cell(none) == "-" and mx.during_cell(None) == "-"


def test_the_during_run_probe_times_rounds_on_its_thread_until_the_run_ends() -> None:
    with mx.RunProbe(interval_s=0.05) as probe:
        deadline = time.monotonic() + 30
        while len(probe.rounds) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    n = len(probe.rounds)
    assert n >= 2  # the first round at once, then one per interval
    time.sleep(0.15)
    assert len(probe.rounds) == n  # stopped with the run
    f = probe.figures()
    assert f["rounds"] == n and 0 < f["hash_ms"][0] <= f["hash_ms"][1]
    assert f["copy_ms"][0] > 0


def test_the_report_names_a_repeat_whose_systems_ran_on_hosts_of_unlike_speed() -> None:
    def run(system: str, repeat: int, copy_ms: float | None) -> dict[str, Any]:
        during = None if copy_ms is None else mx.probe_figures([(0.010, copy_ms / 1e3)], 0.0)
        return {"system": system, "repeat": repeat, "figures": {"host_during": during}}

    res = {
        "cells": {
            "pair/closed8/rag": {
                "runs": [
                    run("pdserve", 0, 4.6), run("peer-connector", 0, 6.5),  # 1.41x
                    run("pdserve", 1, 4.6), run("peer-connector", 1, 5.0),  # within 15%
                    run("pdserve", 2, None), run("peer-connector", 2, 9.0),  # not judged
                ]
            }
        }
    }  # fmt: skip
    assert mx.uneven_hosts(res) == "pair/closed8/rag #1 (peer-connector copy 1.41x pdserve)"
    assert mx.uneven_hosts(res, tolerance=0.5) == ""
