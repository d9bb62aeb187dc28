"""Builds the Serve application and the proxy options from one ClusterConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig, gRPCOptions
from ray.serve.deployment import Application

from cluster.config import INGRESS_MAX_ONGOING_REQUESTS, ClusterConfig
from cluster.env import read_env
from cluster.tiny_model import write_tiny_model
from deployments.engine.args import engine_env
from deployments.engine.deployment import EngineDeployment
from deployments.engine.pinned_router import PinnedRequestRouter
from deployments.ep.group import DRAIN_CHECK_S, engine_options, shutdown_timeout_s
from deployments.ingress.deployment import Ingress

GRPC_SERVICERS = [
    "deployments.ingress.grpc_api.add_inference_servicer",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def prepare_model(config: ClusterConfig) -> ClusterConfig:
    """Resolves the model path, writing the built-in tiny model there if asked."""
    config = config.resolved()
    path = Path(config.model.path)
    if not (path / "config.json").exists():
        if not config.model.build_tiny_if_missing:
            raise FileNotFoundError(f"model.path {path} holds no config.json")
        write_tiny_model(path)
    if config.engine.quantization == "fp8":
        from cluster import platform
        from cluster.checkpoint import Checkpoint

        platform.check_fp8_checkpoint(
            config.engine_platform().backend, Checkpoint.read(path).weight_block_size
        )
    return config


def build_app(config: ClusterConfig) -> Application:
    routing: dict[str, Any] = {}
    if config.router.enabled:
        # The DeepSeekRouter orders and places; Serve only delivers.
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=PinnedRequestRouter
        )
    engine = EngineDeployment.options(
        **routing, **engine_options(config, engine_env(config.engine))
    ).bind(config)
    return Ingress.options(**ingress_options(config)).bind(config, engine)


# Ray Serve runs a replica's handlers on a second thread unless this is "0".
USER_CODE_THREAD = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
# Serve replaces a dead replica when a health check fails: an ingress replica
# holds client connections, so it is checked more often than Serve's 10 s (each
# check is one empty call).
INGRESS_HEALTH_CHECK_S = 2.0


def ingress_options(config: ClusterConfig) -> dict[str, Any]:
    """Serve options of the ingress deployment."""
    # The ingress only parses and relays: it takes no CPU from the engines.
    actor: dict[str, Any] = {"num_cpus": 0}
    if config.server.ingress_on_main_loop:
        actor["runtime_env"] = {"env_vars": {USER_CODE_THREAD: "0"}}
    return {
        "max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
        "health_check_period_s": INGRESS_HEALTH_CHECK_S,
        "ray_actor_options": actor,
        # Its access lines go to Serve's log file (``telemetry``): in the
        # encoding the cluster logs in.
        "logging_config": {"encoding": config.tracing.log_encoding},
        # The ingress holds the client streams: stopped, it waits for them as
        # long as the engines' drain and the resumptions after it may take.
        "graceful_shutdown_timeout_s": shutdown_timeout_s(config),
        "graceful_shutdown_wait_loop_s": DRAIN_CHECK_S,
    }


def app_builder(args: dict[str, Any]) -> Application:
    """Entry for `serve run` / RayService `import_path: deployments.app:app_builder`;
    ``args`` is the ClusterConfig mapping."""
    config = ClusterConfig.model_validate(args)
    if keys := read_env().api_keys_json:
        # From a Secret (the RayService's pods): never in the manifest itself.
        server = config.server.model_validate(
            config.server.model_dump() | {"api_keys": json.loads(keys)}
        )
        config = config.model_copy(update={"server": server})
    return build_app(prepare_model(config))


def deploy(config: ClusterConfig, *, external_scaler: bool = False) -> None:
    """Starts Serve's proxies and runs the app on the connected Ray cluster;
    returns once every replica is ready. ``external_scaler``: the engines' replica
    count is set from outside (Serve's ``update_deployment_replicas``), which
    scales without redeploying; Serve's own autoscaling is then off for the app."""
    http, grpc_options = proxy_options(config)
    serve.start(http_options=http, grpc_options=grpc_options)
    serve.run(
        build_app(config),
        name=config.server.app_name,
        route_prefix="/",
        external_scaler_enabled=external_scaler,
    )


def scale_engines(app_name: str, replicas: int) -> None:
    """Sets the engines' replica count of an app deployed with ``external_scaler``
    (what an external autoscaler does): Serve starts or stops replicas without
    touching the others; a stopped one drains (see ``EngineServer``). The count is
    in replicas: with EP groups, ``ranks`` per group."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    engines = DeploymentID(name="Engine", app_name=app_name)
    controller = _get_global_client()._controller
    ray.get(controller.update_deployment_replicas.remote(engines, replicas))


def proxy_options(config: ClusterConfig) -> tuple[HTTPOptions, gRPCOptions]:
    s = config.server
    tls: dict[str, Any] = {}
    if s.tls is not None:
        tls = {"ssl_certfile": s.tls.certfile, "ssl_keyfile": s.tls.keyfile}
        if s.tls.keyfile_password is not None:
            tls["ssl_keyfile_password"] = s.tls.keyfile_password.get_secret_value()
    return (
        HTTPOptions(host=s.host, port=s.http_port, **tls),
        gRPCOptions(port=s.grpc_port, grpc_servicer_functions=GRPC_SERVICERS),
    )
