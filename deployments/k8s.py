"""A KubeRay ``RayService`` rendered from one ClusterConfig (``moe-cluster k8s``).

The config's serving sections become the app's args in ``serveConfigV2``
(``deployments.app:app_builder`` builds the same app ``moe-cluster serve`` runs);
its ``kubernetes`` section shapes the Ray cluster: a head that runs no engine,
worker groups the in-tree autoscaler (v2) adds and removes as Serve's replicas
(QoS-aware, ``deployment.autoscaling``) need them, ``/dev/shm`` in memory for
the object store and the page store's arena, the gRPC port named ``serve-grpc``
(KubeRay >= 1.6 puts it on the Serve service), readiness from
``grpc.health.v1``, the API keys from a Secret and the ``OTEL_*`` environment;
with ``kubernetes.tls``, Ray's mutual TLS in every pod (each pod's certificate
issued by its init container from a CA Secret, or by KubeRay itself).
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from cluster.config import ClusterConfig, WorkerGroup
from deployments.app import GRPC_SERVICERS

RAY_VERSION = "2.60.0"
APP_IMPORT_PATH = "deployments.app:app_builder"
API_KEYS_ENV = "MOE_CLUSTER_API_KEYS"
API_KEYS_SECRET_KEY = "api-keys"
SHM_HEADROOM_BYTES = 256 << 20  # Ray's own shared memory beyond the two
PORTS = {  # name -> container port (serve and serve-grpc: from the config)
    "gcs-server": 6379,
    "dashboard": 8265,
    "client": 10001,
    "metrics": 8080,
}


# Ray's TLS under kubernetes.tls.issuer ca_secret: each pod's init container
# issues its certificate into a memory-backed folder every container mounts;
# only the init container mounts the CA's key.
TLS_DIR = "/etc/ray/tls"
TLS_VOLUME = "ray-tls"
CA_SIGNING_DIR = "/etc/ray/ca-signing"
CA_SIGNING_VOLUME = "ray-ca-signing"


def _quantity(nbytes: int) -> str:
    return f"{math.ceil(nbytes / (1 << 20))}Mi"


def app_args(config: ClusterConfig) -> dict[str, Any]:
    """The app's config as serveConfigV2 carries it: every section but
    ``kubernetes``, listening on every interface, the model where the pods have
    it, and no API key (they come from the Secret)."""
    k = config.kubernetes
    if k.api_keys_secret is None and config.server.api_keys:
        raise ValueError(
            "server.api_keys would be written into the manifest: set "
            "kubernetes.api_keys_secret and keep the keys in that Secret"
        )
    tls = config.server.tls
    if tls is not None and tls.keyfile_password is not None:
        raise ValueError(
            "server.tls.keyfile_password would be written into the manifest: use "
            "an unencrypted key from a Secret volume, or terminate TLS in front"
        )
    # What differs from the defaults: the app validates the rest back to them.
    args = config.model_dump(mode="json", exclude={"kubernetes"}, exclude_defaults=True)
    server = args.setdefault("server", {})
    server["host"] = "0.0.0.0"
    server.pop("api_keys", None)
    if k.model_path is not None:
        args.setdefault("model", {})["path"] = k.model_path
    return args


def serve_config(config: ClusterConfig) -> dict[str, Any]:
    """serveConfigV2 (Ray Serve's ``ServeDeploySchema``)."""
    s = config.server
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": s.http_port},
        "grpc_options": {
            "port": s.grpc_port,
            "grpc_servicer_functions": list(GRPC_SERVICERS),
        },
        "applications": [
            {
                "name": s.app_name,
                "import_path": APP_IMPORT_PATH,
                "route_prefix": "/",
                "args": app_args(config),
            }
        ],
    }


def _env(config: ClusterConfig) -> list[dict[str, Any]]:
    k = config.kubernetes
    env: list[dict[str, Any]] = []
    if k.api_keys_secret is not None:
        env.append(
            {
                "name": API_KEYS_ENV,
                "valueFrom": {
                    "secretKeyRef": {
                        "name": k.api_keys_secret,
                        "key": API_KEYS_SECRET_KEY,
                    }
                },
            }
        )
    if k.otel_exporter_otlp_endpoint is not None:
        env += [
            {
                "name": "OTEL_EXPORTER_OTLP_ENDPOINT",
                "value": k.otel_exporter_otlp_endpoint,
            },
            {"name": "OTEL_SERVICE_NAME", "value": k.name},
        ]
    env += [{"name": k, "value": v} for k, v in config.server.serve_env().items()]
    return env + _tls_env(config)


