from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.config import INGRESS_MAX_ONGOING_REQUESTS, ClusterConfig, load_config
from cluster.tiny_model import write_tiny_model
from deployments.app import ingress_options
from deployments.cli import DEFAULT_CONFIG


def test_example_config_is_what_serve_runs() -> None:
    config = load_config(DEFAULT_CONFIG)
    assert config.deployment.num_replicas == 2
    assert config.deployment.num_cpus == 1
    assert config.engine.omp_num_threads == 1
    assert config.model.build_tiny_if_missing


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"modle": {}}, "modle"),
        ({"engine": {"max_model_len": 512, "max_modle_len": 1}}, "max_modle_len"),
        ({"server": {"grpc_prot": 1}}, "grpc_prot"),
    ],
)
def test_unknown_keys_are_errors(data: dict[str, object], where: str) -> None:
    with pytest.raises(ValidationError, match=where):
        ClusterConfig.model_validate(data)


@pytest.mark.parametrize(
    "data",
    [
        {"engine": {"max_model_len": 0}},
        {"engine": {"gpu_memory_utilization": 1.5}},
        {"deployment": {"num_replicas": 0}},
        {"server": {"http_port": 9000, "grpc_port": 9000}},
        {"server": {"grpc_port": 70000}},
    ],
)
def test_bad_values_are_errors(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate(data)


def test_api_keys_are_secret(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("server:\n  api_keys: [s3cret]\n")
    config = load_config(f)
    assert config.server.api_keys[0].get_secret_value() == "s3cret"
    assert "s3cret" not in repr(config)


def test_api_keys_bind_tenants(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "server:\n  api_keys:\n    - bare-key\n"
        "    - {key: acme-key, tenants: [acme, acme-eu]}\n"
        "    - {key: gateway-key, tenants: ['*']}\n"
    )
    keys = load_config(f).server.credentials()
    assert [(k.key.get_secret_value(), k.tenants) for k in keys] == [
        ("bare-key", [""]),  # a bare key: the default tenant only
        ("acme-key", ["acme", "acme-eu"]),
        ("gateway-key", ["*"]),
    ]
    assert "acme-key" not in repr(load_config(f))
    for bad in ("[]", "[a/b]", "['" + "x" * 129 + "']"):
        f.write_text(f"server:\n  api_keys:\n    - {{key: k, tenants: {bad}}}\n")
        with pytest.raises(ValidationError):
            load_config(f)


def test_resolved_makes_the_model_path_absolute() -> None:
    config = ClusterConfig.model_validate({"model": {"path": "rel/model"}}).resolved()
    assert Path(config.model.path).is_absolute()
    assert config.model.path.endswith("rel/model")


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(f)


def test_router_needs_serve_room_for_its_slots() -> None:
    with pytest.raises(ValueError, match=r"max_ongoing_requests must be >= 20"):
        ClusterConfig.model_validate(
            {
                "deployment": {"max_ongoing_requests": 19},
                "router": {"max_running_per_replica": 16, "realtime_reserved_slots": 4},
            }
        )
    ClusterConfig.model_validate(
        {"deployment": {"max_ongoing_requests": 8}, "router": {"enabled": False}}
    )
    with pytest.raises(ValueError, match="greater than 0"):
        ClusterConfig.model_validate(
            {"router": {"class_weights": {"realtime": 1, "normal": 1, "background": 0}}}
        )


@pytest.mark.parametrize(
    ("engine", "amx", "field"),
    [
        ({"kv_cache_dtype": "fp8_e4m3"}, False, "engine.kv_cache_dtype"),
        ({"kv_cache_dtype": "fp8_e5m2"}, True, "engine.kv_cache_dtype"),
        ({"quantization": "fp8"}, False, "engine.quantization"),
        ({"quantization": "awq"}, True, "engine.quantization"),
        ({"quantization": "fp8", "attention_backend": "CPU_MLA"}, None, "CPU_MLA"),
    ],
)
def test_quantization_the_cpu_backends_refuse_is_named(
    engine: dict[str, object], amx: bool | None, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        # An explicit backend fails at load; auto when it is resolved.
        ClusterConfig.model_validate({"engine": engine}).engine_platform(amx=bool(amx))


def test_fp8_weights_are_accepted_on_amx() -> None:
    config = ClusterConfig.model_validate({"engine": {"quantization": "fp8"}})
    assert config.engine_platform(amx=True).backend.value == "AMX_MLA"
    gpu = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}
    on_gpu = ClusterConfig.model_validate(
        {"engine": gpu, "deployment": {"num_gpus": 1}}
    )
    assert on_gpu.engine_platform().backend.value == "GPU"  # vLLM checks it there


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ((), "per-tensor scales"),
        ((128, 64), r"weight_block_size \[128, 64\]"),
        ((100, 128), r"weight_block_size \[100, 128\]"),
    ],
)
def test_fp8_checkpoints_cpu_engines_cannot_load_are_refused(
    blocks: tuple[int, ...], message: str
) -> None:
    from cluster.platform import Backend, check_fp8_checkpoint

    for backend in (Backend.AMX_MLA, Backend.CPU_MLA):
        with pytest.raises(ValueError, match=f"engine.quantization fp8.*{message}"):
            check_fp8_checkpoint(backend, blocks)
    check_fp8_checkpoint(Backend.GPU, blocks)  # vLLM checks it there
    check_fp8_checkpoint(Backend.AMX_MLA, (128, 128))


