"""Ray Serve's side of the serverless autoscaler: :func:`controllers.autoscale.decide` as a
Serve autoscaling policy, fed by the engine replicas' own metrics.

Serve (2.60) calls a policy about ten times a second in its controller with an
``AutoscalingContext`` per deployment: running and target replica counts, requests waiting at
the handles (``total_queued_requests``), and the custom metrics each replica's
``record_autoscaling_stats()`` returned (:data:`METRICS`; averaged per replica over
``look_back_period_s``). This module turns them into :class:`~controllers.autoscale.RoleDemand`
and calls the pure policy. A Serve policy returns only counts: which replica a request goes to
stays the routers' job (they send to warm replicas first, :mod:`deployments.router`).

Two entry points, one policy:

- :class:`PDAutoscaler`, the **application-level** policy (``autoscaling_policy:
  {policy_function: deployments.autoscaling:PDAutoscaler}`` beside ``import_path`` in the
  Serve YAML, as ``configs/pd_autoscale.yaml`` has it). It sees prefill and decode together,
  so the pair is decided together: both start at once from zero, and decode is never at zero
  while prefill is not. Serve takes an application-level policy only from a config file
  (``serve deploy``/``serve run CONFIG``, KubeRay's ``serveConfigV2``), not from ``serve.run``
  in Python.
- :class:`RoleAutoscaler`, the **deployment-level** policy ``build_app`` sets on each engine
  deployment. It runs when the YAML has no application-level policy: each role then scales on
  its own demand (unpaired; the stats say ``scope: deployment``).

Each engine deployment's ``autoscaling_config`` (:func:`serve_autoscaling_config`) carries the
app's ``autoscaling`` section in its policy's ``policy_kwargs``, which is how the
application-level policy gets its parameters, and sets Serve's own delays to zero: the
hysteresis and keep-alive are the pure policy's (one place, with reasons), not Serve's.

The policy's state is an :class:`~controllers.autoscale.AutoscaleState` kept in Serve's
``policy_state`` (a plain dict). The last decisions, with their reasons and inputs, go to
Ray's internal KV under :func:`decisions_key` when they change (and every few seconds), where
the ingress's ``/v1/pdserve/stats`` reads them; they are logged in the Serve controller's log.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from controllers.autoscale import (
    AutoscaleConfig,
    AutoscaleState,
    Decision,
    RoleDemand,
    decide,
)

log = logging.getLogger("ray.serve")

APP_POLICY = "deployments.autoscaling:PDAutoscaler"
ROLE_POLICY = "deployments.autoscaling:RoleAutoscaler"
#: The custom metrics an engine replica reports for the policy (``record_autoscaling_stats``).
METRICS = (
    "requests_in_flight",
    "queued_uncached_tokens",
    "uncached_tokens_total",
    "prefill_tokens_per_s",
    "prompt_tokens_mean",
    "prompt_tokens_p99",
    "token_load",
    "queued_window_tokens",
    "window_tokens",
    "decode_l_min_s",
    "used_kv_blocks",
    "total_kv_blocks",
    "warm",
)
#: Serve's averaging window of the replicas' metrics (s) and how often they are taken.
LOOK_BACK_S = 5.0
METRICS_INTERVAL_S = 1.0
#: How often the unchanged decisions are re-published (s).
PUBLISH_EVERY_S = 5.0
_STATE_KEY = "pdserve"


def decisions_key(app: str) -> bytes:
    """Ray internal-KV key of ``app``'s last autoscaling decisions."""
    return f"pdserve/autoscale/{app}".encode()


def serve_autoscaling_config(
    autoscaling: AutoscaleConfig, role: str, paired: bool
) -> dict[str, Any]:
    """The ``autoscaling_config`` of ``role``'s engine deployment."""
    b = getattr(autoscaling, role)
    return {
        "min_replicas": b.min_replicas,
        "max_replicas": b.max_replicas,
        "initial_replicas": b.initial(),
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "downscale_to_zero_delay_s": 0.0,
        "metrics_interval_s": METRICS_INTERVAL_S,
        "look_back_period_s": LOOK_BACK_S,
        "policy": {
            "policy_function": ROLE_POLICY,
            "policy_kwargs": {
                "autoscaling": autoscaling.model_dump(mode="json"),
                "role": role,
                "paired": paired,
            },
        },
    }


