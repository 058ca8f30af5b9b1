"""The app's config tree: defaults valid, unknown keys refused, cross-field errors name fields,
env overrides read in one place, engine args and env per role."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.config import (
    AppConfig,
    apply_env_overrides,
    engine_args_kwargs,
    engine_env,
    load_app_config,
)

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_yaml_validates_with_serve_and_ours() -> None:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "configs" / "pd_default.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    app = raw["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    assert "working_dir" not in app.get("runtime_env", {})  # serve deploy rejects local paths
    cfg = load_app_config(app["args"], environ={})
    assert cfg.prefill.nixl_side_channel_port != cfg.decode.nixl_side_channel_port
    assert cfg.prefill.cpu_bind != cfg.decode.cpu_bind
    assert cfg.prefill.num_cpus + cfg.decode.num_cpus + cfg.ingress.num_cpus < 8


def test_unknown_key_is_refused_with_its_name() -> None:
    with pytest.raises(ValidationError, match="prefil"):
        AppConfig.model_validate({"prefil": {}})
    with pytest.raises(ValidationError, match="num_cpu"):
        AppConfig.model_validate({"decode": {"num_cpu": 1, "nixl_side_channel_port": 5700}})


def test_shared_side_channel_port_names_both_fields() -> None:
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate(
            {
                "prefill": {"num_cpus": 1, "nixl_side_channel_port": 5600},
                "decode": {"num_cpus": 1, "nixl_side_channel_port": 5600},
            }
        )
    msg = str(e.value)
    assert "prefill.nixl_side_channel_port" in msg and "decode.nixl_side_channel_port" in msg


def test_shared_kv_events_endpoint_is_refused() -> None:
    ev = {"endpoint": "tcp://*:5557"}
    with pytest.raises(ValidationError, match="KV-events endpoint"):
        AppConfig.model_validate(
            {
                "prefill": {"num_cpus": 1, "nixl_side_channel_port": 5600, "kv_events": ev},
                "decode": {"num_cpus": 1, "nixl_side_channel_port": 5610, "kv_events": ev},
            }
        )


def test_kv_events_endpoint_must_bind() -> None:
    with pytest.raises(ValidationError, match="no '\\*'"):
        AppConfig.model_validate(
            {
                "prefill": {
                    "num_cpus": 1,
                    "nixl_side_channel_port": 5600,
                    "kv_events": {"endpoint": "tcp://127.0.0.1:5557"},
                }
            }
        )


@pytest.mark.parametrize("bind", ["all", "0-", "a"])
def test_cpu_bind_rejects_what_vllm_rejects(bind: str) -> None:
    with pytest.raises(ValidationError, match="cpu_bind"):
        AppConfig.model_validate(
            {"prefill": {"num_cpus": 1, "nixl_side_channel_port": 5600, "cpu_bind": bind}}
        )


def test_bounds_in_the_types() -> None:
    with pytest.raises(ValidationError, match="num_cpus"):
        AppConfig.model_validate({"prefill": {"num_cpus": 0, "nixl_side_channel_port": 5600}})
    with pytest.raises(ValidationError, match="nixl_side_channel_port"):
        AppConfig.model_validate({"prefill": {"num_cpus": 1, "nixl_side_channel_port": 80}})


def test_env_overrides_in_one_place() -> None:
    env = {
        "PDSERVE_MODEL": "/models/x",
        "PDSERVE_API_KEYS": "k1=alice, k2=bob",
        "PDSERVE_CACHE_DIR": "/c",
    }
    cfg = load_app_config({"model": {"served_name": "m"}}, environ=env)
    assert cfg.model.path == "/models/x" and cfg.model.served_name == "m"
    assert cfg.ingress.api_keys == {"k1": "alice", "k2": "bob"}
    assert cfg.cache_dir == "/c"
    assert apply_env_overrides({"a": 1}, environ={}) == {"a": 1}


def test_malformed_api_keys_env_names_the_variable() -> None:
    with pytest.raises(ValueError, match="PDSERVE_API_KEYS"):
        apply_env_overrides({}, environ={"PDSERVE_API_KEYS": "justakey"})


def test_engine_args_per_role() -> None:
    cfg = AppConfig()
    p, d = engine_args_kwargs(cfg, "prefill"), engine_args_kwargs(cfg, "decode")
    for kw in (p, d):
        ktc = kw["kv_transfer_config"]
        assert ktc["kv_connector"] == "NixlConnector"
        assert ktc["kv_connector_module_path"] == "engines.nixl_connector"
        assert ktc["kv_buffer_device"] == "cpu"
        assert ktc["kv_connector_extra_config"]["nixl_progress_thread"] is False
    assert p["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert d["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert d["kv_transfer_config"]["kv_load_failure_policy"] == "recompute"
    assert p["kv_events_config"]["endpoint"] != d["kv_events_config"]["endpoint"]
    assert "scheduler_cls" not in p
    cfg2 = AppConfig.model_validate(
        {"prefill": {"num_cpus": 1, "nixl_side_channel_port": 5600, "scheduler_cls": "a.B"}}
    )
    assert engine_args_kwargs(cfg2, "prefill")["scheduler_cls"] == "a.B"


def test_engine_env_per_role() -> None:
    cfg = AppConfig()
    p, d = engine_env(cfg, "prefill"), engine_env(cfg, "decode")
    assert p["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600" and d["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5610"
    assert p["VLLM_CPU_OMP_THREADS_BIND"] == "0" and d["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert p["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_scheduler_plugins_and_their_config() -> None:
    raw = yaml.safe_load((ROOT / "configs" / "pd_default.yaml").read_text())
    cfg = load_app_config(raw["applications"][0]["args"], environ={})
    p, d = engine_args_kwargs(cfg, "prefill"), engine_args_kwargs(cfg, "decode")
    assert p["scheduler_cls"] == "engines.scheduler.FairwayScheduler"
    assert d["scheduler_cls"] == "engines.scheduler.TWPScheduler"
    assert "profile" in p["additional_config"]["pdserve"]
    with pytest.raises(ValidationError, match="scheduler_config is set but scheduler_cls"):
        AppConfig.model_validate(
            {
                "prefill": {
                    "num_cpus": 1,
                    "nixl_side_channel_port": 5600,
                    "scheduler_config": {"profile": "x"},
                }
            }
        )
