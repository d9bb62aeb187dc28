from collections import Counter

from cluster.qos import QoS
from kvstore.block_hash import block_hashes
from kvstore.node_store import Changes
from router.breakers import ReplicaBreaker
from router.policies import ExpertAware, LeastLoaded, PrefixAware, WeightedRoundRobin
from router.prefix import PrefixView
from router.replicas import Lease, Replica
from router.types import KVEvent, ReplicaId, Ticket
from tests.router.clock import Clock


def _replica(name: str, *leases: Lease, tokens_per_s: float = 0.0) -> Replica:
    b = ReplicaBreaker(name, failures=1, open_s=1, clock=Clock(), emit=print)
    r = Replica(ReplicaId(name), b, 0.0, tokens_per_s)
    for lease in leases:
        r.add(lease)
    return r


def _lease(rid: str, prompt: int, max_tokens: int, out: int = 0, hist=()) -> Lease:
    return Lease(rid, QoS.NORMAL, prompt, max_tokens, 0.0, tuple(hist), out)


T = Ticket("t", QoS.NORMAL, 32, 16)


def test_lease_remaining_work() -> None:
    assert _lease("a", 100, 50).remaining_tokens == 150
    assert _lease("a", 100, 50, out=10).remaining_tokens == 40  # prefilled


def test_least_loaded_counts_tokens_not_requests() -> None:
    a = _replica("a", _lease("1", 10, 10), _lease("2", 10, 10))  # 40 tokens
    b = _replica("b", _lease("3", 500, 100))  # 600 tokens
    assert LeastLoaded().choose(T, [b, a])[:2] == (a, "least-loaded")
    assert LeastLoaded().choose(T, [_replica("z"), _replica("y")])[0].replica_id == "y"


def test_weighted_round_robin_follows_measured_capacity() -> None:
    a = _replica("a", tokens_per_s=300)
    b = _replica("b", tokens_per_s=100)
    wrr = WeightedRoundRobin()
    picks = [wrr.choose(T, [a, b])[0].replica_id for _ in range(8)]
    assert Counter(picks) == {"a": 6, "b": 2}
    assert picks[:4] == ["a", "a", "b", "a"]  # smooth: b is not starved to the end
    c = _replica("c")  # not measured yet: weighs as the mean (200)
    picks = [wrr.choose(T, [a, b, c])[0].replica_id for _ in range(600)]
    assert Counter(picks) == {"a": 300, "b": 100, "c": 200}


def test_prefix_prefers_longest_cached_prefix_within_balance() -> None:
    tokens = list(range(64))
    hashes = block_hashes(tokens, 16)
    d = PrefixView()
    d.engines.apply(ReplicaId("a"), [KVEvent("stored", hashes[:1])])
    d.engines.apply(ReplicaId("b"), [KVEvent("stored", hashes[:3])])
    t = Ticket("t", QoS.NORMAL, 64, 16, block_hashes=hashes)
    a = _replica("a")
    b = _replica("b", _lease("1", 100, 100))  # 200 tokens busier
    assert PrefixAware(d, balance_tokens=200).choose(t, [a, b]) == (b, "prefix", 3)
    assert PrefixAware(d, balance_tokens=199).choose(t, [a, b]) == (
        a,
        "prefix-overloaded",
        1,
    )
    cold = Ticket("c", QoS.NORMAL, 64, 16, block_hashes=block_hashes([7] * 64, 16))
    assert PrefixAware(d, 200).choose(cold, [a, b]) == (a, "least-loaded", 0)


def test_expert_aware_avoids_replicas_hot_on_the_prompts_experts() -> None:
    # a runs a request heavy on expert 0; b one heavy on expert 2, and more tokens
    a = _replica("a", _lease("1", 10, 10, hist=(40, 0, 0, 0)))
    b = _replica("b", _lease("2", 50, 50, hist=(0, 0, 40, 0)))
    on_0 = Ticket("t", QoS.NORMAL, 8, 8, expert_hist=(8, 8, 0, 0))
    on_2 = Ticket("u", QoS.NORMAL, 8, 8, expert_hist=(0, 0, 8, 8))
    pol = ExpertAware(4)
    assert pol.choose(on_0, [a, b])[:2] == (b, "expert")
    assert pol.choose(on_2, [a, b])[:2] == (a, "expert")
    no_hist = Ticket("v", QoS.NORMAL, 8, 8)
    assert pol.choose(no_hist, [a, b])[:2] == (a, "least-loaded")


def test_prefix_counts_the_pages_of_a_replicas_node_store() -> None:
    hashes = block_hashes(list(range(64)), 16)
    view = PrefixView()
    view.engines.apply(ReplicaId("a"), [KVEvent("stored", hashes[:1])])
    # Node n2's store holds the first three pages: b, on n2, can load them.
    view.follow_stores(Changes(3, True, tuple(("n2", h) for h in hashes[:3])))
    a, b = _replica("a"), _replica("b")
    a.node_id, b.node_id = "n1", "n2"
    t = Ticket("t", QoS.NORMAL, 64, 16, block_hashes=hashes)
    assert PrefixAware(view, balance_tokens=200).choose(t, [a, b]) == (b, "prefix", 3)
