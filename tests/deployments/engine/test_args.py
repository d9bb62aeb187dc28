"""The engine's own check of the backend its config resolved to, and the
sampling bounds the ingress shares with vLLM."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from cluster.config import EngineConfig
from cluster.platform import Backend
from deployments.engine.args import check_platform, sampling_params
from deployments.ingress import validation
from deployments.protocol import Sampling


def test_an_amx_config_on_a_node_without_amx_fails_naming_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    amx = EngineConfig(attention_backend="AMX_MLA", block_size=128)
    with pytest.raises(RuntimeError, match=r"on this engine's node.*CPU_MLA"):
        check_platform(amx)
    reference = EngineConfig(attention_backend="CPU_MLA", block_size=16)
    assert check_platform(reference) is Backend.CPU_MLA  # runs on every CPU
    assert check_platform(EngineConfig(block_size=64)) is Backend.GPU


# What the ingress lets through, vLLM accepts; what vLLM refuses, the ingress
# refuses first (with the client's field name). Each case: the ingress's
# arguments to validation.sampling, at and just past the bound.
BOUNDS = [
    ({"temperature": validation.MAX_TEMPERATURE}, {"temperature": 2.0001}),
    ({"temperature": 0.0}, {"temperature": -0.0001}),
    ({"top_p": 1.0}, {"top_p": 1.0001}),
    ({"top_p": 1e-6}, {"top_p": 0.0}),
    ({"top_k": -1}, {"top_k": -2}),
    ({"max_tokens": 1}, {"max_tokens": 0}),
    ({"stop": ["x" * validation.MAX_STOP_CHARS]}, {"stop": [""]}),
]


@pytest.mark.parametrize(("inside", "outside"), BOUNDS)
def test_the_ingress_bounds_are_vllms(
    inside: dict[str, Any], outside: dict[str, Any]
) -> None:
    from vllm.exceptions import VLLMValidationError

    limits = validation.Limits(max_model_len=100, vocab_size=50, max_prompt_bytes=64)

    def ingress(kw: dict[str, Any]) -> Sampling:
        kw = {"max_tokens": 4} | kw
        return validation.sampling(prompt_tokens=1, limits=limits, **kw)

    sampling_params(ingress(inside))  # vLLM accepts it
    with pytest.raises(validation.InvalidRequest):
        ingress(outside)
    # Past the ingress's bound is past vLLM's too (the same sampling, unchecked).
    unchecked = Sampling(**({"max_tokens": 4} | outside))  # type: ignore[arg-type]
    if "stop" in outside:
        unchecked = dataclasses.replace(unchecked, stop=tuple(outside["stop"]))
    with pytest.raises(VLLMValidationError):
        sampling_params(unchecked)


@pytest.mark.parametrize(
    ("settings", "amx", "executor", "single_process"),
    [
        ({}, True, "uni", True),  # a CPU engine of one rank: no worker process
        ({}, False, "uni", True),
        ({"engine": {"executor": "mp"}}, True, "mp", False),
        ({"deployment": {"num_gpus": 1}}, None, "auto", False),  # vLLM's choice
        ({"engine": {"tensor_parallel_size": 2}}, True, "auto", False),
        ({"expert_parallel": {"ranks": 2}}, True, "auto", False),  # its rank's own
    ],
)
def test_the_executor_a_config_resolves_to_reaches_vllm(
    settings: dict[str, Any], amx: bool | None, executor: str, single_process: bool
) -> None:
    from cluster.config import ClusterConfig
    from deployments.engine.args import engine_args, engine_env

    config = ClusterConfig.model_validate(settings).resolved(amx=amx)
    assert config.engine.executor == executor
    # vLLM's CPU platform keeps a uni executor only with multiprocessing off.
    env = engine_env(config.engine)
    assert (env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") is single_process
    # CPU engines' caches in huge pages, where the kernel gives them.
    assert (env.get("THP_MEM_ALLOC_ENABLE") == "1") is (amx is not None)
    args = engine_args("/m", "m", config.engine)
    want = None if executor == "auto" else executor
    assert args.distributed_executor_backend == want


def test_a_uni_executor_with_tensor_parallelism_is_refused() -> None:
    from pydantic import ValidationError

    from cluster.config import ClusterConfig

    with pytest.raises(ValidationError, match=r"engine\.executor uni"):
        ClusterConfig.model_validate(
            {"engine": {"executor": "uni", "tensor_parallel_size": 2}}
        )


@pytest.mark.parametrize(
    ("engine", "extra"),
    [
        ({}, None),
        ({"realtime_batch_mates": 0}, {"moe_cluster_realtime_batch_mates": 0}),
        ({"background_cpu_yield": 0.8}, {"moe_cluster_background_cpu_yield": 0.8}),
        (
            {"realtime_batch_mates": 2, "background_cpu_yield": 0.5},
            {
                "moe_cluster_realtime_batch_mates": 2,
                "moe_cluster_background_cpu_yield": 0.5,
            },
        ),
        (
            {"background_prefill_tokens": 256},
            {"moe_cluster_background_prefill_tokens": 256},
        ),
    ],
)
def test_the_guards_reach_the_engines_scheduler(
    engine: dict[str, Any], extra: dict[str, Any] | None
) -> None:
    from cluster.config import ClusterConfig
    from deployments.engine.args import GUARDED_SCHEDULER, engine_args

    config = ClusterConfig.model_validate({"engine": engine}).resolved(amx=False)
    args = engine_args("/m", "m", config.engine)
    if extra is None:  # vLLM's own scheduler, untouched
        assert args.scheduler_cls is None or args.scheduler_cls != GUARDED_SCHEDULER
        assert not args.additional_config
    else:
        assert args.scheduler_cls == GUARDED_SCHEDULER
        assert args.additional_config == extra


@pytest.mark.parametrize("bad", [-0.1, 0.95, 1.0])
def test_a_cpu_yield_outside_0_to_0_9_is_refused(bad: float) -> None:
    from pydantic import ValidationError

    from cluster.config import ClusterConfig

    with pytest.raises(ValidationError, match="background_cpu_yield"):
        ClusterConfig.model_validate({"engine": {"background_cpu_yield": bad}})


@pytest.mark.parametrize("bad", [0, -1])
def test_a_background_prefill_cap_below_one_token_is_refused(bad: int) -> None:
    from pydantic import ValidationError

    from cluster.config import ClusterConfig

    with pytest.raises(ValidationError, match="background_prefill_tokens"):
        ClusterConfig.model_validate({"engine": {"background_prefill_tokens": bad}})


def test_a_gpu_engine_s_kv_cache_gives_the_page_store_s_staging_its_memory() -> None:
    from deployments.engine.args import engine_args

    gpu, staging = 80 << 30, 16 << 20  # an 80 GiB device; 16 MiB buffers
    config = EngineConfig(gpu_memory_utilization=0.9, block_size=64)
    args = engine_args(
        "/m",
        "m",
        config,
        kv_store_socket="/s",
        kv_staging_bytes=staging,
        gpu_memory_bytes=gpu,
    )
    extra = args.kv_transfer_config.kv_connector_extra_config
    assert extra == {"socket": "/s", "staging_bytes": staging}
    # vLLM sizes its cache as utilization x device - what its profile run used:
    # the cache is smaller by the copier's budget, 8 buffers' worth.
    assert args.gpu_memory_utilization * gpu == pytest.approx(0.9 * gpu - 8 * staging)
    # Untouched without the store, on a CPU (no device size) or with the cache
    # sized by hand.
    for kwargs, engine in [
        ({"gpu_memory_bytes": gpu}, config),
        ({"kv_store_socket": "/s"}, config),
        (
            {"kv_store_socket": "/s", "gpu_memory_bytes": gpu},
            EngineConfig(
                gpu_memory_utilization=0.9, block_size=64, kv_cache_memory_bytes=1 << 30
            ),
        ),
    ]:
        assert engine_args("/m", "m", engine, **kwargs).gpu_memory_utilization == 0.9
    with pytest.raises(
        ValueError,
        match=r"gpu_memory_utilization 0\.1 leaves.*kvstore\.gpu_staging_mib",
    ):
        engine_args(
            "/m",
            "m",
            EngineConfig(gpu_memory_utilization=0.1, block_size=64),
            kv_store_socket="/s",
            kv_staging_bytes=2 << 30,
            gpu_memory_bytes=gpu,
        )
