"""The Serve application: ``deployments.app:build_app`` (the ``import_path`` of configs/*.yaml).

``build_app(args)`` validates ``args`` into :class:`deployments.config.AppConfig` (a bad config
fails here, at deploy time, with the field named), builds the model when it is missing and the
config allows, and binds three deployments: ``prefill`` and ``decode``
(``num_replicas`` :class:`~deployments.engine.EngineReplica` each, with the config's fractional
``num_cpus``, routed by :mod:`deployments.router` and reporting their load every
``routing.stats_period_s``) and the FastAPI ``ingress``. With ``autoscaling.enabled`` the
engine deployments get an ``autoscaling_config`` instead of a replica count (the serverless
autoscaler, :mod:`deployments.autoscaling`).
"""

from __future__ import annotations

import fcntl
import logging
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.autoscaling import serve_autoscaling_config
from deployments.config import AppConfig, Role, live_defaults, load_app_config
from deployments.engine import EngineReplica
from deployments.ingress.http import Ingress

log = logging.getLogger("deployments.app")

Engine: Any = serve.deployment(EngineReplica, name="engine")


def ensure_model(cfg: AppConfig) -> None:
    """Build ``cfg.model`` into its folder when missing and ``build_preset`` allows, or
    rebuild it when an older builder wrote it (:func:`engines.model_builder.is_stale`: its
    chat template or tokens changed since), with the preset and seed its card records.

    Serialised with a file lock, so concurrent deploys build it once. A missing model with
    ``build_preset: null`` is a ``FileNotFoundError`` naming ``model.path``; a stale one with
    ``build_preset: null`` (a folder baked into an image, say) is left as it is, with a
    warning.
    """
    from engines.model_builder import build_model, is_stale, model_card

    path = cfg.model.resolved_path()
    if (path / "config.json").exists() and not is_stale(path):
        return
    if cfg.model.build_preset is None:
        if (path / "config.json").exists():
            log.warning(
                "model.path: %s was built by an older engines.model_builder (its chat template "
                "or tokens differ); model.build_preset is null, so it is not rebuilt",
                path,
            )
            return
        raise FileNotFoundError(
            f"model.path: {path} has no config.json and model.build_preset is null"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").exists():
            build_model(path, cfg.model.build_preset, cfg.model.build_seed)
        elif is_stale(path):
            card = model_card(path) or {}
            build_model(path, str(card["preset"]), int(card.get("seed", 0)))


def check_parsers(cfg: AppConfig) -> None:
    """The tool-call and reasoning parsers ``cfg.model`` names, built once with the model's
    tokenizer, so one that cannot serve it (a reasoning parser whose think tokens it lacks)
    fails the deploy naming the fields, not each ingress replica's start. Nothing is loaded
    when none is named."""
    if cfg.model.tool_call_parser is None and cfg.model.reasoning_parser is None:
        return
    from transformers import AutoTokenizer

    from deployments.ingress.parsing import OutputParsers

    OutputParsers(cfg.model, AutoTokenizer.from_pretrained(str(cfg.model.resolved_path())))


def request_router_config(cfg: AppConfig, role: Role) -> RequestRouterConfig:
    """The Serve router of ``role``'s deployment for ``cfg.routing``."""
    from deployments.router import DecodeRouter, PrefillRouter, ServeDefaultRouter

    routing = cfg.routing.model_dump(mode="json")
    cls: type = ServeDefaultRouter
    # warm first: the autoscaler adds replicas under traffic (deployments.router)
    kwargs: dict[str, Any] = {"routing": routing, "warm_first": cfg.autoscaling.enabled}
    if cfg.routing.policy != "serve_default":
        cls = PrefillRouter if role == "prefill" else DecodeRouter
        kwargs["block_size"] = cfg.hashing.block_size
    options: dict[str, Any] = {
        "request_router_class": cls,
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": cfg.routing.stats_period_s,
        "request_routing_stats_timeout_s": max(1.0, 10 * cfg.routing.stats_period_s),
    }
    return RequestRouterConfig(**options)


def actor_options(num_cpus: float, num_gpus: float, resources: dict[str, float]) -> dict[str, Any]:
    """A replica's ``ray_actor_options``: its CPUs, GPUs and custom resources (which pin a
    role to the worker group or nodes that advertise them)."""
    out: dict[str, Any] = {"num_cpus": num_cpus}
    if num_gpus:
        out["num_gpus"] = num_gpus
    if resources:
        out["resources"] = dict(resources)
    return out


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The PD application for ``args`` (a Serve YAML's ``args``; see ``AppConfig``)."""
    cfg = load_app_config(args or {})
    cfg.check_auth()  # closed by default: keys, or `ingress.auth: none` said explicitly
    ensure_model(cfg)
    check_parsers(cfg)
    d = cfg.model_dump(mode="json")
    live = live_defaults(cfg)
    engines = {}
    # colocated: one deployment ("prefill") whose engines do both phases
    roles: tuple[Role, ...] = ("prefill",) if cfg.mode == "colocated" else ("prefill", "decode")
    for role in roles:
        e = cfg.engine(role)
        scale: dict[str, Any] = {"num_replicas": e.num_replicas}
        if cfg.autoscaling.enabled:  # the serverless autoscaler (deployments.autoscaling)
            paired = cfg.mode != "colocated"
            policy = cfg.resolved_autoscaling()  # SLO targets get the profile's decode curve
            scale = {"autoscaling_config": serve_autoscaling_config(policy, role, paired)}
        engines[role] = Engine.options(
            name=role,
            **scale,
            max_ongoing_requests=e.max_ongoing_requests,
            ray_actor_options=actor_options(e.num_cpus, e.num_gpus, e.resources),
            health_check_timeout_s=60,
            health_check_period_s=e.health_check_period_s,
            graceful_shutdown_timeout_s=e.drain_timeout_s,
            request_router_config=request_router_config(cfg, role),
            user_config=live[role] or None,
        ).bind(d, role)
    ingress: Any = Ingress
    return ingress.options(
        num_replicas=cfg.ingress.num_replicas,
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options=actor_options(cfg.ingress.num_cpus, 0, cfg.ingress.resources),
        user_config=live["ingress"],
    ).bind(d, engines["prefill"], engines.get("decode", engines["prefill"]))
