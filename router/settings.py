"""The router core's own settings: frozen, plain, built once from the ``router``
section of the cluster config (``CoreSettings.of``), so the pure core reads
neither pydantic models nor YAML."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.qos import QoS
from router.rate_limits import TenantLimit

if TYPE_CHECKING:  # read by attribute only: the core never loads pydantic
    from cluster.config import RouterConfig


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """What each field means is documented once, on ``cluster.config.RouterConfig``."""

    policy: str
    max_running_per_replica: int
    realtime_reserved_slots: int
    class_weights: Mapping[QoS, float]
    max_queued: Mapping[QoS, int]
    max_wait_s: float
    default_ttft_ms: float
    breaker_failures: int
    breaker_open_s: float
    replica_stale_s: float
    prefix_balance_tokens: int
    expert_capacity_tokens: float | None
    expert_normal_factor: float
    expert_close_ratio: float
    expert_max_imbalance: float | None
    expert_max_tokens_per_s: float | None
    expert_min_window_tokens: int
    expert_probe_s: float
    tenant_rate_limits: Mapping[str, TenantLimit] = field(default_factory=dict)

    @staticmethod
    def of(section: RouterConfig) -> CoreSettings:
        """The core's settings from the validated ``router`` section."""
        return CoreSettings(
            policy=section.policy,
            max_running_per_replica=section.max_running_per_replica,
            realtime_reserved_slots=section.realtime_reserved_slots,
            class_weights={q: section.class_weights.of(q) for q in QoS},
            max_queued={q: section.max_queued.of(q) for q in QoS},
            max_wait_s=section.max_wait_s,
            default_ttft_ms=section.default_ttft_ms,
            breaker_failures=section.breaker_failures,
            breaker_open_s=section.breaker_open_s,
            replica_stale_s=section.replica_stale_s,
            prefix_balance_tokens=section.prefix_balance_tokens,
            expert_capacity_tokens=section.expert_capacity_tokens,
            expert_normal_factor=section.expert_normal_factor,
            expert_close_ratio=section.expert_close_ratio,
            expert_max_imbalance=section.expert_max_imbalance,
            expert_max_tokens_per_s=section.expert_max_tokens_per_s,
            expert_min_window_tokens=section.expert_min_window_tokens,
            expert_probe_s=section.expert_probe_s,
            tenant_rate_limits={
                tenant: TenantLimit(
                    limit.requests_per_s,
                    limit.bursts()[0],
                    limit.tokens_per_s,
                    limit.bursts()[1],
                )
                for tenant, limit in section.tenant_rate_limits.items()
            },
        )
