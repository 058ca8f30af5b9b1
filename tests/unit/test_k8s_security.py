"""A closed cluster in the manifests (docs/security.md, docs/deploy.md): Ray's token
authentication in every overlay, every container port behind a NetworkPolicy that names its
peers, Redis's credentials from a Secret into Redis and into each role's pods only, pods
without privileges, no ``tcp://*`` bind in a shipped config, and checkov (infrastructure-as-code
scanner) over every rendered overlay and both Dockerfiles with zero failed checks besides the
reasoned skip list ``k8s/checkov-skips.yaml``."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_k8s_manifests import K8S, OVERLAYS, ROOT, app_config, one, rendered

CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"


def pods(overlay: str) -> dict[str, dict[str, Any]]:
    """Every pod template of the overlay by a name (the RayService's groups, Redis's)."""
    docs = rendered(overlay)
    out: dict[str, dict[str, Any]] = {}
    rc = one(docs, "RayService")["spec"]["rayClusterConfig"]
    out["head"] = rc["headGroupSpec"]["template"]
    for g in rc["workerGroupSpecs"]:
        out[g["groupName"]] = g["template"]
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            out[d["metadata"]["name"]] = d["spec"]["template"]
    return out


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _port_in(rule_port: dict[str, Any], port: int) -> bool:
    lo = rule_port["port"]
    return lo <= port <= rule_port.get("endPort", lo)


def test_ray_runs_token_authentication_in_every_overlay() -> None:
    for overlay in OVERLAYS:
        rc = one(rendered(overlay), "RayService")["spec"]["rayClusterConfig"]
        assert rc["authOptions"]["mode"] == "token", overlay
        assert rc["authOptions"]["secretName"], overlay
        for name, t in pods(overlay).items():
            for c in t["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                assert env.get("RAY_AUTH_MODE") != "disabled", (overlay, name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_port_is_behind_a_policy_that_names_its_peers(overlay: str) -> None:
    docs = rendered(overlay)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"]  # everything else refused
    seen = 0
    for name, t in pods(overlay).items():
        labels = t["metadata"]["labels"]
        for c in t["spec"]["containers"]:
            for p in c.get("ports", []):
                port = p["containerPort"]
                rules = [
                    r
                    for pol in policies
                    if _matches(pol["spec"]["podSelector"], labels)
                    for r in pol["spec"].get("ingress", [])
                    if any(_port_in(rp, port) for rp in r.get("ports", []))
                ]
                assert rules, f"{overlay}: {name} port {port} is in no NetworkPolicy"
                assert all(r.get("from") for r in rules), f"{name} {port}: peers not named"
                seen += 1
    assert seen >= 8


def test_the_policies_hold_each_port_to_its_peers() -> None:
    docs = rendered("cpu-tiny")
    pol = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    # from outside the namespace: the proxy only (and metrics, from monitoring)
    open_to_all = [
        n for n, p in pol.items() for r in p.get("ingress", [])
        if any("ipBlock" in f for f in r["from"])
    ]  # fmt: skip
    assert open_to_all == ["pdserve-serve"]
    assert [rp["port"] for r in pol["pdserve-serve"]["ingress"] for rp in r["ports"]] == [8000]
    (m,) = pol["pdserve-metrics"]["ingress"]
    assert m["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]  # fmt: skip
    # NIXL and UCX only between prefill and decode pods; Redis only from the Ray pods
    kv = pol["pdserve-kv-transfer"]
    roles = {"prefill", "decode"}
    assert set(kv["podSelector"]["matchExpressions"][0]["values"]) == roles
    assert set(kv["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"]) == roles
    (r,) = pol["pdserve-redis"]["ingress"]
    assert r["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve"}}}]
    # the GCS, the dashboard and the client port: only the Ray pods (and the dashboard, the
    # KubeRay operator that deploys through it)
    internal = {rp["port"] for rp in pol["pdserve-ray-internal"]["ingress"][0]["ports"]}
    assert {6379, 8265, 10001} <= internal
    assert all("podSelector" in f for f in pol["pdserve-ray-internal"]["ingress"][0]["from"])
    (op,) = pol["pdserve-dashboard-operator"]["ingress"]
    assert [p["port"] for p in op["ports"]] == [8265]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_credentials_come_from_a_secret_to_each_role_only(overlay: str) -> None:
    cfg = app_config(overlay)
    users = cfg.index.redis_users
    assert users is not None and "@" not in cfg.index.redis_url.split("//")[1].split("/")[0]
    where = {"head": users.ingress.password_file, "prefill": users.prefill.password_file}
    ps = pods(overlay)
    for group, path in [*where.items(), ("decode", None)]:
        spec = ps[group]["spec"]
        vols = {v["name"]: v for v in spec["volumes"]}
        (c,) = spec["containers"]
        mounted = {
            m["mountPath"]: vols[m["name"]]
            for m in c["volumeMounts"]
            if "secret" in vols[m["name"]]
            and vols[m["name"]]["secret"]["secretName"] == "pdserve-redis-users"
        }
        if path is None:
            assert mounted == {}, f"{group} has a Redis password it does not need"
            continue
        (mount, vol), *rest = mounted.items()
        assert not rest
        items = vol["secret"]["items"]
        assert [Path(mount) / i["path"] for i in items] == [Path(path)], group
    redis = [d for d in rendered(overlay) if d["kind"] == "StatefulSet"]
    for r in redis:  # the overlays that run Redis: its users from the same Secret
        t = r["spec"]["template"]["spec"]
        (c,) = t["containers"]
        args = c["args"]
        acl = args[args.index("--aclfile") + 1]
        assert args[args.index("--maxmemory-policy") + 1] == "volatile-lru"
        vols = {v["name"]: v for v in t["volumes"]}
        m = next(m for m in c["volumeMounts"] if acl.startswith(m["mountPath"]))
        assert vols[m["name"]]["secret"]["secretName"] == "pdserve-redis-users"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_without_privileges_and_within_limits(overlay: str) -> None:
    for name, t in pods(overlay).items():
        spec = t["spec"]
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec.get("automountServiceAccountToken") is False, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            res = c["resources"]
            assert res["requests"]["cpu"] and res["limits"]["memory"], (name, c["name"])
            assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        writable = [m for c in spec["containers"] for m in c.get("volumeMounts", [])
                    if not m.get("readOnly")]  # fmt: skip
        assert all(
            "emptyDir" in vols.get(m["name"], {}) or m["name"] == "data" for m in writable
        ), name
    rc = one(rendered(overlay), "RayService")["spec"]["rayClusterConfig"]
    a = rc["autoscalerOptions"]
    assert a["resources"]["limits"] and a["securityContext"]["allowPrivilegeEscalation"] is False


def test_dockerfiles_run_as_a_non_root_user() -> None:
    for f in ("Dockerfile", "Dockerfile.gpu"):
        lines = [ln.strip() for ln in (K8S / f).read_text().splitlines()]
        users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
        assert users and users[-1].split(":")[0] not in ("0", "root"), f
        assert users[-1] == "1000:100", f  # Ray's image's `ray`, numeric (hadolint DL3066)
        assert lines[[i for i, ln in enumerate(lines) if ln.startswith("FROM ")][0]].count(":") == 1


def test_no_shipped_config_binds_kv_events_on_every_interface() -> None:
    from deployments.config import engine_launch, load_app_config, replica_ports

    configs = sorted((ROOT / "configs").glob("*.yaml")) + [
        K8S / "overlays" / o / "serve.yaml" for o in OVERLAYS
    ]
    for path in configs:
        assert "tcp://*" not in path.read_text(), path
        raw = yaml.safe_load(path.read_text())
        for app in raw.get("applications", []):
            env = {"PDSERVE_REDIS_URL": "redis://redis.test:6379/0"}
            cfg = load_app_config(app.get("args") or {}, environ=env)
            ports = replica_ports(cfg, "prefill", 0, "10.0.0.1", iter(range(40000, 40100)).__next__)
            kv = engine_launch(cfg, "prefill", ports).kv_events
            if kv is not None:
                assert kv.ipc_dir is not None, path
                assert "*" not in json.dumps(kv.vllm_config()), path


@pytest.mark.slow
def test_checkov_finds_nothing_but_the_reasoned_skips(tmp_path: Path) -> None:
    """checkov over every overlay as rendered (the RayService's pod templates written out as
    the Pods KubeRay makes of them: checkov does not know the RayService kind) and over both
    Dockerfiles; every check passes but those in k8s/checkov-skips.yaml, each with its
    reason."""
    assert CHECKOV.exists(), "checkov is not installed (scripts/setup.sh puts it in .venv-checkov)"
    skips: dict[str, str] = yaml.safe_load((K8S / "checkov-skips.yaml").read_text())
    assert skips and all(len(why.split()) >= 8 for why in skips.values())
    for overlay in OVERLAYS:
        docs: list[dict[str, Any]] = []
        for d in rendered(overlay):
            if d["kind"] != "RayService":
                docs.append(d)
                continue
            for name, t in pods(overlay).items():
                if name.startswith("pdserve-redis"):
                    continue
                t = copy.deepcopy(t)
                meta = {**t.get("metadata", {}), "name": f"pdserve-{name}", "namespace": "pdserve"}
                docs.append(
                    {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": t["spec"]}
                )
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(docs))
    for f in ("Dockerfile", "Dockerfile.gpu"):
        (tmp_path / f).write_text((K8S / f).read_text())
    out = subprocess.run(
        [str(CHECKOV), "-d", str(tmp_path), "--framework", "kubernetes", "dockerfile",
         "--skip-check", ",".join(skips), "-o", "json", "--quiet", "--compact"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        (r["check_type"], c["check_id"], c["resource"])
        for r in reports
        for c in r.get("results", {}).get("failed_checks", [])
    ]
    passed = sum(r.get("summary", {}).get("passed", 0) for r in reports)
    assert failed == [], failed
    assert passed > 500  # it did scan: the pods, the policies, both images
