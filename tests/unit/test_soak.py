"""The soak's classification of answers and the reasons it reports for errors."""

from __future__ import annotations

from typing import Any

import httpx

from bench.live.soak import _classify, _reason


def test_only_429_and_503_with_retry_after_are_expected_refusals() -> None:
    assert _classify(httpx.Response(200)) == "200"
    assert _classify(httpx.Response(503, headers={"Retry-After": "3"})) == "503"
    assert _classify(httpx.Response(429, headers={"Retry-After": "1"})) == "429"
    assert _classify(httpx.Response(503)) == "error 503"  # no Retry-After: not a refusal
    assert _classify(httpx.Response(504)) == "error 504"


def test_an_error_reason_is_the_apps_message_or_the_text() -> None:
    body = {"error": {"message": "decode timed out", "type": "timeout", "code": None}}
    assert _reason(httpx.Response(504, json=body)) == "504: decode timed out"
    assert _reason(httpx.Response(502, text="Bad Gateway")) == "502: Bad Gateway"
    long = httpx.Response(500, json={"error": "x" * 500})
    assert _reason(long) == "500: " + "x" * 80


def test_a_ray_actor_keeps_one_name_whatever_method_it_runs() -> None:
    from bench.live.soak import process_name

    base = "ray::ServeReplica:pdserve:ingress"
    assert process_name(base, "python") == base
    assert process_name(base + ".handle_request_with_rejection", "python") == base
    assert process_name("ray::ServeController.listen_for_change", "x") == "ray::ServeController"
    assert process_name("/usr/bin/redis-server", "redis-server") == "redis-server"


def test_the_proxy_control_reads_only_serves_proxy(monkeypatch: Any) -> None:
    import bench.live.proxy_control as pc

    fake = {"ray::ProxyActor[1]": 3 * 2**20, "ray::ServeReplica:control:control[2]": 9 * 2**20}
    monkeypatch.setattr(pc, "rss", lambda: fake)
    assert pc.proxy_rss() == 3 * 2**20
    monkeypatch.setattr(pc, "rss", dict)
    assert pc.proxy_rss() == 0


def test_the_proxy_controls_busy_cores_spin_until_terminated() -> None:
    import bench.live.proxy_control as pc

    procs = pc.busy(2)
    try:
        assert len(procs) == 2 and all(p.is_alive() for p in procs)
    finally:
        for p in procs:
            p.terminate()
            p.join(10)
    assert not any(p.is_alive() for p in procs)
    assert pc.busy(0) == []
