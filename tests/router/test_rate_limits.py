from typing import Any

import pytest
from pydantic import ValidationError

from cluster.config import RouterConfig
from cluster.qos import QoS
from router.core import RouterCore
from router.rate_limits import TenantLimit, TenantRateLimits
from router.settings import CoreSettings
from router.types import ReplicaId, ReplicaReport, RouteDecision, Shed, Ticket
from tests.router.clock import Clock
from tests.router.support import submit


def test_a_bucket_admits_its_burst_then_refuses_until_it_refills() -> None:
    clock = Clock()
    limits = TenantRateLimits(
        {"acme": TenantLimit(requests_per_s=2.0, request_burst=3.0)}, clock
    )
    assert [limits.take("acme", 10) for _ in range(3)] == [None, None, None]
    refused = limits.take("acme", 10)
    assert refused is not None and refused.what == "requests"
    assert refused.retry_after_s == pytest.approx(0.5)  # one request at 2/s
    clock.advance(0.25)  # half a request back: not enough
    refused = limits.take("acme", 10)
    assert refused is not None
    assert refused.retry_after_s == pytest.approx(0.25)
    clock.advance(refused.retry_after_s)
    assert limits.take("acme", 10) is None
    assert limits.take("acme", 10) is not None
    clock.advance(100)  # refills up to the burst, no further
    assert [limits.take("acme", 10) for _ in range(4)][-1] is not None


def test_a_request_larger_than_the_token_burst_is_served_and_its_debt_waited_out() -> (
    None
):
    clock = Clock()
    limits = TenantRateLimits(
        {"": TenantLimit(tokens_per_s=100.0, token_burst=100.0)}, clock
    )
    assert limits.take("", 300) is None  # more than the burst, the bucket full
    refused = limits.take("", 1)
    assert refused is not None and refused.what == "tokens"
    assert refused.retry_after_s == pytest.approx(2.01)  # 200 of debt, and 1
    clock.advance(2.0)
    assert limits.take("", 1) is not None
    clock.advance(0.01)
    assert limits.take("", 1) is None
    clock.advance(0.5)  # 50 tokens back: a large request waits for a full bucket
    refused = limits.take("", 500)
    assert refused is not None
    assert refused.retry_after_s == pytest.approx(0.5)


def test_tenants_have_their_own_buckets_and_unnamed_ones_follow_the_star() -> None:
    clock = Clock()
    limits = TenantRateLimits(
        {
            "acme": TenantLimit(requests_per_s=1.0, request_burst=1.0),
            "*": TenantLimit(requests_per_s=1.0, request_burst=2.0),
        },
        clock,
    )
    assert limits.take("acme", 1) is None
    assert limits.take("acme", 1) is not None
    # Each tenant under "*" spends its own two.
    for tenant in ("t1", "t2"):
        assert limits.take(tenant, 1) is None
        assert limits.take(tenant, 1) is None
        assert limits.take(tenant, 1) is not None
    assert limits.tracked() == 3
    clock.advance(10)
    limits.prune()  # full again: forgotten; a named tenant's buckets stay
    assert limits.tracked() == 1


def test_no_limit_for_a_tenant_without_an_entry_and_no_star() -> None:
    limits = TenantRateLimits(
        {"acme": TenantLimit(requests_per_s=1.0, request_burst=1.0)}, Clock()
    )
    assert all(limits.take("other", 10**6) is None for _ in range(100))
    assert limits.tracked() == 0


def test_give_back_undoes_a_take() -> None:
    limits = TenantRateLimits(
        {"a": TenantLimit(requests_per_s=1.0, request_burst=1.0, tokens_per_s=10.0)},
        Clock(),
    )
    assert limits.take("a", 5) is None
    limits.give_back("a", 5)
    assert limits.take("a", 5) is None
    assert limits.take("a", 5) is not None


# -- in the router -------------------------------------------------------------


def _core(clock: Clock, limits: dict[str, Any], **kw: Any) -> RouterCore:
    cfg = RouterConfig.model_validate(
        {
            "max_running_per_replica": 1,
            "realtime_reserved_slots": 0,
            "max_queued": {"realtime": 1, "normal": 1, "background": 1},
            "tenant_rate_limits": limits,
            **kw,
        }
    )
    core = RouterCore(CoreSettings.of(cfg), clock=clock)
    core.report(ReplicaReport(ReplicaId("a")))
    return core


def _t(rid: str, tenant: str, **kw: Any) -> Ticket:
    return Ticket(rid, QoS.NORMAL, 10, 10, tenant=tenant, **kw)


def test_the_router_refuses_a_tenant_over_its_rate_with_a_retry_hint() -> None:
    clock = Clock()
    core = _core(
        clock,
        {"acme": {"requests_per_s": 1, "request_burst": 1}},
        max_running_per_replica=8,
    )
    assert isinstance(submit(core, _t("1", "acme")), RouteDecision)
    with pytest.raises(Shed) as refused:
        submit(core, _t("2", "acme"))
    assert refused.value.reason == "rate-limit"
    assert "acme" in str(refused.value) and "1 requests/s" in str(refused.value)
    assert 0.9 <= refused.value.retry_after_s <= 1.01
    assert core.snapshot().shed["normal/rate-limit"] == 1
    # Another tenant is not limited by acme's bucket.
    assert isinstance(submit(core, _t("3", "")), RouteDecision)
    # A resumed stream is the same request: never charged, never refused.
    assert isinstance(submit(core, _t("2", "acme", resumed=True)), RouteDecision)
    clock.advance(1.0)
    assert isinstance(submit(core, _t("4", "acme")), RouteDecision)


def test_a_request_the_queue_refuses_is_not_charged() -> None:
    clock = Clock()
    core = _core(clock, {"acme": {"requests_per_s": 1, "request_burst": 2}})
    assert isinstance(submit(core, _t("run", "")), RouteDecision)  # the only slot
    submit(core, _t("wait", ""))  # the queue's one place
    for i in range(3):  # queue full: refused for that, not charged
        with pytest.raises(Shed) as refused:
            submit(core, _t(f"full{i}", "acme"))
        assert refused.value.reason == "queue-full"
    assert core.rate_limits.take("acme", 1) is None  # both still in the bucket
    assert core.rate_limits.take("acme", 1) is None


def test_the_config_checks_tenants_rates_and_that_the_router_runs() -> None:
    cfg = RouterConfig.model_validate(
        {"tenant_rate_limits": {"*": {"requests_per_s": 0.5}, "a": {"tokens_per_s": 8}}}
    )
    settings = CoreSettings.of(cfg)
    assert settings.tenant_rate_limits["*"] == TenantLimit(0.5, 1.0, None, 1.0)
    assert settings.tenant_rate_limits["a"] == TenantLimit(None, 1.0, 8.0, 8.0)
    with pytest.raises(ValidationError, match="requests_per_s, tokens_per_s"):
        RouterConfig.model_validate({"tenant_rate_limits": {"a": {}}})
    with pytest.raises(ValidationError, match="tenant 'bad name'"):
        RouterConfig.model_validate(
            {"tenant_rate_limits": {"bad name": {"requests_per_s": 1}}}
        )
    with pytest.raises(ValidationError, match="greater than 0"):
        RouterConfig.model_validate(
            {"tenant_rate_limits": {"a": {"requests_per_s": 0}}}
        )
    with pytest.raises(ValidationError, match=r"router\.enabled"):
        RouterConfig.model_validate(
            {"enabled": False, "tenant_rate_limits": {"a": {"requests_per_s": 1}}}
        )