def test_a_per_tensor_fp8_checkpoint_is_refused_before_deploying(
    tmp_path: Path,
) -> None:
    from deployments.app import prepare_model

    model = write_tiny_model(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (model / "config.json").write_text(json.dumps(config))
    settings = {"model": {"path": str(model)}, "engine": {"quantization": "fp8"}}
    # Without AMX the backend itself refuses FP8; with it, the checkpoint's form.
    with pytest.raises(ValueError, match=r"engine\.quantization"):
        prepare_model(ClusterConfig.model_validate(settings))


def test_haproxy_is_serves_environment_and_refuses_tls(tmp_path: Path) -> None:
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in ClusterConfig().server.serve_env()
    on = ClusterConfig.model_validate({"server": {"haproxy": True}})
    assert on.server.serve_env()["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    tls = {"certfile": str(cert), "keyfile": str(key)}
    with pytest.raises(ValidationError, match=r"server\.haproxy serves plain HTTP"):
        ClusterConfig.model_validate({"server": {"haproxy": True, "tls": tls}})


def test_haproxy_lets_a_connection_hold_as_many_streams_as_an_ingress_takes() -> None:
    # HAProxy's default (100 HTTP/2 streams per connection) held a client's
    # realtime request behind its own queued background streams, outside the
    # router. Ray Serve must read the limits under the names given.
    config = ClusterConfig.model_validate({"server": {"haproxy": True}})
    env = config.server.serve_env()
    code = (
        "from ray.serve._private import constants as c; "
        "print(c.RAY_SERVE_HAPROXY_H2_FE_MAX_CONCURRENT_STREAMS, "
        "c.RAY_SERVE_HAPROXY_H2_BE_MAX_CONCURRENT_STREAMS)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [str(INGRESS_MAX_ONGOING_REQUESTS)] * 2
    assert ingress_options(config)["max_ongoing_requests"] == int(out[0])


def test_serves_control_loop_and_metrics_export_reach_serve() -> None:
    # Serve's controller reconciles every 0.1 s and its replicas export metrics
    # every 0.1 s by default: CPU an idle node pays. Ray Serve must read the
    # settings under the names given, with or without HAProxy.
    for haproxy in (False, True):
        server = {"serve_control_loop_s": 0.75, "serve_metrics_export_ms": 2500}
        config = ClusterConfig.model_validate({"server": server | {"haproxy": haproxy}})
        code = (
            "from ray.serve._private import constants as c; "
            "print(c.CONTROL_LOOP_INTERVAL_S, c.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **config.server.serve_env()},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.split() == ["0.75", "2500"]
    defaults = ClusterConfig().server.serve_env()
    assert defaults["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    assert defaults["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "1000"
    with pytest.raises(ValidationError, match="serve_control_loop_s"):
        ClusterConfig.model_validate({"server": {"serve_control_loop_s": 0}})
