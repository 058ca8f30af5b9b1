"""KubeRay manifests: valid against the RayService CRD, their serveConfigV2 against Ray
Serve's deploy schema, and the app's args against the project's config tree."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"


def _schema() -> dict[str, Any]:
    crd = yaml.safe_load((K8S / "crds" / "ray.io_rayservices.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def _base() -> dict[str, Any]:
    return yaml.safe_load((K8S / "base" / "rayservice.yaml").read_text())


def _render(overlay: str) -> dict[str, Any]:
    """Apply an overlay's JSON 6902 patches to the base (what `kustomize build` does here)."""
    kust = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../../base"]
    doc = _base()
    for p in kust.get("patches", []):
        assert p["target"] == {"kind": "RayService", "name": "pdserve"}
        doc = jsonpatch.apply_patch(doc, yaml.safe_load(p["patch"]))
    if "namePrefix" in kust:
        doc["metadata"]["name"] = kust["namePrefix"] + doc["metadata"]["name"]
    return doc


MANIFESTS = {"base": _base, "dev": lambda: _render("dev"), "tenants": lambda: _render("tenants")}


@pytest.mark.parametrize("name", list(MANIFESTS))
def test_manifest_is_a_valid_rayservice(name: str) -> None:
    doc = MANIFESTS[name]()
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    jsonschema.validate(doc, _schema())


@pytest.mark.parametrize("name", list(MANIFESTS))
def test_serve_config_and_app_args_validate(name: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import load_app_config

    serve_cfg = yaml.safe_load(MANIFESTS[name]()["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_cfg)
    (app,) = serve_cfg["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    cfg = load_app_config(app["args"], environ={})
    assert cfg.model.path.startswith("/models/")


def test_tenants_overlay_feeds_api_keys_from_a_secret() -> None:
    doc = _render("tenants")
    cluster = doc["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for group in pods:
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["PDSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "pdserve-api-keys"


def test_the_schema_check_catches_a_broken_manifest() -> None:
    doc = copy.deepcopy(_base())
    del doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError, match="groupName"):
        jsonschema.validate(doc, _schema())


def test_bad_app_args_fail_naming_the_field() -> None:
    from pydantic import ValidationError

    from deployments.config import load_app_config

    args = yaml.safe_load(_base()["spec"]["serveConfigV2"])["applications"][0]["args"]
    args["prefill"]["num_replicas"] = 20  # 5600-5619 would overlap decode's 5610
    with pytest.raises(ValidationError, match="nixl_side_channel_port"):
        load_app_config(args, environ={})
