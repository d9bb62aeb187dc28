"""QoS classes; the value is vLLM's ``priority`` (smaller runs first)."""

from __future__ import annotations

from enum import IntEnum


class QoS(IntEnum):
    """Most urgent first. ``int(qos)`` is the engine priority, so the engine's
    priority scheduler preempts in the same order the cluster admits."""

    REALTIME = 0
    NORMAL = 1
    BACKGROUND = 2

    @classmethod
    def parse(cls, name: str) -> QoS:
        """``"realtime"`` → ``QoS.REALTIME``; raises ValueError listing the choices."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            choices = ", ".join(q.name.lower() for q in cls)
            raise ValueError(
                f"unknown QoS class {name!r}; expected one of {choices}"
            ) from None
