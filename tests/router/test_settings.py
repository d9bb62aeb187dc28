import dataclasses

from cluster.config import RouterConfig
from cluster.qos import QoS
from router.settings import CoreSettings


def test_core_settings_are_the_router_sections_own_fields() -> None:
    section = RouterConfig.model_validate(
        {
            "policy": "prefix",
            "max_queued": {"realtime": 1, "normal": 2, "background": 3},
        }
    )
    s = CoreSettings.of(section)
    names = {f.name for f in dataclasses.fields(CoreSettings)}
    assert names <= set(RouterConfig.model_fields)  # documented there, once
    for name in names - {"class_weights", "max_queued"}:
        assert getattr(s, name) == getattr(section, name), name
    assert s.max_queued == {QoS.REALTIME: 1, QoS.NORMAL: 2, QoS.BACKGROUND: 3}
    assert s.class_weights == {q: section.class_weights.of(q) for q in QoS}
