"""The KubeRay manifests in k8s/: what `moe-cluster k8s` renders from the configs,
valid against KubeRay's RayService CRD (unknown fields are errors) and, inside,
Ray Serve's ServeDeploySchema and this project's ClusterConfig."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.config import ClusterConfig, load_config
from deployments import k8s
from deployments.cli import main

ROOT = Path(__file__).resolve().parents[2]
# KubeRay v1.7's RayService CRD, as the operator installs it.
CRDS = ROOT / "k8s" / "crds"
MANIFESTS = {
    "cluster/configs/tiny-cpu.yaml": "k8s/tiny-cpu.yaml",
    "cluster/configs/deepseek-v2-lite-gpu.yaml": "k8s/deepseek-v2-lite-gpu.yaml",
    "cluster/configs/deepseek-v3-wide-ep.yaml": "k8s/deepseek-v3-wide-ep.yaml",
}


def strict(schema: Any) -> Any:
    """The CRD's OpenAPI schema as JSON Schema, with unknown fields as errors
    (the API server would prune them silently) and int-or-string understood."""
    node = copy.deepcopy(schema)
    stack = [node]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack.extend(s)
            continue
        if not isinstance(s, dict):
            continue
        if s.pop("x-kubernetes-int-or-string", False):
            s.pop("type", None)
            s["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        preserve = s.pop("x-kubernetes-preserve-unknown-fields", False)
        if s.get("type") == "object" and "properties" in s and not preserve:
            s.setdefault("additionalProperties", False)
        stack.extend(v for k, v in s.items() if not k.startswith("x-kubernetes"))
    return node


@pytest.fixture(scope="module")
def rayservice_schema() -> Any:
    crd = yaml.safe_load((CRDS / "ray.io_rayservices.yaml").read_text())
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(v1["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize(("config", "manifest"), MANIFESTS.items())
def test_committed_manifests_are_what_the_command_renders(
    config: str, manifest: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out.yaml"
    assert main(["k8s", "--config", config, "--out", str(out)]) == 0
    assert out.read_text() == (ROOT / manifest).read_text(), (
        f"{manifest} is stale: run `make k8s`"
    )


@pytest.mark.parametrize(("config", "manifest"), MANIFESTS.items())
def test_manifests_validate_against_the_crd_and_serves_schema(
    config: str, manifest: str, rayservice_schema: Any
) -> None:
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load((ROOT / manifest).read_text())
    jsonschema.validate(doc, rayservice_schema)
    serve = ServeDeploySchema.model_validate(
        yaml.safe_load(doc["spec"]["serveConfigV2"])
    )
    [app] = serve.applications
    assert app.import_path == k8s.APP_IMPORT_PATH
    # The app's args are the config the pods serve (the manifest-only parts aside).
    source = load_config(ROOT / config)
    served = ClusterConfig.model_validate(app.args)
    assert served.server.host == "0.0.0.0" and served.server.api_keys == []
    expected = source.model_copy(
        update={
            "server": source.server.model_copy(update={"host": "0.0.0.0"}),
            "model": source.model.model_copy(
                update={"path": source.kubernetes.model_path or source.model.path}
            ),
            "kubernetes": served.kubernetes,
        }
    )
    assert served == expected


def test_an_unknown_field_fails_the_crd(rayservice_schema: Any) -> None:
    doc = yaml.safe_load((ROOT / "k8s/tiny-cpu.yaml").read_text())
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["replicas"] = 1
    with pytest.raises(jsonschema.ValidationError, match="replicas"):
        jsonschema.validate(doc, rayservice_schema)


def pods(doc: Any) -> list[Any]:
    rc = doc["spec"]["rayClusterConfig"]
    return [rc["headGroupSpec"]] + rc["workerGroupSpecs"]


def test_what_every_pod_gets() -> None:
    config = load_config(ROOT / "cluster/configs/deepseek-v3-wide-ep.yaml")
    doc = yaml.safe_load(k8s.render(config))
    rc = doc["spec"]["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True
    assert rc["autoscalerOptions"]["version"] == "v2"
    assert doc["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    shm_needed = (
        config.kvstore.capacity_bytes + config.kubernetes.object_store_memory_bytes
    )
    for group in pods(doc):
        spec = group["template"]["spec"]
        [c] = spec["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["serve-grpc"] == 9000 and ports["serve"] == 8000
        assert c["readinessProbe"]["grpc"] == {"port": 9000}
        env = {e["name"]: e for e in c["env"]}
        assert env["MOE_CLUSTER_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
            "name": "moe-cluster-api-keys",
            "key": "api-keys",
        }
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"].startswith("http://")
        [shm] = [v for v in spec["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert int(shm["emptyDir"]["sizeLimit"].removesuffix("Mi")) << 20 >= shm_needed
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    [workers] = rc["workerGroupSpecs"]
    assert (workers["numOfHosts"], workers["minReplicas"], workers["maxReplicas"]) == (
        2,
        1,
        2,
    )
    assert workers["rayStartParams"]["num-gpus"] == "8"
    [c] = workers["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert rc["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_keys_never_land_in_a_manifest() -> None:
    config = ClusterConfig.model_validate(
        {
            "server": {"api_keys": ["secret-key"]},
            "kubernetes": {"api_keys_secret": None},
        }
    )
    with pytest.raises(ValueError, match="api_keys_secret"):
        k8s.render(config)
    with_secret = ClusterConfig.model_validate({"server": {"api_keys": ["secret-key"]}})
    assert "secret-key" not in k8s.render(with_secret)


def test_the_app_builder_takes_the_keys_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Path
) -> None:
    from deployments import app

    built: list[ClusterConfig] = []
    monkeypatch.setattr(app, "build_app", built.append)
    monkeypatch.setenv("MOE_CLUSTER_API_KEYS", '[{"key": "k1", "tenants": ["acme"]}]')
    app.app_builder({"model": {"path": str(tiny_model)}})
    [key] = built[0].server.credentials()
    assert key.key.get_secret_value() == "k1" and key.tenants == ["acme"]


def test_haproxy_reaches_every_pods_environment() -> None:
    on = ClusterConfig.model_validate({"server": {"haproxy": True}})
    for haproxy, config in ((True, on), (False, ClusterConfig())):
        doc = yaml.safe_load(k8s.render(config))
        for group in pods(doc):
            [c] = group["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert (env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1") is haproxy
            # Serve's controller pace and metrics export, with or without it.
            assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
            assert env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "1000"
