"""Expert-parallel groups: N engine ranks that Serve places, starts and restarts
as one gang.

Each rank is an ``EngineDeployment`` replica of a Serve gang (``gang_size`` =
ranks, one placement group with a bundle per rank, ``RESTART_GANG``: one dead
rank restarts the group). Its engine is one vLLM data-parallel rank with
``enable_expert_parallel``: attention runs per rank on that rank's requests, and
every MoE layer exchanges tokens with the other ranks, each of which holds
``1/N`` of the routed experts. vLLM's external-load-balancer DP mode fits that
shape: every rank has its own front end, and rank 0's front end runs the DP
coordinator the others connect to (at the address rank 0 publishes here).

This module is the gang's rendezvous and the deployment options; it imports no
vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from cluster.config import ClusterConfig

logger = logging.getLogger("moe_cluster.engine")
_KEY = "moe-cluster/ep-group/{}"


@dataclass(frozen=True, slots=True)
class GroupRank:
    """This replica's place in its EP group, and where rank 0 listens."""

    group_id: str
    rank: int
    size: int
    address: str
    rpc_port: int

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "data_parallel_size": self.size,
            "data_parallel_rank": self.rank,
            "data_parallel_address": self.address,
            "data_parallel_rpc_port": self.rpc_port,
            "enable_expert_parallel": True,
            # One worker per rank, in the rank's engine process. (Inside the
            # gang's placement group vLLM would otherwise pick its Ray executor
            # and ask for a placement group of its own.)
            "distributed_executor_backend": "uni",
        }


async def join(gang: Any, timeout_s: float) -> GroupRank:
    """Rank 0 publishes an address and a free port for the group's coordinator;
    the other ranks wait for it (in Ray's KV store, keyed by the gang)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

    key = _KEY.format(gang.gang_id).encode()
    if gang.rank == 0:
        from ray.util.collective.collective import get_address_and_port

        address, port = get_address_and_port()
        _internal_kv_put(key, json.dumps([address, port]).encode(), overwrite=True)
    else:
        deadline = time.monotonic() + timeout_s
        while (value := _internal_kv_get(key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank 0 of EP group {gang.gang_id} published no address in "
                    f"{timeout_s:.0f} s"
                )
            await asyncio.sleep(0.2)
        address, port = json.loads(value)
    logger.info(
        "EP group %s: rank %d of %d, coordinator at %s:%d",
        gang.gang_id,
        gang.rank,
        gang.world_size,
        address,
        port,
    )
    return GroupRank(gang.gang_id, gang.rank, gang.world_size, address, int(port))


def leave(group: GroupRank) -> None:
    """Rank 0 removes the group's published address (the gang is gone)."""
    if group.rank != 0:
        return
    from ray.experimental.internal_kv import _internal_kv_del

    try:
        _internal_kv_del(_KEY.format(group.group_id).encode())
    except Exception:  # Ray shutting down: the key goes with the cluster
        logger.debug("could not remove EP group %s's address", group.group_id)


SHUTDOWN_MARGIN_S = 30.0  # a hand-off's resumption, then the engine's shutdown
DRAIN_CHECK_S = 0.5  # how often Serve looks whether a stopping replica is idle


def shutdown_timeout_s(config: ClusterConfig) -> float:
    """How long Serve lets a stopping replica (engine or ingress) drain before it
    kills it: the drain timeout and the margin after it."""
    return config.deployment.drain_timeout_s + SHUTDOWN_MARGIN_S


def engine_options(config: ClusterConfig, env: dict[str, str]) -> dict[str, Any]:
    """Serve options of the engine deployment: one replica per engine, or per rank
    of each EP group with the group gang-scheduled."""
    d, ep = config.deployment, config.expert_parallel
    actor: dict[str, Any] = {
        "num_cpus": d.num_cpus,
        "num_gpus": d.num_gpus,
        "runtime_env": {"env_vars": env},
    }
    if ep.on_gpu:
        actor["num_gpus"] = 1
    elif ep.accelerator is not None:
        actor["resources"] = {ep.accelerator: 1}
    options: dict[str, Any] = {
        "num_replicas": d.num_replicas * ep.ranks,
        "max_ongoing_requests": d.max_ongoing_requests,
        "max_queued_requests": d.max_queued_requests,
        "health_check_period_s": d.health_check_period_s,
        "health_check_timeout_s": d.health_check_timeout_s,
        # The replica's own drain (see EngineServer) ends within drain_timeout_s;
        # Serve's force-kill comes after the engine's shutdown too.
        "graceful_shutdown_timeout_s": shutdown_timeout_s(config),
        "graceful_shutdown_wait_loop_s": DRAIN_CHECK_S,
        "ray_actor_options": actor,
    }
    if d.autoscaling.enabled:
        del options["num_replicas"]
        options["autoscaling_config"] = autoscaling_config(config)
    if ep.enabled:
        from ray.serve.config import (
            GangPlacementStrategy,
            GangRuntimeFailurePolicy,
            GangSchedulingConfig,
        )

        options["gang_scheduling_config"] = GangSchedulingConfig(
            gang_size=ep.ranks,
            gang_placement_strategy=GangPlacementStrategy(ep.placement.upper()),
            runtime_failure_policy=GangRuntimeFailurePolicy.RESTART_GANG,
        )
    return options


def autoscaling_config(config: ClusterConfig) -> dict[str, Any]:
    """Serve's autoscaling config of the engine deployment: the QoS-aware policy
    (``router.autoscaling``) decides, in Serve replicas (ranks), by whole EP
    groups; its own delays, so Serve adds none."""
    from router.autoscaling import POLICY_FUNCTION

    d, ranks = config.deployment, config.expert_parallel.ranks
    a = d.autoscaling
    low, high = a.min_replicas * ranks, a.max_replicas * ranks
    kwargs = {
        "min_replicas": low,
        "max_replicas": high,
        "unit": ranks,
        "slo_ttft_s": [a.realtime_slo_ttft_ms / 1000, a.normal_slo_ttft_ms / 1000],
        "background_max_age_s": a.background_max_age_s,
        "target_utilization": a.target_utilization,
        "downscale_utilization": a.downscale_utilization,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
    }
    return {
        "min_replicas": low,
        "max_replicas": high,
        "initial_replicas": min(max(d.num_replicas * ranks, low), high),
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        # Serve 2.60's only per-deployment push interval (deprecated in favour of
        # a process-wide environment variable).
        "metrics_interval_s": a.metrics_interval_s,
        "look_back_period_s": a.look_back_period_s,
        "policy": {"policy_function": POLICY_FUNCTION, "policy_kwargs": kwargs},
    }


def gpu_engine_kwargs(config: ClusterConfig) -> dict[str, Any]:
    """vLLM arguments only GPU EP groups take (validated in ``ClusterConfig``)."""
    ep = config.expert_parallel
    out: dict[str, Any] = {}
    if ep.all2all_backend is not None:
        out["all2all_backend"] = ep.all2all_backend
    if ep.eplb:
        out["enable_eplb"] = True
        out["eplb_config"] = {
            "window_size": ep.eplb_window_size,
            "step_interval": ep.eplb_step_interval,
            "num_redundant_experts": ep.num_redundant_experts,
        }
    return out
