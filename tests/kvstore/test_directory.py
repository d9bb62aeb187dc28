"""The cluster's page directory and a store's mirror of it."""

from __future__ import annotations

from kvstore.block_hash import BlockHash
from kvstore.directory import Directory
from kvstore.node_store import Changes

H = [BlockHash(bytes([i]) * 32) for i in range(8)]


def test_publish_incremental_and_full() -> None:
    d = Directory()
    assert d.cursor("n1", "inc-a") == -1
    d.publish("n1", "inc-a", Changes(3, False, tuple(H[:3])))
    assert d.cursor("n1", "inc-a") == 3 and d.cursor("n1", "inc-b") == -1
    d.publish("n1", "inc-a", Changes(4, False, (), (H[0],)))
    assert d.holders(H[0]) == set() and d.holders(H[1]) == {"n1"}
    d.publish("n1", "inc-b", Changes(1, True, (H[5],)))  # the store restarted
    assert d.summary() == {"n1": 1} and d.holders(H[5]) == {"n1"}


def test_locate_finds_the_longest_run_on_another_node() -> None:
    d = Directory()
    d.publish("n1", "a", Changes(2, False, tuple(H[:2])))
    d.publish("n2", "a", Changes(4, False, tuple(H[:4])))
    assert d.locate(H[:5]) == ("n2", 4)
    assert d.locate(H[:5], exclude="n2") == ("n1", 2)
    assert d.locate(H[5:]) is None and d.locate([]) is None


def test_a_mirror_follows_the_log_and_resyncs_in_full() -> None:
    d, mirror = Directory(), Directory()
    d.publish("n1", "a", Changes(2, False, tuple(H[:2])))
    c = d.log.since(-1)
    mirror.follow(c)
    assert mirror.locate(H[:2]) == ("n1", 2)
    d.publish("n2", "a", Changes(1, False, (H[0],)))
    d.forget("n1")
    c2 = d.log.since(c.seq)
    mirror.follow(c2)
    assert mirror.summary() == {"n2": 1}
    mirror.follow(Changes(9, True, (("n3", H[7]),)))
    assert mirror.summary() == {"n3": 1}


def test_hottest_sums_the_nodes_counts() -> None:
    d = Directory()
    a, b = ("", (1, 2)), ("t", (3,))
    d.set_hot("n1", [(a, 2), (b, 1)])
    d.set_hot("n2", [(b, 5)])
    assert d.hottest(2) == [b, a]
    d.forget("n2")
    assert d.hottest(1) == [a]
