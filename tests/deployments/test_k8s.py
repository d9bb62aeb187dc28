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


def tls_config(**tls: Any) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {"kubernetes": {"namespace": "llm", "tls": tls}}
    )


def test_ray_tls_from_a_ca_secret_reaches_every_ray_process(
    rayservice_schema: Any,
) -> None:
    config = tls_config(issuer="ca_secret", ca_secret="ray-ca", days=90)
    text = k8s.render(config)
    assert "kubectl create secret generic ray-ca --from-file=ca.crt" in text
    doc = yaml.safe_load(text)
    jsonschema.validate(doc, rayservice_schema)
    rc = doc["spec"]["rayClusterConfig"]
    assert "tlsOptions" not in rc
    ray_tls = {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": "/etc/ray/tls/tls.crt",
        "RAY_TLS_SERVER_KEY": "/etc/ray/tls/tls.key",
        "RAY_TLS_CA_CERT": "/etc/ray/tls/ca.crt",
    }
    tls_mount = {"name": "ray-tls", "mountPath": "/etc/ray/tls", "readOnly": True}
    for group in pods(doc):
        spec = group["template"]["spec"]
        [init] = spec["initContainers"]
        assert init["command"] == ["moe-cluster"] and init["args"][0] == "node-cert"
        assert init["env"] == [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        ]
        args = init["args"]
        sans = [args[i + 1] for i, a in enumerate(args) if a in ("--ip", "--dns")]
        assert sans == [
            "$(POD_IP)",
            "127.0.0.1",
            "localhost",
            "*.llm.svc",
            "*.llm.svc.cluster.local",
        ]
        assert args[args.index("--days") + 1] == "90"
        [c] = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {k: env[k] for k in ray_tls} == ray_tls
        assert tls_mount in c["volumeMounts"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["ray-tls"]["emptyDir"] == {"medium": "Memory"}
        assert volumes["ray-ca-signing"]["secret"] == {"secretName": "ray-ca"}
        # Only the init container sees the CA's key.
        assert {m["name"] for m in init["volumeMounts"]} == {
            "ray-ca-signing",
            "ray-tls",
        }
        assert all(m["name"] != "ray-ca-signing" for m in c["volumeMounts"])
    autoscaler = rc["autoscalerOptions"]
    assert {e["name"]: e["value"] for e in autoscaler["env"]} == ray_tls
    assert autoscaler["volumeMounts"] == [tls_mount]


def test_the_init_containers_command_issues_what_ray_reads(tmp_path: Path) -> None:
    """The rendered init container's arguments, run here with the pod's folders
    moved under tmp_path: the files Ray's variables name come out."""
    from tests.tls_certs import write_ca

    config = tls_config(issuer="ca_secret", ca_secret="ray-ca")
    doc = yaml.safe_load(k8s.render(config))
    spec = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    [init], [c] = spec["initContainers"], spec["containers"]
    ca_dir = write_ca(tmp_path / "secret")
    moved = {k8s.CA_SIGNING_DIR: str(ca_dir), k8s.TLS_DIR: str(tmp_path / "tls")}
    args = [moved.get(a, a).replace("$(POD_IP)", "10.1.2.3") for a in init["args"]]
    assert main(args) == 0
    for e in c["env"]:
        if e["name"].startswith("RAY_TLS_"):
            path = e["value"].replace(k8s.TLS_DIR, str(tmp_path / "tls"))
            assert Path(path).read_bytes().startswith(b"-----BEGIN ")


def test_ray_tls_issued_by_kuberay(rayservice_schema: Any) -> None:
    doc = yaml.safe_load(k8s.render(tls_config(issuer="kuberay")))
    jsonschema.validate(doc, rayservice_schema)
    rc = doc["spec"]["rayClusterConfig"]
    assert rc["tlsOptions"] == {"enabled": True}
    # The operator mounts the certificates and sets Ray's variables itself.
    assert "env" not in rc["autoscalerOptions"]
    for group in pods(doc):
        spec = group["template"]["spec"]
        assert "initContainers" not in spec
        [c] = spec["containers"]
        assert not any(e["name"].startswith("RAY_TLS") for e in c.get("env", []))
    plain = yaml.safe_load(k8s.render(ClusterConfig()))
    assert "tlsOptions" not in plain["spec"]["rayClusterConfig"]
    assert all("initContainers" not in g["template"]["spec"] for g in pods(plain))


@pytest.mark.parametrize(
    "tls",
    [{"issuer": "ca_secret"}, {"issuer": "kuberay", "ca_secret": "ray-ca"}],
)
def test_a_ca_secret_goes_with_its_issuer_only(tls: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="ca_secret"):
        tls_config(**tls)
