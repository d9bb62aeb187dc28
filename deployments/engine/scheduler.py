"""vLLM's scheduler with realtime batch guarding: while a realtime request is in
an engine, background requests pause rather than share its batch.

vLLM's priority policy orders the waiting queue and preempts by priority only
when KV blocks run out; a realtime stream otherwise decodes in the same batch as
every background stream, and on a CPU each step costs about what the batch
holds. With ``engine.realtime_batch_mates = K``, every step that has a realtime
request (running or waiting) in the engine decodes at most ``K`` background
requests (the oldest running ones) and admits no new background prefill. The
paused ones keep their KV blocks and their place, and go on as soon as no
realtime request is left: nothing is recomputed. Normal requests are not held.

The engine core resolves ``scheduler_cls`` by name and calls it with the
scheduler's own arguments, so ``guarded_scheduler`` picks, per engine, the guard
over the class vLLM would have used (``AsyncScheduler`` when async scheduling is
on). ``K`` comes in the engine's ``additional_config`` (``BATCH_MATES_KEY``).
"""

from __future__ import annotations

import itertools
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from cluster.qos import QoS
from deployments.engine.args import BATCH_MATES_KEY

_REALTIME = int(QoS.REALTIME)
_BACKGROUND = int(QoS.BACKGROUND)


class _RealtimeGuard:
    """Over a vLLM ``Scheduler``: holds background while realtime runs."""

    running: list[Any]
    waiting: Any
    kv_holding_waiting: Any
    current_step: int
    max_num_active_reqs: int
    _batch_mates: int
    guarded_steps: int

    def _init_guard(self, vllm_config: Any) -> None:
        extra = vllm_config.additional_config or {}
        self._batch_mates = int(extra[BATCH_MATES_KEY])
        self.guarded_steps = 0  # steps that held background back

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        held = self._hold_background()
        if held is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        self.guarded_steps += 1
        active = self.max_num_active_reqs
        # No new background prefill: the waiting queues pop by priority, so
        # room for the realtime and normal ones waiting admits only them.
        self.max_num_active_reqs = min(active, len(self.running) + held)
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.max_num_active_reqs = active

    def _hold_background(self) -> int | None:
        """Pauses, for the coming step, the running background requests past
        the first ``K`` when a realtime request is in the engine. Returns how
        many realtime and normal requests wait (the room the step may admit),
        or ``None`` when there is nothing to guard."""
        # Every engine step comes here: nothing is built while the queues are
        # empty, and nothing is walked past the first realtime request.
        waiting = (
            [*self.kv_holding_waiting, *self.waiting]
            if self.kv_holding_waiting or self.waiting
            else []
        )
        if not any(
            r.priority == _REALTIME for r in itertools.chain(self.running, waiting)
        ):
            return None
        # The next schedule() call is step current_step + 1: skip it.
        skip_until = self.current_step + 2
        mates = 0
        for r in self.running:
            if r.priority >= _BACKGROUND:
                mates += 1
                if mates > self._batch_mates:
                    r.next_decode_eligible_step = max(
                        r.next_decode_eligible_step, skip_until
                    )
        return sum(1 for r in waiting if r.priority < _BACKGROUND)


class GuardedScheduler(_RealtimeGuard, Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_guard(kwargs["vllm_config"])


class GuardedAsyncScheduler(_RealtimeGuard, AsyncScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_guard(kwargs["vllm_config"])


def guarded_scheduler(**kwargs: Any) -> Scheduler:
    """The engine core's scheduler (``scheduler_cls``): the guard over the
    scheduler vLLM picks for this engine's config."""
    config = kwargs["vllm_config"]
    if config.scheduler_config.async_scheduling:
        return GuardedAsyncScheduler(**kwargs)
    return GuardedScheduler(**kwargs)
