import pytest

from cluster.qos import QoS


def test_order_matches_vllm_priority() -> None:
    assert sorted(QoS) == [QoS.REALTIME, QoS.NORMAL, QoS.BACKGROUND]
    assert [int(q) for q in QoS] == [0, 1, 2]  # smaller runs first in vLLM


def test_parse() -> None:
    assert QoS.parse(" Realtime ") is QoS.REALTIME
    with pytest.raises(ValueError, match="realtime, normal, background"):
        QoS.parse("urgent")
