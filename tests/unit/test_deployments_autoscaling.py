"""The Serve side of the autoscaler (deployments.autoscaling): Serve's contexts -> the pure
policy -> counts per deployment, the deployments' autoscaling_config, the shipped YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from controllers.autoscale import AutoscaleConfig, RoleBounds
from deployments.autoscaling import (
    APP_POLICY,
    PDAutoscaler,
    RoleAutoscaler,
    role_demand,
    serve_autoscaling_config,
)

ROOT = Path(__file__).resolve().parents[2]
CFG = AutoscaleConfig(
    enabled=True,
    prefill=RoleBounds(min_replicas=0, max_replicas=3),
    decode=RoleBounds(min_replicas=0, max_replicas=2),
    idle_to_zero_s=60,
)


def context(
    name: str,
    running: int,
    queued: float = 0.0,
    metrics: dict[str, list[float]] | None = None,
    state: dict[str, Any] | None = None,
) -> tuple[DeploymentID, AutoscalingContext]:
    dep = DeploymentID(name=name, app_name="app")
    replicas = [ReplicaID(unique_id=f"{name}-{i}", deployment_id=dep) for i in range(running)]
    agg = {k: {replicas[i]: v for i, v in enumerate(vs)} for k, vs in (metrics or {}).items()}
    cfg = AutoscalingConfig(**serve_autoscaling_config(CFG, name, paired=True))
    return dep, AutoscalingContext(
        deployment_id=dep,
        deployment_name=name,
        app_name="app",
        current_num_replicas=running,
        target_num_replicas=running,
        running_replicas=replicas,
        total_num_requests=queued,
        total_queued_requests=queued,
        aggregated_metrics=agg,
        raw_metrics={},
        capacity_adjusted_min_replicas=0,
        capacity_adjusted_max_replicas=3,
        policy_state=state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=cfg,
    )


def test_role_demand_sums_the_running_replicas_metrics() -> None:
    _, ctx = context(
        "prefill",
        2,
        queued=1,
        metrics={
            "requests_in_flight": [2, 1],
            "queued_uncached_tokens": [500, 700],
            "prefill_tokens_per_s": [1000, 3000],
            "uncached_tokens_total": [10, 20],
        },
    )
    d = role_demand(ctx)
    assert (d.running, d.handle_queued, d.ongoing) == (2, 1.0, 4.0)
    assert d.queued_uncached_tokens == 1200
    assert d.tokens_per_s == 2000  # a per-replica rate: the mean
    assert d.uncached_tokens_total == 30
    assert d.prompt_tokens_mean is None and d.prompt_tokens_p99 is None  # not reported


def test_role_demand_takes_the_replicas_prompt_mean_and_their_largest_p99() -> None:
    """The pool's p99 is at most its largest replica p99 (at most 1% of each replica's
    prompts exceed it), so the sizing is never optimistic; a replica that reported no
    prompts yet (0) does not pull the mean down."""
    _, ctx = context(
        "prefill",
        3,
        metrics={"prompt_tokens_mean": [100, 300, 0], "prompt_tokens_p99": [400, 900, 0]},
    )
    d = role_demand(ctx)
    assert (d.prompt_tokens_mean, d.prompt_tokens_p99) == (200, 900)


def test_the_application_policy_starts_both_roles_from_zero_and_keeps_state() -> None:
    policy = PDAutoscaler()
    pre, pctx = context("prefill", 0, queued=1)
    dec, dctx = context("decode", 0)
    counts, states = policy({pre: pctx, dec: dctx})
    assert counts == {pre: 1, dec: 1}
    assert "pdserve" in states[pre]  # the pure policy's state rides in Serve's policy_state
    # the next call carries it: a busy pair (state says active) does not go to zero
    pre, pctx = context("prefill", 1, metrics={"requests_in_flight": [0]}, state=states[pre])
    dec, dctx = context("decode", 1, metrics={"requests_in_flight": [0]})
    counts, _ = policy({pre: pctx, dec: dctx})
    assert counts == {pre: 1, dec: 1}


def test_the_role_policy_scales_one_role_on_its_own() -> None:
    policy = RoleAutoscaler(
        **serve_autoscaling_config(CFG, "prefill", False)["policy"]["policy_kwargs"]
    )
    _, ctx = context("prefill", 0, queued=2)
    n, state = policy(ctx)
    assert n == 1 and "pdserve" in state


def test_serve_takes_the_deployment_config_and_the_yaml_names_the_app_policy() -> None:
    from ray.serve.config import AutoscalingPolicy
    from ray.serve.schema import ServeDeploySchema

    cfg = AutoscalingConfig(**serve_autoscaling_config(CFG, "decode", paired=True))
    assert (cfg.min_replicas, cfg.max_replicas, cfg.upscale_delay_s, cfg.downscale_delay_s) == (
        0,
        2,
        0.0,
        0.0,
    )
    raw = yaml.safe_load((ROOT / "configs" / "pd_autoscale.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    app = raw["applications"][0]
    assert app["autoscaling_policy"]["policy_function"] == APP_POLICY
    policy = AutoscalingPolicy(**app["autoscaling_policy"])  # imports and pickles it, as Serve
    assert isinstance(policy.get_policy()(), PDAutoscaler)
    assert AutoscaleConfig.model_validate(app["args"]["autoscaling"]).enabled


def test_build_app_gives_the_engines_autoscaling_configs(tmp_path: Path) -> None:
    from deployments.app import build_app

    raw = yaml.safe_load((ROOT / "configs" / "pd_autoscale.yaml").read_text())
    args = raw["applications"][0]["args"]
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args["model"] = {**args["model"], "path": str(model)}  # config.json there: not built
    app = build_app(args)
    deps = {d.name: d for d in _deployments(app)}
    for role in ("prefill", "decode"):
        ac = deps[role]._deployment_config.autoscaling_config
        assert ac is not None and ac.min_replicas == 0 and ac.initial_replicas == 0
        assert ac.policy.policy_kwargs["role"] == role
    assert deps["ingress"]._deployment_config.autoscaling_config is None


def _deployments(app: Any) -> list[Any]:
    out, todo = [], [app._bound_deployment]
    while todo:
        d = todo.pop()
        out.append(d)
        todo.extend(a._bound_deployment for a in d.init_args if hasattr(a, "_bound_deployment"))
    return out


@pytest.mark.parametrize("bad", [{"prefill": {"min_replicas": 3, "max_replicas": 1}}])
def test_a_bad_autoscaling_section_names_the_field(bad: dict[str, Any]) -> None:
    from pydantic import ValidationError

    from deployments.config import load_app_config

    with pytest.raises(ValidationError, match="autoscaling.prefill"):
        load_app_config({"autoscaling": {"enabled": True, **bad}}, environ={})


@pytest.mark.parametrize(
    ("slo", "field"),
    [
        ({"ttft_p99_s": 0, "itl_p99_s": 0.05}, "autoscaling.slo.ttft_p99_s"),
        (
            {"ttft_p99_s": 2, "itl_p99_s": 0.05, "max_cold_fraction": 1},
            "autoscaling.slo.max_cold_fraction",
        ),
        ({"ttft_p99_s": 2}, "autoscaling.slo.itl_p99_s"),
    ],
)
def test_a_bad_slo_section_names_the_field(slo: dict[str, Any], field: str) -> None:
    from pydantic import ValidationError

    from deployments.config import load_app_config

    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        load_app_config({"autoscaling": {"enabled": True, "slo": slo}}, environ={})


def test_the_slo_section_rides_in_the_policy_kwargs() -> None:
    from controllers.profile import DecodeProfile
    from controllers.slo_sizing import SloConfig

    step = DecodeProfile(l_min_s=0.024, b0=32, alpha_s=0.0004)
    cfg = CFG.model_copy(
        update={"slo": SloConfig(ttft_p99_s=2.0, itl_p99_s=0.05, decode_step=step)}
    )
    kw = serve_autoscaling_config(cfg, "prefill", False)["policy"]["policy_kwargs"]
    assert AutoscaleConfig.model_validate(kw["autoscaling"]).slo == cfg.slo
    policy = RoleAutoscaler(**kw)
    assert policy.cfg.slo == cfg.slo
    _, ctx = context("prefill", 0, queued=2)
    n, state = policy(ctx)
    assert n == 1 and "windows" in state["pdserve"]


def test_an_slo_without_a_step_curve_gets_the_decode_profiles() -> None:
    """``build_app`` gives the policy ``resolved_autoscaling()``: the decode role's profile's
    step curve fills ``slo.decode_step``; one set by the operator stays; without a profile
    or an SLO nothing changes."""
    import copy

    from controllers.profile import DecodeProfile
    from deployments.config import load_app_config
    from engines.profile_store import load_profile

    shipped = yaml.safe_load((ROOT / "configs" / "pd_autoscale.yaml").read_text())
    base = shipped["applications"][0]["args"]
    slo = {"ttft_p99_s": 2.0, "itl_p99_s": 0.05}
    args = copy.deepcopy(base)
    args["decode"]["scheduler_config"] = {"profile": "a6000_llama31_8b"}
    args["autoscaling"] = {"enabled": True, "slo": slo}
    got = load_app_config(args, environ={}).resolved_autoscaling().slo
    assert got is not None and got.decode_step == load_profile("a6000_llama31_8b").decode
    assert got.ttft_p99_s == 2.0  # the rest as set
    mine = {**slo, "decode_step": {"l_min_s": 0.01, "b0": 8, "alpha_s": 0.001}}
    args["autoscaling"] = {"enabled": True, "slo": mine}
    got = load_app_config(args, environ={}).resolved_autoscaling().slo
    assert got is not None
    assert got.decode_step == DecodeProfile(l_min_s=0.01, b0=8, alpha_s=0.001)
    args["decode"]["scheduler_config"] = None
    args["autoscaling"] = {"enabled": True, "slo": slo}
    got = load_app_config(args, environ={}).resolved_autoscaling().slo
    assert got is not None and got.decode_step is None
    plain = load_app_config(base, environ={})
    assert plain.resolved_autoscaling() == plain.autoscaling


def test_role_demand_takes_the_slowest_decode_floor_the_gates_measure() -> None:
    """The pool's ITL p99 is its slowest replica's, so the sizing takes the largest measured
    ``l_min``; none reported (no TWP gate), none used."""
    _, ctx = context("decode", 3, metrics={"decode_l_min_s": [0.006, 0.009, 0]})
    assert role_demand(ctx).l_min_s == 0.009
    _, ctx = context("decode", 1)
    assert role_demand(ctx).l_min_s is None
