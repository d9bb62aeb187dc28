"""The app's deployment options that do not need a running cluster."""

from __future__ import annotations

from cluster.config import ClusterConfig, load_config
from deployments.app import INGRESS_HEALTH_CHECK_S, USER_CODE_THREAD, ingress_options
from deployments.cli import DEFAULT_CONFIG


def config(**server: object) -> ClusterConfig:
    data = load_config(DEFAULT_CONFIG).model_dump(mode="json")
    data["server"] |= server
    return ClusterConfig.model_validate(data)


def test_the_ingress_handles_requests_on_its_replicas_main_loop() -> None:
    actor = ingress_options(config())["ray_actor_options"]
    assert actor["runtime_env"]["env_vars"] == {USER_CODE_THREAD: "0"}
    assert actor["num_cpus"] == 0


def test_the_ingress_can_keep_serves_second_thread() -> None:
    actor = ingress_options(config(ingress_on_main_loop=False))["ray_actor_options"]
    assert "runtime_env" not in actor


def test_a_dead_ingress_replica_is_noticed_within_seconds() -> None:
    assert ingress_options(config())["health_check_period_s"] == INGRESS_HEALTH_CHECK_S


def test_the_ingress_logs_to_serves_file_in_the_clusters_encoding() -> None:
    # Its access lines go to Serve's log file (deployments.ingress.telemetry).
    for encoding in ("TEXT", "JSON"):
        data = load_config(DEFAULT_CONFIG).model_dump(mode="json")
        data["tracing"] = (data.get("tracing") or {}) | {"log_encoding": encoding}
        options = ingress_options(ClusterConfig.model_validate(data))
        assert options["logging_config"] == {"encoding": encoding}