def _kwargs(ctx: Any) -> dict[str, Any]:
    policy = getattr(ctx.config, "policy", None)
    return dict(getattr(policy, "policy_kwargs", None) or {})


def role_demand(ctx: Any) -> RoleDemand:
    """One deployment's :class:`RoleDemand` from its Serve ``AutoscalingContext``: its
    running replicas' custom metrics, summed (means for per-replica rates and sizes)."""
    running = {getattr(r, "unique_id", r) for r in ctx.running_replicas or ()}
    metrics = ctx.aggregated_metrics or {}

    def values(name: str) -> list[float]:
        per = metrics.get(name) or {}
        return [
            float(v)
            for r, v in per.items()
            if getattr(r, "unique_id", r) in running and v is not None  # stopped: not counted
        ]

    def total(name: str) -> float:
        return sum(values(name))

    def mean(name: str) -> float | None:
        xs = [x for x in values(name) if x > 0]
        return sum(xs) / len(xs) if xs else None

    def most(name: str) -> float | None:
        xs = [x for x in values(name) if x > 0]
        return max(xs) if xs else None

    queued = float(ctx.total_queued_requests or 0.0)
    totals = values("uncached_tokens_total")
    return RoleDemand(
        running=int(ctx.current_num_replicas),
        target=int(ctx.target_num_replicas),
        handle_queued=queued,
        # requests in the engines (engine calls; health probes and stats calls excluded, so
        # a load balancer's probes do not keep an idle pool alive) plus those at the handles
        ongoing=total("requests_in_flight") + queued,
        queued_uncached_tokens=total("queued_uncached_tokens"),
        uncached_tokens_total=sum(totals) if totals else None,
        tokens_per_s=mean("prefill_tokens_per_s"),
        token_load=total("token_load"),
        queued_window_tokens=total("queued_window_tokens"),
        window_tokens=mean("window_tokens"),
        used_kv_blocks=total("used_kv_blocks"),
        kv_blocks_per_replica=mean("total_kv_blocks"),
        # the SLO sizing's prompts: the replicas' mean, and the largest p99 (the pool's p99
        # is at most the largest of its replicas')
        prompt_tokens_mean=mean("prompt_tokens_mean"),
        prompt_tokens_p99=most("prompt_tokens_p99"),
        # decode's step floor as the TWP gates measure it: the slowest replica's (its ITL is
        # the pool's p99)
        l_min_s=most("decode_l_min_s"),
    )


