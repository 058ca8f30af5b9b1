"""The app's config tree: defaults valid, unknown keys refused, cross-field errors name fields,
env overrides read in one place, per-replica ports, and one engine launch per role."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.config import (
    AppConfig,
    apply_env_overrides,
    engine_launch,
    load_app_config,
    replica_ports,
)
from engines.launch import engine_args, launch_env

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["pd_default.yaml", "pd_cluster.yaml", "pd_autoscale.yaml", "pd_multinode.yaml"]


def _ports(start: int = 40000):  # type: ignore[no-untyped-def]
    n = iter(range(start, start + 100))
    return lambda: next(n)


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_engines_take_every_request_their_ingress_can_send(name: str) -> None:
    """Serve's cap on an engine replica never binds before the ingress's own: past it,
    requests queue in Serve's handles, uncounted by any engine report and unordered by the
    engine's scheduler (a soak at 1.5x saturation had 504s there at the old 256)."""
    raw = yaml.safe_load((ROOT / "configs" / name).read_text())
    cfg = load_app_config(raw["applications"][0]["args"], environ={})
    sendable = cfg.ingress.max_ongoing_requests * cfg.ingress.num_replicas
    for role in (cfg.prefill, cfg.decode):
        assert role.max_ongoing_requests >= sendable, (name, role.max_ongoing_requests, sendable)


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_yaml_validates_with_serve_and_ours(name: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "configs" / name).read_text())
    ServeDeploySchema.model_validate(raw)
    app = raw["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    assert "working_dir" not in app.get("runtime_env", {})  # serve deploy rejects local paths
    cfg = load_app_config(app["args"], environ={})
    assert cfg.prefill.cpu_bind != cfg.decode.cpu_bind
    cpus = (
        cfg.prefill.num_cpus * cfg.prefill.num_replicas
        + cfg.decode.num_cpus * cfg.decode.num_replicas
        + cfg.ingress.num_cpus * cfg.ingress.num_replicas
    )
    assert cpus < 8  # fits `pdserve up`'s local head (--num-cpus=8)


def test_cluster_yaml_scales_out_on_redis() -> None:
    raw = yaml.safe_load((ROOT / "configs" / "pd_cluster.yaml").read_text())
    cfg = load_app_config(raw["applications"][0]["args"], environ={})
    assert cfg.prefill.num_replicas == 2 and cfg.decode.num_replicas == 1
    assert cfg.index.backend == "redis" and cfg.ingress.num_replicas == 2


def test_unknown_key_is_refused_with_its_name() -> None:
    with pytest.raises(ValidationError, match="prefil"):
        AppConfig.model_validate({"prefil": {}})
    with pytest.raises(ValidationError, match="num_cpu"):
        AppConfig.model_validate({"decode": {"num_cpu": 1}})
    with pytest.raises(ValidationError, match="endpoint"):  # the old KV-events form
        AppConfig.model_validate(
            {"prefill": {"num_cpus": 1, "kv_events": {"endpoint": "tcp://*:5557"}}}
        )


def test_overlapping_base_ports_name_both_roles() -> None:
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate(
            {
                "prefill": {"num_cpus": 1, "num_replicas": 3, "nixl_side_channel_port": 5600},
                "decode": {"num_cpus": 1, "nixl_side_channel_port": 5602},
            }
        )
    msg = str(e.value)
    assert "prefill.nixl_side_channel_port" in msg and "decode.nixl_side_channel_port" in msg
    with pytest.raises(ValidationError, match="kv_events.port"):
        AppConfig.model_validate(
            {
                "prefill": {"num_cpus": 1, "num_replicas": 2, "kv_events": {"port": 5700}},
                "decode": {"num_cpus": 1, "kv_events": {"port": 5703}},
            }
        )
    # disjoint ranges are fine
    AppConfig.model_validate(
        {
            "prefill": {"num_cpus": 1, "num_replicas": 2, "nixl_side_channel_port": 5600},
            "decode": {"num_cpus": 1, "nixl_side_channel_port": 5602},
        }
    )


def test_memory_index_needs_one_ingress() -> None:
    with pytest.raises(ValidationError, match="index.backend"):
        AppConfig.model_validate({"ingress": {"num_replicas": 2}})
    cfg = AppConfig.model_validate({"ingress": {"num_replicas": 2}, "index": {"backend": "redis"}})
    assert cfg.ingress.num_replicas == 2


def test_replica_ports_never_collide() -> None:
    cfg = AppConfig.model_validate({"prefill": {"num_cpus": 1, "num_replicas": 2}})
    free = _ports()
    a = replica_ports(cfg, "prefill", 0, "10.0.0.5", free)
    b = replica_ports(cfg, "prefill", 1, "10.0.0.5", free)
    taken = [a.nixl, a.kv_events, a.kv_replay, b.nixl, b.kv_events, b.kv_replay]
    assert len(set(taken)) == 6 and a.host == "10.0.0.5"
    based = AppConfig.model_validate(
        {
            "prefill": {
                "num_cpus": 1,
                "num_replicas": 2,
                "nixl_side_channel_port": 5600,
                "nixl_side_channel_host": "prefill.svc",
                "kv_events": {"port": 5700},
            }
        }
    )
    r1 = replica_ports(based, "prefill", 1, "10.0.0.5", _ports())
    assert (r1.nixl, r1.kv_events, r1.kv_replay, r1.host) == (5601, 5702, 5703, "prefill.svc")
    off = AppConfig.model_validate({"decode": {"num_cpus": 1, "kv_events": {"enabled": False}}})
    assert replica_ports(off, "decode", 0, "h", _ports()).kv_events is None


@pytest.mark.parametrize("bind", ["all", "0-", "a"])
def test_cpu_bind_rejects_what_vllm_rejects(bind: str) -> None:
    with pytest.raises(ValidationError, match="cpu_bind"):
        AppConfig.model_validate({"prefill": {"num_cpus": 1, "cpu_bind": bind}})


def test_bounds_in_the_types() -> None:
    with pytest.raises(ValidationError, match="num_cpus"):
        AppConfig.model_validate({"prefill": {"num_cpus": 0}})
    with pytest.raises(ValidationError, match="nixl_side_channel_port"):
        AppConfig.model_validate({"prefill": {"num_cpus": 1, "nixl_side_channel_port": 80}})
    with pytest.raises(ValidationError, match="num_replicas"):
        AppConfig.model_validate({"prefill": {"num_cpus": 1, "num_replicas": 0}})
    with pytest.raises(ValidationError, match="stats_period_s"):
        AppConfig.model_validate({"routing": {"stats_period_s": 2}})


def test_env_overrides_in_one_place() -> None:
    env = {
        "PDSERVE_MODEL": "/models/x",
        "PDSERVE_API_KEYS": "k1=alice, k2=bob",
        "PDSERVE_CACHE_DIR": "/c",
        "PDSERVE_REDIS_URL": "redis://redis.pdserve:6379/0",
    }
    cfg = load_app_config({"model": {"served_name": "m"}}, environ=env)
    assert cfg.model.path == "/models/x" and cfg.model.served_name == "m"
    assert cfg.ingress.api_keys == {"k1": "alice", "k2": "bob"}
    assert cfg.cache_dir == "/c"
    assert cfg.index.redis_url == "redis://redis.pdserve:6379/0"
    assert apply_env_overrides({"a": 1}, environ={}) == {"a": 1}


def test_malformed_api_keys_env_names_the_variable() -> None:
    with pytest.raises(ValueError, match="PDSERVE_API_KEYS"):
        apply_env_overrides({}, environ={"PDSERVE_API_KEYS": "justakey"})


def test_engine_launch_per_role() -> None:
    cfg = AppConfig()
    pp = replica_ports(cfg, "prefill", 0, "10.1.1.1", _ports(41000))
    dp = replica_ports(cfg, "decode", 0, "10.1.1.1", _ports(42000))
    p, d = (
        engine_args(engine_launch(cfg, "prefill", pp)),
        engine_args(engine_launch(cfg, "decode", dp)),
    )
    for kw in (p, d):
        ktc = kw["kv_transfer_config"]
        assert ktc["kv_connector"] == "NixlConnector"
        assert ktc["kv_connector_module_path"] == "engines.nixl_connector"
        assert ktc["kv_buffer_device"] == "cpu"
        assert ktc["kv_connector_extra_config"]["nixl_progress_thread"] is False
        assert ktc["kv_connector_extra_config"]["nixl_progress_poll_us"] == 1000  # paced
        # one hashing field, given to every engine (and the ingress)
        assert kw["prefix_caching_hash_algo"] == cfg.hashing.algo
        assert kw["block_size"] == cfg.hashing.block_size
    assert p["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert d["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert d["kv_transfer_config"]["kv_load_failure_policy"] == "recompute"
    # KV events on Unix sockets by default: no port, this node's user only
    from deployments.config import kv_events_ipc_dir

    folder = kv_events_ipc_dir()
    assert p["kv_events_config"]["endpoint"] == f"ipc://{folder}/kv-{pp.kv_events}.pub"
    assert p["kv_events_config"]["replay_endpoint"] == f"ipc://{folder}/kv-{pp.kv_replay}.replay"
    assert folder.stat().st_mode & 0o777 == 0o700
    tcp = AppConfig.model_validate({"prefill": {"num_cpus": 1, "kv_events": {"transport": "tcp"}}})
    t = engine_args(engine_launch(tcp, "prefill", pp))
    assert t["kv_events_config"]["endpoint"] == f"tcp://*:{pp.kv_events}"
    assert t["kv_events_config"]["replay_endpoint"] == f"tcp://*:{pp.kv_replay}"
    assert "scheduler_cls" not in p
    env = launch_env(engine_launch(cfg, "prefill", pp))
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(pp.nixl)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.1.1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["PYTHONHASHSEED"] == cfg.hashing.seed
    unseeded = AppConfig.model_validate({"hashing": {"seed": None}})
    assert launch_env(engine_launch(unseeded, "decode", dp))["PYTHONHASHSEED"] is None


def test_gpu_and_placement_settings_reach_the_engine_and_ray() -> None:
    from deployments.app import actor_options

    cfg = AppConfig.model_validate(
        {
            "decode": {
                "num_cpus": 4,
                "num_gpus": 1,
                "resources": {"pdserve_decode": 1},
                "kv_buffer_device": "cuda",
            },
            "ingress": {"resources": {"pdserve_ingress": 1}},
        }
    )
    dp = replica_ports(cfg, "decode", 0, "10.1.1.1", _ports(42000))
    assert (
        engine_args(engine_launch(cfg, "decode", dp))["kv_transfer_config"]["kv_buffer_device"]
        == "cuda"
    )
    d = cfg.decode
    assert actor_options(d.num_cpus, d.num_gpus, d.resources) == {
        "num_cpus": 4,
        "num_gpus": 1,
        "resources": {"pdserve_decode": 1},
    }
    p = cfg.prefill  # the CPU defaults: no GPU, no custom resources asked of Ray
    assert actor_options(p.num_cpus, p.num_gpus, p.resources) == {"num_cpus": 1.0}


def test_the_engine_runtime_is_async_llm_on_gpu_in_process_on_cpu_unless_named() -> None:
    """``runtime: auto`` picks AsyncLLM for a GPU role and the in-process engine on CPU; a
    named runtime wins; the launch carries it into the engine's environment; a bad value is
    refused naming the field; each start function refuses the other runtime's launch."""
    from engines.launch import start_async_engine, start_engine

    gpu = {"num_cpus": 4, "num_gpus": 1, "kv_buffer_device": "cuda"}
    cfg = AppConfig.model_validate({"decode": gpu})
    assert cfg.decode.resolved_runtime == "async_llm"
    assert cfg.prefill.resolved_runtime == "in_process"  # the CPU defaults
    named = AppConfig.model_validate(
        {
            "prefill": {"num_cpus": 1, "runtime": "async_llm"},
            "decode": {**gpu, "runtime": "in_process"},
        }
    )
    assert named.prefill.resolved_runtime == "async_llm"
    assert named.decode.resolved_runtime == "in_process"
    pp = replica_ports(named, "prefill", 0, "10.1.1.1", _ports(43000))
    dp = replica_ports(named, "decode", 0, "10.1.1.1", _ports(44000))
    pl, dl = engine_launch(named, "prefill", pp), engine_launch(named, "decode", dp)
    assert (pl.runtime, dl.runtime) == ("async_llm", "in_process")
    assert launch_env(pl)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert launch_env(dl)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with pytest.raises(ValidationError, match="decode.runtime"):
        AppConfig.model_validate({"decode": {"num_cpus": 1, "runtime": "multiprocess"}})
    with pytest.raises(ValueError, match="runtime"):
        start_engine(pl)
    with pytest.raises(ValueError, match="runtime"):
        start_async_engine(dl)


def test_xxhash_needs_a_seed() -> None:
    with pytest.raises(ValidationError, match="hashing.seed"):
        AppConfig.model_validate({"hashing": {"algo": "xxhash", "seed": None}})


def test_the_engine_settings_reach_the_launch_as_they_are() -> None:
    """A role's section and the engine's launch share one definition of the engine's own vLLM
    settings (engines.launch.EngineSettings); engine_launch hands every one of them on."""
    from engines.launch import EngineSettings

    cfg = AppConfig.model_validate(
        {
            "prefill": {
                "num_cpus": 1,
                "enforce_eager": False,
                "enable_prefix_caching": False,
                "max_num_seqs": 7,
                "kv_cache_gib": 3,
                "cpu_bind": "0-1",
                "scheduler_cls": "engines.scheduler.FairwayScheduler",
            }
        }
    )
    launch = engine_launch(cfg, "prefill", replica_ports(cfg, "prefill", 0, "h", _ports()))
    assert isinstance(cfg.prefill, EngineSettings) and isinstance(launch, EngineSettings)
    assert launch.engine_settings() == cfg.prefill.engine_settings()
    assert cfg.prefill.engine_settings()["max_num_seqs"] == 7
    with pytest.raises(ValidationError, match="prefill.cpu_bind"):
        AppConfig.model_validate({"prefill": {"num_cpus": 1, "cpu_bind": "all"}})


def test_hashing_is_defined_once() -> None:
    """The ``hashing`` section is cluster's ``HashConfig`` narrowed (a seed by default, a block
    size vLLM takes), and the engines' launch takes the same algorithms (the two layers may
    not import each other, so each names them: they must stay equal)."""
    from typing import get_args

    from cluster.hashing import HashAlgo, HashConfig
    from engines.launch import HashAlgo as LaunchHashAlgo

    assert get_args(HashAlgo) == get_args(LaunchHashAlgo)
    h = AppConfig().hashing
    assert isinstance(h, HashConfig)
    assert h.hash_config() == HashConfig(algo="sha256", block_size=128, seed="0")
    with pytest.raises(ValidationError, match="hashing.seed"):
        AppConfig.model_validate({"hashing": {"seed": "4294967296"}})
    with pytest.raises(ValidationError, match="hashing.block_size"):
        AppConfig.model_validate({"hashing": {"block_size": 8}})


def test_scheduler_plugins_are_validated_at_deploy_time() -> None:
    raw = yaml.safe_load((ROOT / "configs" / "pd_default.yaml").read_text())
    cfg = load_app_config(raw["applications"][0]["args"], environ={})
    pp = replica_ports(cfg, "prefill", 0, "h", _ports())
    p = engine_args(engine_launch(cfg, "prefill", pp))
    d = engine_args(engine_launch(cfg, "decode", replica_ports(cfg, "decode", 0, "h", _ports())))
    assert p["scheduler_cls"] == "engines.scheduler.FairwayScheduler"
    assert d["scheduler_cls"] == "engines.scheduler.TWPScheduler"
    # profile: auto -> the profile measured for this platform, vLLM and the test preset
    assert p["additional_config"]["pdserve"]["profile"] == "cpu2core_vllm032_test"
    with pytest.raises(ValidationError, match="scheduler_config is set but scheduler_cls"):
        AppConfig.model_validate({"prefill": {"num_cpus": 1, "scheduler_config": {}}})
    # a fair share the class would ignore (TWPScheduler orders no prefill queue by default):
    # refused, since the ingress's wait bound reads the share as kept
    twp = {"num_cpus": 1, "scheduler_cls": "engines.scheduler.TWPScheduler"}
    with pytest.raises(ValidationError, match="scheduler_config.fair_share: the scheduler class"):
        AppConfig.model_validate({"prefill": {**twp, "scheduler_config": {"fair_share": True}}})
    policy = {"fair_share": True, "prefill_policy": "fcfs"}
    AppConfig.model_validate({"prefill": {**twp, "scheduler_config": policy}})
    fw = {"num_cpus": 1, "scheduler_cls": "engines.scheduler.FairwayScheduler"}
    AppConfig.model_validate({"prefill": {**fw, "scheduler_config": {"fair_share": True}}})
    from engines.launch import EngineLaunch  # the tools' launch checks it too

    with pytest.raises(ValidationError, match="scheduler.fair_share: the scheduler class"):
        EngineLaunch(
            model="m",
            cache_dir="c",
            scheduler_cls="engines.scheduler.AsyncTWPScheduler",
            scheduler={"fair_share": True},
        )
    # only the shipped plug-ins
    with pytest.raises(ValidationError, match="scheduler_cls"):
        AppConfig.model_validate({"prefill": {"num_cpus": 1, "scheduler_cls": "a.B"}})
    # the plug-in's own fields, named
    with pytest.raises(ValidationError, match="prefill_policy"):
        AppConfig.model_validate(
            {
                "prefill": {
                    "num_cpus": 1,
                    "scheduler_cls": "engines.scheduler.FairwayScheduler",
                    "scheduler_config": {"prefill_policy": "nope"},
                }
            }
        )
    with pytest.raises(ValidationError, match="profile"):
        AppConfig.model_validate(
            {
                "prefill": {
                    "num_cpus": 1,
                    "scheduler_cls": "engines.scheduler.FairwayScheduler",
                    "scheduler_config": {"profile": "no_such_profile"},
                }
            }
        )


def test_profile_auto_names_the_field_or_takes_the_named_fallback(tmp_path: Path) -> None:
    """A model with no measured profile: ``auto`` is a config error naming the field and
    saying how to measure one, unless ``profile_fallback`` names a profile."""
    engine = {
        "num_cpus": 1,
        "scheduler_cls": "engines.scheduler.TWPScheduler",
        "scheduler_config": {"profile": "auto"},
    }
    model = {"path": str(tmp_path / "mine"), "build_preset": None}
    with pytest.raises(
        ValidationError, match=r"decode.scheduler_config.profile: .*pdserve profile"
    ):
        AppConfig.model_validate({"model": model, "decode": engine})
    fallback = {
        **engine,
        "scheduler_config": {"profile": "auto", "profile_fallback": "v100_llama32_3b"},
    }
    cfg = AppConfig.model_validate({"model": model, "decode": fallback})
    sc = cfg.scheduler_config("decode")
    assert sc is not None and sc.profile == "v100_llama32_3b"
    bench = AppConfig.model_validate(
        {"model": {**model, "build_preset": "bench"}, "decode": engine}
    )
    sc = bench.scheduler_config("decode")
    assert sc is not None and sc.profile == "cpu2core_vllm032_bench"
