"""EP group deployment options and settings, built without starting engines (the
GPU ones included), and the engine's rolling expert-load window."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve.config import GangPlacementStrategy, GangRuntimeFailurePolicy

from cluster.config import ClusterConfig
from deployments.engine.args import WORKER_EXTENSION, engine_args
from deployments.engine.expert_load import ExpertLoadWindow
from deployments.ep.group import GroupRank, engine_options, gpu_engine_kwargs


def _config(**ep: Any) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "deployment": {"num_replicas": 3, "num_cpus": 2},
            "engine": {"enforce_eager": True},
            "expert_parallel": ep,
        }
    )


def test_plain_replicas_are_not_gang_scheduled() -> None:
    opts = engine_options(_config(), {"A": "1"})
    assert opts["num_replicas"] == 3
    assert "gang_scheduling_config" not in opts
    assert opts["ray_actor_options"] == {
        "num_cpus": 2,
        "num_gpus": 0.0,
        "runtime_env": {"env_vars": {"A": "1"}},
    }


def test_cpu_group_takes_a_custom_accelerator_resource_per_rank() -> None:
    opts = engine_options(_config(ranks=2, accelerator="accel"), {})
    assert opts["num_replicas"] == 6  # 3 groups of 2 ranks
    gang = opts["gang_scheduling_config"]
    assert gang.gang_size == 2
    assert gang.gang_placement_strategy == GangPlacementStrategy.SPREAD
    assert gang.runtime_failure_policy == GangRuntimeFailurePolicy.RESTART_GANG
    actor = opts["ray_actor_options"]
    assert actor["resources"] == {"accel": 1} and actor["num_gpus"] == 0
    packed = engine_options(_config(ranks=4, placement="pack"), {})
    assert packed["gang_scheduling_config"].gang_placement_strategy == "PACK"
    assert "resources" not in packed["ray_actor_options"]


def test_gpu_group_options_and_vllm_arguments() -> None:
    config = _config(
        ranks=8,
        accelerator="GPU",
        eplb=True,
        eplb_step_interval=500,
        num_redundant_experts=16,
        all2all_backend="deepep_low_latency",
    )
    opts = engine_options(config, {})
    assert opts["ray_actor_options"]["num_gpus"] == 1
    assert "resources" not in opts["ray_actor_options"]
    assert opts["num_replicas"] == 24
    rank = GroupRank("g", 3, 8, "10.0.0.1", 29500)
    kwargs = rank.engine_kwargs() | gpu_engine_kwargs(config)
    # vLLM itself accepts and checks the whole set (no engine is started).
    args = engine_args("/m", "m", config.resolved().engine, parallel=kwargs)
    # GPU ranks: the checkpoint's dtype, vLLM's choice of MLA kernel, and the
    # 64-token blocks every one of them takes (the ingress hashes with it).
    assert (args.dtype, args.attention_backend, args.block_size) == ("auto", None, 64)
    assert (args.data_parallel_size, args.data_parallel_rank) == (8, 3)
    assert args.data_parallel_address == "10.0.0.1"
    assert args.data_parallel_rpc_port == 29500
    assert args.enable_expert_parallel and args.enable_eplb
    eplb = args.eplb_config  # vLLM parsed it into its own EPLBConfig
    assert (eplb.window_size, eplb.step_interval) == (1000, 500)
    assert eplb.num_redundant_experts == 16
    assert args.all2all_backend == "deepep_low_latency"
    assert args.distributed_executor_backend == "uni"
    assert args.worker_extension_cls == WORKER_EXTENSION


@pytest.mark.parametrize(
    ("ep", "engine", "message"),
    [
        ({"ranks": 2, "eplb": True}, {}, "needs GPU ranks"),
        ({"accelerator": "GPU", "eplb": True}, {}, "needs an EP group"),
        ({"ranks": 2, "all2all_backend": "naive"}, {}, "needs GPU ranks"),
        (
            {"ranks": 2, "accelerator": "GPU", "num_redundant_experts": 2},
            {},
            "needs eplb",
        ),
        ({"ranks": 2}, {"tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
        (
            {"ranks": 2, "accelerator": "GPU"},
            {"enforce_eager": False, "measure_expert_load": True},
            "CUDA graphs",
        ),
        ({"ranks": 0}, {}, "greater than or equal to 1"),
        ({"placement": "strict"}, {}, "spread"),
    ],
)
def test_bad_group_settings_are_refused(
    ep: dict[str, Any], engine: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        ClusterConfig.model_validate(
            {"engine": {"enforce_eager": True, **engine}, "expert_parallel": ep}
        )


def test_expert_load_is_measured_by_default_only_in_eager_mode() -> None:
    graphs = ClusterConfig.model_validate(
        {"expert_parallel": {"ranks": 2, "accelerator": "GPU", "eplb": True}}
    )
    assert not graphs.engine.measures_expert_load
    args = engine_args("/m", "m", graphs.resolved().engine)
    assert args.worker_extension_cls == ""
    assert _config().engine.measures_expert_load  # enforce_eager: true


def test_expert_load_window_rolls() -> None:
    w = ExpertLoadWindow((1, 2), 3, window_s=10)
    w.add(100.0, [[0, 0, 0], [0, 0, 0]])
    w.add(101.0, [[4, 0, 2], [1, 1, 1]])
    w.add(105.0, [[4, 0, 0], [0, 3, 0]])
    snap = w.snapshot(105.0)
    assert snap.counts == ((8, 0, 2), (1, 4, 1)) and snap.window_s == 5.0
    later = w.snapshot(111.5)  # the sample at 101 is out of the window
    assert later.counts == ((4, 0, 0), (0, 3, 0)) and later.window_s == 10
    w.add(120.0, [[0, 0, 0], [0, 0, 0]])
    assert w.snapshot(120.0).counts == ((0, 0, 0), (0, 0, 0))
    with pytest.raises(ValueError):
        w.add(121.0, [[1, 1, 1]])


@pytest.mark.parametrize("ranks", [1, 2])
def test_autoscaling_is_serves_config_with_the_qos_policy_in_whole_groups(
    ranks: int,
) -> None:
    import warnings

    from ray import serve
    from ray.serve.config import AutoscalingConfig

    from router.autoscaling import POLICY_FUNCTION, policy_of

    scaling = {"enabled": True, "min_replicas": 1, "max_replicas": 3}
    config = ClusterConfig.model_validate(
        {
            "deployment": {"num_replicas": 2, "autoscaling": scaling},
            "engine": {"enforce_eager": True},
            "expert_parallel": {"ranks": ranks},
        }
    )
    opts = engine_options(config, {})
    assert "num_replicas" not in opts
    with warnings.catch_warnings():  # metrics_interval_s: Serve 2.60's only knob
        warnings.simplefilter("ignore", DeprecationWarning)
        parsed = AutoscalingConfig(**opts["autoscaling_config"])
        # Serve takes the whole option set (gang options included).
        serve.deployment(lambda: None).options(**opts)
    assert (parsed.min_replicas, parsed.max_replicas) == (ranks, 3 * ranks)
    assert parsed.initial_replicas == 2 * ranks
    assert parsed.upscale_delay_s == parsed.downscale_delay_s == 0
    assert parsed.policy.policy_function == POLICY_FUNCTION
    assert callable(parsed.policy.get_policy()(**parsed.policy.policy_kwargs))
    policy = policy_of(parsed.policy.policy_kwargs)
    assert (policy.unit, policy.min_replicas, policy.max_replicas) == (
        ranks,
        ranks,
        3 * ranks,
    )
    assert policy.slo_ttft_s == (0.5, 2.0)


def test_autoscaling_settings_are_checked() -> None:
    from pydantic import ValidationError

    for bad in (
        {"min_replicas": 3, "max_replicas": 2},
        {"target_utilization": 0.5, "downscale_utilization": 0.6},
        {"metrics_interval_s": 5, "look_back_period_s": 3},
    ):
        with pytest.raises(ValidationError, match="autoscaling"):
            ClusterConfig.model_validate({"deployment": {"autoscaling": bad}})