def _issues_certs(config: ClusterConfig) -> bool:
    """Whether each pod issues its own certificate (issuer ca_secret)."""
    tls = config.kubernetes.tls
    return tls is not None and tls.issuer == "ca_secret"


def _tls_env(config: ClusterConfig) -> list[dict[str, Any]]:
    """Ray's TLS variables where this manifest issues the certificates (under
    the kuberay issuer the operator injects its own)."""
    if not _issues_certs(config):
        return []
    return [
        {"name": "RAY_USE_TLS", "value": "1"},
        {"name": "RAY_TLS_SERVER_CERT", "value": f"{TLS_DIR}/tls.crt"},
        {"name": "RAY_TLS_SERVER_KEY", "value": f"{TLS_DIR}/tls.key"},
        {"name": "RAY_TLS_CA_CERT", "value": f"{TLS_DIR}/ca.crt"},
    ]


def _cert_init_container(config: ClusterConfig) -> dict[str, Any]:
    """Issues the pod's certificate for its IP, loopback and the namespace's
    services (a worker reaches the head by its service's name) before Ray starts."""
    k = config.kubernetes
    tls = k.tls
    assert tls is not None
    services = f"*.{k.namespace}.svc"
    args = ["node-cert", "--ca-dir", CA_SIGNING_DIR, "--out-dir", TLS_DIR]
    args += ["--ip", "$(POD_IP)", "--ip", "127.0.0.1", "--dns", "localhost"]
    args += ["--dns", services, "--dns", f"{services}.{tls.cluster_domain}"]
    args += ["--days", str(tls.days)]
    resources = {"cpu": "200m", "memory": "256Mi"}
    return {
        "name": "ray-tls-cert",
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": ["moe-cluster"],
        "args": args,
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        ],
        "resources": {"requests": dict(resources), "limits": resources},
        "volumeMounts": [
            {"name": CA_SIGNING_VOLUME, "mountPath": CA_SIGNING_DIR, "readOnly": True},
            {"name": TLS_VOLUME, "mountPath": TLS_DIR},
        ],
    }


def _container(
    config: ClusterConfig, name: str, cpu: str, memory: str, gpus: int
) -> dict[str, Any]:
    k, s = config.kubernetes, config.server
    ports = [{"name": n, "containerPort": p} for n, p in PORTS.items()]
    ports += [
        {"name": "serve", "containerPort": s.http_port},
        {"name": "serve-grpc", "containerPort": s.grpc_port},
    ]
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    container: dict[str, Any] = {
        "name": name,
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "ports": ports,
        "resources": {"requests": dict(limits), "limits": limits},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
        # SERVING once the proxy on this pod reaches live engine replicas.
        "readinessProbe": {
            "grpc": {"port": s.grpc_port},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
    }
    if env := _env(config):
        container["env"] = env
    if k.model_volume_claim is not None:
        container["volumeMounts"].append(
            {"name": "model", "mountPath": _model_dir(config), "readOnly": True}
        )
    if _issues_certs(config):
        container["volumeMounts"].append(
            {"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}
        )
    return container


def _model_dir(config: ClusterConfig) -> str:
    path = config.kubernetes.model_path or config.model.path
    return path.rsplit("/", 1)[0] or "/"


def _pod(
    config: ClusterConfig, container: dict[str, Any], selector: dict[str, str]
) -> Any:
    k = config.kubernetes
    shm = config.kvstore.capacity_bytes + k.object_store_memory_bytes
    volumes: list[dict[str, Any]] = [
        {
            "name": "shm",
            "emptyDir": {
                "medium": "Memory",
                "sizeLimit": _quantity(shm + SHM_HEADROOM_BYTES),
            },
        }
    ]
    if k.model_volume_claim is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {
                    "claimName": k.model_volume_claim,
                    "readOnly": True,
                },
            }
        )
    spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if _issues_certs(config):
        assert k.tls is not None and k.tls.ca_secret is not None
        spec["initContainers"] = [_cert_init_container(config)]
        volumes += [
            {"name": TLS_VOLUME, "emptyDir": {"medium": "Memory"}},
            {"name": CA_SIGNING_VOLUME, "secret": {"secretName": k.tls.ca_secret}},
        ]
    if selector:
        spec["nodeSelector"] = dict(selector)
    return {"spec": spec}