class _Publisher:
    """Logs decisions when they change and puts them in Ray's internal KV (best effort)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, str]] = {}
        self._published_at = 0.0

    def __call__(
        self,
        app: str,
        scope: str,
        out: dict[str, Decision],
        demand: dict[str, RoleDemand],
        state: AutoscaleState,
    ) -> None:
        now = time.time()
        brief = {k: (d.replicas, d.reason) for k, d in out.items()}
        changed = {k: v for k, v in brief.items() if self._last.get(k) != v}
        if not changed and now - self._published_at < PUBLISH_EVERY_S:
            return
        self._last.update(brief)
        self._published_at = now
        for role, (n, reason) in changed.items():
            d = demand[role]
            log.info(
                "pdserve autoscaler (%s): %s -> %d replicas (%s; running %d, queued at handles %.1f, "
                "in flight %.1f, need %.2f)",
                scope,
                role,
                n,
                reason,
                d.running,
                d.handle_queued,
                d.ongoing,
                out[role].need,
            )
        body = {
            "scope": scope,
            "at": now,
            "decisions": {
                k: {"replicas": d.replicas, "reason": d.reason, "need": d.need}
                for k, d in out.items()
            },
            "demand": {
                k: {
                    "running": d.running,
                    "target": d.target,
                    "handle_queued": d.handle_queued,
                    "ongoing": d.ongoing,
                    # what the SLO sizing prices prefill with (None: not reported yet)
                    "tokens_per_s": d.tokens_per_s,
                    "prompt_tokens_mean": d.prompt_tokens_mean,
                    "prompt_tokens_p99": d.prompt_tokens_p99,
                    # and decode's step floor, as its TWP gates measure it
                    "l_min_s": d.l_min_s,
                }
                for k, d in demand.items()
            },
            "cold_start_s": {k: list(r.cold_starts) for k, r in state.roles.items()},
            "inflow_tokens_per_s": state.inflow_tokens_per_s,
            # the keep-alive in force (SLO mode: derived from the cold budget; else None)
            "keep_alive_s": state.keep_alive_s,
        }
        try:
            from ray.experimental import internal_kv

            if internal_kv._internal_kv_initialized():
                internal_kv._internal_kv_put(
                    decisions_key(app), json.dumps(body).encode(), overwrite=True
                )
        except Exception as e:  # never fail the controller's loop over a report
            log.debug("pdserve autoscaler: publishing decisions failed: %s", e)


def read_decisions(app: str) -> dict[str, Any] | None:
    """The last decisions :class:`PDAutoscaler`/:class:`RoleAutoscaler` published for ``app``."""
    try:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(decisions_key(app))
    except Exception:
        return None
    return None if raw is None else json.loads(raw)


class PDAutoscaler:
    """The application-level policy: prefill and decode decided together."""

    def __init__(self, **_: Any) -> None:
        self._publish = _Publisher()
        # the config rides in the deployments' policy_kwargs; Serve calls the policy ten times
        # a second, so it is validated when those change, not on every call
        self._cfg_raw: dict[str, Any] | None = None
        self._cfg = AutoscaleConfig()

    def _config(self, raw: dict[str, Any]) -> AutoscaleConfig:
        if raw != self._cfg_raw:
            self._cfg = AutoscaleConfig.model_validate(raw)
            self._cfg_raw = raw
        return self._cfg

    def __call__(
        self, contexts: dict[Any, Any]
    ) -> tuple[dict[Any, int], dict[Any, dict[str, Any]]]:
        by_role = {dep_id.name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        if not by_role:
            return {}, {}
        any_ctx = next(iter(contexts.values()))
        kw = _kwargs(by_role.get("prefill", (None, any_ctx))[1])
        cfg = self._config(kw.get("autoscaling") or {})
        paired = bool(kw.get("paired", "decode" in by_role))
        holder = by_role.get("prefill", next(iter(by_role.values())))[0]
        state = AutoscaleState.from_dict(contexts[holder].policy_state.get(_STATE_KEY))
        demand = {role: role_demand(ctx) for role, (_, ctx) in by_role.items()}
        state, out = decide(state, demand, cfg, time.time(), paired=paired)
        self._publish(any_ctx.app_name, "application", out, demand, state)
        decisions = {by_role[role][0]: d.replicas for role, d in out.items()}
        states: dict[Any, dict[str, Any]] = {dep: {} for dep in contexts}
        states[holder] = {_STATE_KEY: state.to_dict()}
        return decisions, states


class RoleAutoscaler:
    """The deployment-level policy: one role on its own demand (no application policy)."""

    def __init__(
        self,
        autoscaling: dict[str, Any] | None = None,
        role: str = "prefill",
        paired: bool = False,
        **_: Any,
    ) -> None:
        self.cfg = AutoscaleConfig.model_validate(autoscaling or {})
        self.role = role
        self._publish = _Publisher()

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = AutoscaleState.from_dict(ctx.policy_state.get(_STATE_KEY))
        demand = {self.role: role_demand(ctx)}
        state, out = decide(state, demand, self.cfg, time.time(), paired=False)
        self._publish(f"{ctx.app_name}/{self.role}", "deployment", out, demand, state)
        return out[self.role].replicas, {_STATE_KEY: state.to_dict()}
