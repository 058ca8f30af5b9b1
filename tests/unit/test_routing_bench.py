"""The live routing benchmark's pure parts: the RAG mix is seeded and shares its documents'
prefixes exactly, and the summary counts what the replays did."""

from __future__ import annotations

from bench.live.routing import Result, ratios, summarize_policy
from bench.workloads.rag import RagMix, rag_mix


def test_rag_mix_is_seeded_and_shares_document_prefixes() -> None:
    mix = RagMix(requests=50, documents=4, doc_blocks=2, question_tokens=8, rate=2.0, seed=3)
    a, b = rag_mix(mix, vocab=500), rag_mix(mix, vocab=500)
    assert [(x.at_s, x.doc, x.ids) for x in a] == [(x.at_s, x.doc, x.ids) for x in b]
    assert all(later.at_s > earlier.at_s for earlier, later in zip(a, a[1:], strict=False))
    doc_len = 2 * mix.block_size
    by_doc: dict[int, list[int]] = {}
    for x in a:
        assert len(x.ids) == doc_len + 8 and all(10 <= t < 500 for t in x.ids)
        by_doc.setdefault(x.doc, x.ids[:doc_len])
        assert x.ids[:doc_len] == by_doc[x.doc]  # the document prefix, token for token
    counts = [sum(1 for x in a if x.doc == d) for d in range(4)]
    assert counts[0] == max(counts)  # Zipf: the first document is the most popular
    other = rag_mix(RagMix(requests=50, documents=4, doc_blocks=2, question_tokens=8, seed=4), 500)
    assert [x.ids for x in other] != [x.ids for x in a]


def test_summary_counts_errors_cache_and_replicas() -> None:
    results = [
        Result(True, 0.1, 0.5, 1000, 900),
        Result(True, 0.3, 0.9, 1000, 0),
        Result(False, 0.0, 0.0, error="HTTP 503: busy"),
    ]

    def stats(a: int, b: int) -> dict[str, object]:
        return {
            "replicas": {"prefill": [{"id": "x", "requests": a}, {"id": "y", "requests": b}]},
            "router": {"fallbacks": {"hotspot": 1}},
            "ingress": {"overhead_s": None, "phases_s": {}},
        }

    s = summarize_policy(results, stats(5, 5), stats(7, 6))
    assert s["errors"] == 1 and s["error_samples"] == ["HTTP 503: busy"]
    assert s["cached_token_ratio"] == 0.45
    assert s["requests_per_replica"] == [2, 1]
    assert s["ttft"]["p50"] == 0.2
    res = {"policies": {"round_robin": {"ttft": {"p50": 2.0, "p99": 4.0}}, "prefix_load": s}}
    r = ratios(res, "round_robin")
    assert r["prefix_load"]["ttft_p50"] == 0.1 and r["round_robin"]["ttft_p50"] == 1.0
    assert ratios(res, "least_loaded") == {}


def test_the_benchs_own_app_deploys_closed_by_default_rules() -> None:
    """``bench routing`` (and ``bench overhead``) deploy their own app on loopback and send no
    key: its config says ``auth: none`` explicitly, so the deploy-time check passes (keys by
    default left it failing with no key source)."""
    from bench.live.routing import app_args
    from deployments.config import load_app_config

    for preset in ("test", "bench"):
        cfg = load_app_config(app_args(preset, 2, None))
        cfg.check_auth()
        assert cfg.ingress.auth == "none"
        assert cfg.prefill.num_replicas == 2
        assert cfg.tenants.limits("anonymous").requests_per_second is None  # no 429s
