"""What an engine replica reports: the routers' load report, autoscaling metrics, stats.

In a request's path this comes before the call: Serve polls ``record_routing_stats`` and the
routers (:mod:`deployments.router`) pick a replica by it; Serve's autoscaler reads
``record_autoscaling_stats`` (:mod:`deployments.autoscaling`); ``stats`` feeds
``/v1/pdserve/stats``: cumulative counters (:mod:`.counters`), among them external
(transferred) prefix hits, the proof that decode pulled the prompt's KV instead of
recomputing it, and failed KV loads (decode recomputes them: ``kv_load_failure_policy``).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from controllers.slo_sizing import prompt_moments
from deployments.engine.health import Health
from deployments.engine.live_config import LiveConfig

#: Seconds of prefill a replica runs before its measured prefill rate replaces its profile's.
MEASURED_AFTER_S = 2.0
#: The most prompt blocks of its prefill calls a replica's load report lists
#: (``queued_blocks``; 4,096 blocks of 128 are 512k tokens, about 37 KB a report).
QUEUED_BLOCKS_REPORTED = 4096
#: A prefill call's blocks stop counting this long after it started even if it never ends
#: (it always does: ``Calls.prefill`` marks it done; a bound, not a timing).
QUEUED_PREFIX_TTL_S = 3600.0


class Reports(Health, LiveConfig):
    """The replica's reports (see the module docstring)."""

    def record_routing_stats(self) -> dict[str, Any]:
        """The load report Serve polls for the routers (see :mod:`deployments.router`); its
        gauges go to the app's metrics too."""
        p = self.ports
        load = self.engine.load
        tags = {"role": self.role, "replica": self.replica_id}
        for series, key in (
            ("pdserve_engine_waiting", "waiting"),
            ("pdserve_engine_running", "running"),
            ("pdserve_engine_queued_uncached_tokens", "queued_uncached_tokens"),
            ("pdserve_engine_kv_usage", "kv_usage"),
            ("pdserve_twp_window_tokens", "window_tokens"),
            ("pdserve_twp_token_load", "token_load"),
        ):
            self.metrics.set(series, load.get(key), **tags)
        policy = load.get("policy") or {}
        if policy.get("twp_state"):  # TWP's measured slowdown (sigma) and counted decisions
            self.metrics.set("pdserve_twp_slowdown", float(policy["twp_state"]["sigma"]), **tags)
            self._twp_events.publish(policy["twp_counters"], **tags)
        self.index_writer.publish(self._feed_events)  # the Redis feed of its own events
        self.queued_prefixes.expire(time.time())
        return {
            **{k: v for k, v in load.items() if k != "policy"},
            "runtime": self.runtime,
            "pid": os.getpid(),
            "loop_lag": self.loop_lag.report(),
            "rss_mb": self.rss_mb(),
            "wedged": self.wedged() is not None,
            "role": self.role,
            "replica_id": self.replica_id,
            "node_ip": self.node_ip,  # the Ray node it runs on (pdserve status shows it)
            "node_id": self.node_id,
            "kv_events": self.index_writer.endpoints(p.host)[0],
            "kv_replay": self.index_writer.endpoints(p.host)[1],
            "kv_topic": self.cfg.engine(self.role).kv_events.topic,
            "hash_mode": self.index_writer.hash_mode,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "requests_aborted": self.engine.aborted,
            "kv_released": self.kv_released,
            "requests_in_flight": self.in_flight,
            "warm": self.warm,
            "first_call": self.first_call,
            # the blocks this replica's feed holds for the Redis index (bounded by the KV
            # cache: a load test checks it stays so)
            "tracked_blocks": self.index_writer.tracked_blocks(),
            # the prompt blocks of the prefill calls it holds, which its KV events have not
            # shown the index yet: every ingress's router counts them as this replica's prefix
            "queued_blocks": self.queued_prefixes.blocks(self.replica_id, QUEUED_BLOCKS_REPORTED),
            **self.counters.as_dict(),
        }

    def rss_mb(self, every_s: float = 5.0) -> float | None:
        """Resident memory of this replica with the engine processes it started (MiB; an
        async_llm engine core and its worker), refreshed at most every ``every_s``."""
        now = time.monotonic()
        if now - self._rss[0] < every_s and self._rss[1] is not None:
            return self._rss[1]
        try:
            import psutil

            me = psutil.Process()
            total = me.memory_info().rss
            for child in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += child.memory_info().rss
        except Exception:  # noqa: BLE001 - a report without it
            return None
        self._rss = (now, round(total / 2**20, 1))
        return self._rss[1]

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The custom metrics Serve hands the autoscaling policy (:mod:`deployments.autoscaling`,
        names in its ``METRICS``): engine calls in flight (health probes and stats calls are
        not engine calls, so a load balancer's probes do not keep an idle pool alive), the
        prefill backlog and cumulative uncached tokens with this hardware's prefill rate and the
        recent prompts' mean and p99 (uncached tokens, for the SLO sizing), the TWP load and window
        and its decode floor ``l_min`` as measured here, the KV blocks in use, and whether this
        replica is warm."""
        load = self.engine.load
        out = {
            "requests_in_flight": float(self.in_flight),
            "queued_uncached_tokens": float(load.get("queued_uncached_tokens") or 0),
            "warm": 1.0 if self.warm else 0.0,
            "uncached_tokens_total": float(max(0, self.prompt_tokens - self.cached_tokens)),
        }
        rate = self.prefill_tokens_per_s()
        if rate is not None:
            out["prefill_tokens_per_s"] = rate
        if self.recent_prompts:  # the SLO sizing's prompt mean and p99 (controllers.slo_sizing)
            mean, p99 = prompt_moments(self.recent_prompts)
            out["prompt_tokens_mean"], out["prompt_tokens_p99"] = mean, p99
        if load.get("window_tokens") is not None:
            out["window_tokens"] = float(load["window_tokens"])
            out["token_load"] = float(load.get("token_load") or 0.0)
            # requests the TWP gate holds, each at the routers' expected output
            waiting = int(load.get("waiting") or 0)
            out["queued_window_tokens"] = float(waiting * self.cfg.routing.expected_output_tokens)
        twp = (load.get("policy") or {}).get("twp_state")
        if twp and twp.get("l_min_s"):  # the TWP gate's decode floor, as this engine measured
            out["decode_l_min_s"] = float(twp["l_min_s"])  # it (the SLO sizing's step curve)
        total = load.get("total_kv_blocks")
        if total:
            out["total_kv_blocks"] = float(total)
            out["used_kv_blocks"] = float(total - int(load.get("free_kv_blocks") or 0))
        return out

    def prefill_tokens_per_s(self) -> float | None:
        """Prefill throughput of this replica (tokens/s): the uncached prompt tokens it has
        prefilled over the seconds it had a prefill call running (the serving rate, with
        every per-request cost in it), once it has been busy for :data:`MEASURED_AFTER_S`;
        before, its engine profile's rate at ``min(1024, max_model_len / 2)`` tokens (an idle
        engine's, measured on this hardware by ``pdserve profile``); ``None`` with neither."""
        done = self.prompt_tokens - self.cached_tokens
        busy = self._busy_s
        if self._prefills > 0:  # the busy period running now counts too
            busy += time.monotonic() - self._busy_since
        if busy >= MEASURED_AFTER_S and done > 0:
            return done / busy
        return self._prefill_rate

    async def stats(self) -> dict[str, Any]:
        """Cumulative counters (see :class:`EngineCounters`), the replica's role and id, and
        its feed's counters when it feeds the Redis index."""
        out: dict[str, Any] = {
            "role": self.role,
            "replica_id": self.replica_id,
            "runtime": self.runtime,
            "pid": os.getpid(),
            "engine_pid": self.engine.load.get("engine_pid"),
            "hash_mode": self.index_writer.hash_mode,
            "requests_aborted": self.engine.aborted,
            "warm": self.warm,
            "first_call": self.first_call,
            "live_config": self.live_config(),
            **self.counters.as_dict(),
        }
        feed = self.index_writer.feed_stats()
        if feed is not None:
            out["feed"] = feed
        return out