def _start_params(config: ClusterConfig, **extra: str) -> dict[str, str]:
    k = config.kubernetes
    return {"object-store-memory": str(k.object_store_memory_bytes), **extra}


def _worker_group(config: ClusterConfig, g: WorkerGroup) -> dict[str, Any]:
    params = _start_params(config)
    if g.gpus:
        params["num-gpus"] = str(g.gpus)
    return {
        "groupName": g.name,
        "replicas": g.replicas,
        "minReplicas": g.min_replicas,
        "maxReplicas": g.max_replicas,
        "numOfHosts": g.num_of_hosts,
        "rayStartParams": params,
        "template": _pod(
            config,
            _container(config, "ray-worker", g.cpu, g.memory, g.gpus),
            g.node_selector,
        ),
    }


def _autoscaler(config: ClusterConfig) -> dict[str, Any]:
    """The in-tree autoscaler, a container of the head pod: it talks to the GCS,
    so it takes the head's certificate where this manifest issues them."""
    k = config.kubernetes
    options: dict[str, Any] = {
        "version": "v2",
        "upscalingMode": k.autoscaler_upscaling_mode,
        "idleTimeoutSeconds": k.autoscaler_idle_timeout_s,
        "resources": {
            "requests": {"cpu": "500m", "memory": "512Mi"},
            "limits": {"cpu": "500m", "memory": "512Mi"},
        },
    }
    if _issues_certs(config):
        options["env"] = _tls_env(config)
        options["volumeMounts"] = [
            {"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}
        ]
    return options


def ray_service(config: ClusterConfig) -> dict[str, Any]:
    k = config.kubernetes
    head_params = _start_params(
        config, **{"num-cpus": "0", "dashboard-host": "0.0.0.0"}
    )
    cluster: dict[str, Any] = {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": _autoscaler(config),
        "headGroupSpec": {
            "rayStartParams": head_params,
            "template": _pod(
                config,
                _container(config, "ray-head", k.head_cpu, k.head_memory, 0),
                {},
            ),
        },
        "workerGroupSpecs": [_worker_group(config, g) for g in k.worker_groups],
    }
    if k.tls is not None and k.tls.issuer == "kuberay":
        cluster["tlsOptions"] = {"enabled": True}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {
            "name": k.name,
            "namespace": k.namespace,
            "labels": {"app.kubernetes.io/name": "moe-cluster"},
        },
        "spec": {
            "upgradeStrategy": {"type": k.upgrade_strategy},
            "serveConfigV2": yaml.safe_dump(serve_config(config), sort_keys=False),
            "rayClusterConfig": cluster,
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as literal blocks, readable in review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(config: ClusterConfig, source: str = "") -> str:
    """The RayService as YAML; ``source`` names the config in its header."""
    header = (
        "# Generated by `moe-cluster k8s"
        + (f" --config {source}" if source else "")
        + "`.\n# Do not edit: change the config and render it again.\n"
    )
    if config.kubernetes.api_keys_secret is not None:
        header += (
            f"# API keys: kubectl create secret generic "
            f"{config.kubernetes.api_keys_secret} "
            f"--from-literal={API_KEYS_SECRET_KEY}='[\"KEY\"]'\n"
        )
    tls = config.kubernetes.tls
    if tls is not None and tls.ca_secret is not None:
        header += (
            f"# Ray's TLS: kubectl create secret generic {tls.ca_secret} "
            "--from-file=ca.crt --from-file=ca.key\n"
        )
    elif tls is not None:
        header += (
            "# Ray's TLS: KubeRay >= 1.7 with the RayClusterMTLS feature gate, "
            "and cert-manager\n"
        )
    body = yaml.dump(ray_service(config), Dumper=_Dumper, sort_keys=False, width=88)
    return header + body
