from bench.report.stats import summarize


def test_summary_of_known_sample() -> None:
    s = summarize(range(1, 101))
    assert s["n"] == 100 and s["mean"] == 50.5 and s["max"] == 100
    assert s["p50"] == 50.5 and abs(s["p99"] - 99.01) < 1e-9


def test_empty_sample_invents_nothing() -> None:
    assert summarize([]) == {
        "n": 0,
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
    }
