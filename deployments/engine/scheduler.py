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

With ``engine.background_prefill_tokens = T``, a step in which only background
requests have prompt tokens to compute (none more urgent waits or is still
prefilling) computes at most ``T`` of them, besides one token for each running
request: a realtime request that arrives in the middle of a step waits for that
step before its own, and without the cap a step that admits a burst of
background prompts computes up to ``max_num_batched_tokens`` of them. The rest
of those prompts follow in the next steps, so background loses only the steps'
fixed cost. Where vLLM chunks prompts the cap is exact; where it does not (it
turns chunked prefill off for MLA on a CPU without AMX) a step takes whole
prompts up to ``T`` tokens, and always at least one.

The guard shares a batch; on a CPU node the engines also share the cores. With
``engine.background_cpu_yield = f``, an engine holding only background requests,
while another engine on the node holds a realtime one (``realtime_board``),
idles ``f`` of its time: after each step it sleeps ``f / (1 - f)`` of that step,
and the cores go to the realtime engine. It runs on at ``1 - f`` of its pace
and goes back to full pace within ``RealtimeBoard.fresh_s`` of the last
realtime step. Normal requests are not held this way either, and one sent to an
idling engine wakes it (its frontend marks the board first).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from cluster.qos import QoS
from deployments.engine.args import BATCH_MATES_KEY, CPU_YIELD_KEY, PREFILL_CAP_KEY
from deployments.engine.realtime_board import RealtimeBoard

_REALTIME = int(QoS.REALTIME)
_BACKGROUND = int(QoS.BACKGROUND)
MAX_STEP_S = 0.05  # longer between steps: the engine sat idle, not stepping


class _RealtimeGuard:
    """Over a vLLM ``Scheduler``: holds background while realtime runs."""

    running: list[Any]
    waiting: Any
    kv_holding_waiting: Any
    current_step: int
    max_num_active_reqs: int
    max_num_scheduled_tokens: int
    scheduler_config: Any
    _batch_mates: int | None
    _prefill_cap: int | None
    _cpu_yield: float
    _board: RealtimeBoard | None
    _stepped_at: float | None
    guarded_steps: int
    yielded_s: float

    def _init_guard(self, vllm_config: Any) -> None:
        extra = vllm_config.additional_config or {}
        mates = extra.get(BATCH_MATES_KEY)
        self._batch_mates = None if mates is None else int(mates)
        cap = extra.get(PREFILL_CAP_KEY)
        self._prefill_cap = None if cap is None else int(cap)
        self._cpu_yield = float(extra.get(CPU_YIELD_KEY, 0.0))
        self._board = RealtimeBoard() if self._cpu_yield > 0 else None
        self._stepped_at = None  # when the last step began
        self.guarded_steps = 0  # steps that held background back
        self.capped_steps = 0  # steps whose background prefill was capped
        self.yielded_s = 0.0  # time idled for realtime in other engines

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        top = self._most_urgent()
        if self._board is not None:
            self._give_way(top)
        active, budget = self.max_num_active_reqs, self.max_num_scheduled_tokens
        if top == _REALTIME and self._batch_mates is not None:
            held = self._hold_background(self._batch_mates)
            self.guarded_steps += 1
            # No new background prefill: the waiting queues pop by priority, so
            # room for the realtime and normal ones waiting admits only them.
            self.max_num_active_reqs = min(active, len(self.running) + held)
        elif self._prefill_cap is not None:
            longest = self._background_prompt_left()
            if longest is not None:
                # One token for each running request (a decode, or a chunk of a
                # background prompt), and the cap for background prompts. Where
                # vLLM does not chunk prompts (MLA on a CPU without AMX), one
                # that does not fit waits for good: the step takes whole
                # prompts up to the cap, and at least one.
                cap = self._prefill_cap
                if not self.scheduler_config.enable_chunked_prefill:
                    cap = max(cap, longest)
                capped = len(self.running) + cap
                if capped < budget:
                    self.capped_steps += 1
                    self.max_num_scheduled_tokens = capped
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.max_num_active_reqs = active
            self.max_num_scheduled_tokens = budget

    def shutdown(self) -> None:
        if self._board is not None:
            self._board.close()
            self._board = None
        super().shutdown()  # type: ignore[misc]

    def _waiting(self) -> list[Any]:
        return [*self.kv_holding_waiting, *self.waiting]

    def _most_urgent(self) -> int | None:
        """The most urgent class in the engine (running or waiting), if any.
        Every engine step comes here: it stops at the first realtime request."""
        top = None
        queues = (self.running, self.kv_holding_waiting, self.waiting)
        for r in itertools.chain.from_iterable(queues):
            if r.priority == _REALTIME:
                return _REALTIME
            if top is None or r.priority < top:
                top = r.priority
        return top

    def _background_prompt_left(self) -> int | None:
        """The most prompt tokens a request has left to compute, if some are
        left and all of them are background requests' (waiting, or running
        mid-prompt); None otherwise."""
        # A waiting request computes all its tokens (a preempted one's output
        # too); a running one its prompt's rest, if it is mid-prompt.
        left = [(r, r.num_tokens - r.num_computed_tokens) for r in self._waiting()]
        left += [(r, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running]
        longest = None
        for r, n in left:
            if n <= 0:
                continue
            if r.priority < _BACKGROUND:
                return None
            longest = max(n, longest or 0)
        return longest

    def _give_way(self, top: int | None) -> None:
        """Marks the board while this engine holds realtime; sleeps after a
        step of background alone while another engine holds realtime."""
        assert self._board is not None
        now = time.monotonic()
        if top == _REALTIME:
            self._board.mark(now)
        elif (
            top is not None
            and top >= _BACKGROUND
            and self._stepped_at is not None
            and self._board.others_hold_realtime(now)
        ):
            step = min(now - self._stepped_at, MAX_STEP_S)
            pause = step * self._cpu_yield / (1 - self._cpu_yield)
            # Cut short when the frontend sends a request that is not
            # background (it wakes this engine first): it is read after this.
            self.yielded_s += self._board.idle(pause, since=self._stepped_at)
        self._stepped_at = time.monotonic()

    def _hold_background(self, mates: int) -> int:
        """Pauses, for the coming step, the running background requests past
        the first ``mates`` (a realtime request is in the engine). Returns how
        many realtime and normal requests wait (the room the step may admit)."""
        # The next schedule() call is step current_step + 1: skip it.
        skip_until = self.current_step + 2
        seen = 0
        for r in self.running:
            if r.priority >= _BACKGROUND:
                seen += 1
                if seen > mates:
                    r.next_decode_eligible_step = max(
                        r.next_decode_eligible_step, skip_until
                    )
        return sum(1 for r in self._waiting() if r.priority < _BACKGROUND)


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
