"""The realtime guard over vLLM's scheduler, against a stand-in that schedules as
vLLM's does in the three ways the guard uses: a running request decodes in a step
only from its ``next_decode_eligible_step``, waiting requests are admitted by
priority while the running ones number under ``max_num_active_reqs``, and a
step computes at most ``max_num_scheduled_tokens`` tokens, running requests
first (a prompt is chunked across steps)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from cluster.qos import QoS
from deployments.engine import realtime_board, scheduler
from deployments.engine.args import BATCH_MATES_KEY, CPU_YIELD_KEY, PREFILL_CAP_KEY
from deployments.engine.scheduler import MAX_STEP_S, _RealtimeGuard

RT, NORMAL, BG = int(QoS.REALTIME), int(QoS.NORMAL), int(QoS.BACKGROUND)


@dataclass(eq=False)
class Req:
    name: str
    priority: int
    next_decode_eligible_step: int = 0
    num_prompt_tokens: int = 1
    num_computed_tokens: int = 0  # a waiting request's: none yet

    @property
    def num_tokens(self) -> int:  # prompt and output (none here)
        return self.num_prompt_tokens


def _running(r: Req) -> Req:
    r.num_computed_tokens = r.num_prompt_tokens  # decoding
    return r


class StandIn:
    def __init__(self, running: list[Req], waiting: list[Req]) -> None:
        self.running = running
        for r in running:
            if r.num_computed_tokens == 0:
                _running(r)
        self.waiting = waiting
        self.kv_holding_waiting: list[Req] = []
        self.current_step = 0
        self.max_num_active_reqs = 8
        self.max_num_scheduled_tokens = 2048
        self.scheduler_config = SimpleNamespace(enable_chunked_prefill=True)
        self.tokens: dict[str, int] = {}  # what each request computed last step

    def _take(self, r: Req, budget: int) -> int:
        n = min(max(1, r.num_prompt_tokens - r.num_computed_tokens), budget)
        r.num_computed_tokens += n
        self.tokens[r.name] = n
        return n

    def schedule(self) -> tuple[list[str], list[str]]:
        """(requests decoded, requests admitted) this step."""
        self.current_step += 1
        self.tokens = {}
        budget = self.max_num_scheduled_tokens
        decoded = []
        for r in self.running:
            if self.current_step >= r.next_decode_eligible_step and budget > 0:
                budget -= self._take(r, budget)
                decoded.append(r.name)
        admitted = []
        chunked = self.scheduler_config.enable_chunked_prefill
        for r in sorted(self.waiting, key=lambda r: r.priority):
            if len(self.running) >= self.max_num_active_reqs or budget <= 0:
                break
            if not chunked and r.num_prompt_tokens > budget:
                break  # vLLM's way: a prompt that does not fit waits
            self.waiting.remove(r)
            self.running.append(r)
            budget -= self._take(r, budget)
            admitted.append(r.name)
        return decoded, admitted


class Guarded(_RealtimeGuard, StandIn):
    def __init__(
        self,
        running: list[Req],
        waiting: list[Req],
        mates: int | None,
        cpu_yield: float | None = None,
        prefill_cap: int | None = None,
    ) -> None:
        StandIn.__init__(self, running, waiting)
        extra: dict[str, Any] = {}
        if mates is not None:
            extra[BATCH_MATES_KEY] = mates
        if cpu_yield is not None:
            extra[CPU_YIELD_KEY] = cpu_yield
        if prefill_cap is not None:
            extra[PREFILL_CAP_KEY] = prefill_cap
        self._init_guard(SimpleNamespace(additional_config=extra))


def _bg(n: int) -> list[Req]:
    return [Req(f"bg{i}", BG) for i in range(n)]


def test_without_realtime_every_class_shares_the_batch() -> None:
    s = Guarded([*_bg(4), Req("n", NORMAL)], [Req("bg-new", BG)], mates=1)
    decoded, admitted = s.schedule()
    assert decoded == ["bg0", "bg1", "bg2", "bg3", "n"]
    assert admitted == ["bg-new"]
    assert s.guarded_steps == 0


def test_while_realtime_runs_only_k_background_decode_and_none_is_admitted() -> None:
    running = [*_bg(4), Req("n", NORMAL), Req("rt", RT)]
    waiting = [Req("bg-new", BG), Req("n-new", NORMAL), Req("rt-new", RT)]
    s = Guarded(running, waiting, mates=2)
    decoded, admitted = s.schedule()
    assert decoded == ["bg0", "bg1", "n", "rt"]  # the oldest 2 background
    assert admitted == ["rt-new", "n-new"]  # waiting background stays waiting
    assert s.max_num_active_reqs == 8  # restored after the step
    assert s.guarded_steps == 1
    decoded, admitted = s.schedule()  # still guarded: the same hold
    assert decoded == ["bg0", "bg1", "n", "rt", "rt-new", "n-new"]
    assert admitted == []
    # Realtime done: every background request goes on at the next step.
    s.running = [r for r in s.running if r.priority != RT]
    decoded, admitted = s.schedule()
    assert decoded == ["bg0", "bg1", "bg2", "bg3", "n", "n-new"]
    assert admitted == ["bg-new"]


def test_a_realtime_request_still_waiting_already_holds_background() -> None:
    s = Guarded(_bg(3), [Req("rt", RT)], mates=0)
    decoded, admitted = s.schedule()
    assert decoded == []  # its first step is its own prefill
    assert admitted == ["rt"]


def _prompts(n: int, priority: int, tokens: int, name: str = "bg-new") -> list[Req]:
    return [Req(f"{name}{i}", priority, num_prompt_tokens=tokens) for i in range(n)]


def test_a_burst_of_background_prompts_is_spread_over_capped_steps() -> None:
    s = Guarded(_bg(2), _prompts(3, BG, 150), mates=0, prefill_cap=100)
    decoded, admitted = s.schedule()
    assert decoded == ["bg0", "bg1"]
    assert admitted == ["bg-new0"]
    assert s.tokens == {"bg0": 1, "bg1": 1, "bg-new0": 100}
    assert s.max_num_scheduled_tokens == 2048  # restored after the step
    # bg-new0 is mid-prompt: the next step is capped too, and the rest of its
    # prompt comes first.
    s.schedule()
    assert s.tokens == {"bg0": 1, "bg1": 1, "bg-new0": 50, "bg-new1": 51}
    assert s.capped_steps == 2
    for _ in range(3):
        s.schedule()
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in s.running)
    assert len(s.running) == 5 and not s.waiting
    # Nothing left to prefill: decode steps are not capped.
    capped = s.capped_steps
    s.schedule()
    assert s.capped_steps == capped
    assert set(s.tokens.values()) == {1}


def test_where_prompts_are_not_chunked_a_capped_step_takes_whole_ones() -> None:
    waiting = [*_prompts(2, BG, 150), *_prompts(2, BG, 20, "short")]
    s = Guarded(_bg(2), waiting, mates=0, prefill_cap=100)
    s.scheduler_config.enable_chunked_prefill = False
    # The longest prompt left sets the step's room: one of 150 (no short one
    # fits beside it), then the other, then both short ones.
    assert s.schedule()[1] == ["bg-new0"]
    assert s.tokens["bg-new0"] == 150
    assert s.schedule()[1] == ["bg-new1"]
    assert s.schedule()[1] == ["short0", "short1"]
    assert s.capped_steps == 3
    assert not s.waiting


@pytest.mark.parametrize(
    ("waiting", "running"),
    [
        (_prompts(1, NORMAL, 150, "n") + _prompts(2, BG, 150), []),
        (_prompts(1, RT, 150, "rt") + _prompts(2, BG, 150), []),
        (_prompts(2, BG, 150), [Req("n", NORMAL, num_prompt_tokens=300)]),
    ],
    ids=["normal-waits", "realtime-waits", "normal-mid-prompt"],
)
def test_a_step_with_a_more_urgent_prompt_is_not_capped(
    waiting: list[Req], running: list[Req]
) -> None:
    for r in running:
        r.num_computed_tokens = 100  # mid-prompt
    s = Guarded([*_bg(2), *running], waiting, mates=None, prefill_cap=64)
    s.schedule()
    assert s.capped_steps == 0
    assert sum(s.tokens.values()) > 64 + len(s.running)


def test_beside_a_decoding_realtime_request_without_the_guard_it_caps_too() -> None:
    rt = _running(Req("rt", RT))
    s = Guarded([rt, *_bg(1)], _prompts(2, BG, 150), mates=None, prefill_cap=100)
    s.schedule()
    assert s.capped_steps == 1
    assert s.tokens == {"rt": 1, "bg0": 1, "bg-new0": 100}


def test_without_the_cap_a_burst_is_one_step() -> None:
    s = Guarded(_bg(2), _prompts(3, BG, 150), mates=0)
    _, admitted = s.schedule()
    assert admitted == ["bg-new0", "bg-new1", "bg-new2"]
    assert s.capped_steps == 0


def test_the_engine_core_gets_the_guard_over_the_scheduler_vllm_would_pick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from deployments.engine import args, scheduler

    assert issubclass(scheduler.GuardedAsyncScheduler, AsyncScheduler)
    assert issubclass(scheduler.GuardedScheduler, Scheduler)
    assert not issubclass(scheduler.GuardedScheduler, AsyncScheduler)
    # What engine_args names resolves to the factory.
    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert (
        resolve_obj_by_qualname(args.GUARDED_SCHEDULER) is scheduler.guarded_scheduler
    )
    made: list[str] = []
    for name in ("GuardedAsyncScheduler", "GuardedScheduler"):
        monkeypatch.setattr(
            scheduler,
            name,
            lambda n=name, **kw: made.append(n),  # type: ignore[misc]
        )
    for async_on in (True, False):
        config = SimpleNamespace(
            scheduler_config=SimpleNamespace(async_scheduling=async_on)
        )
        scheduler.guarded_scheduler(vllm_config=config)
    assert made == ["GuardedAsyncScheduler", "GuardedScheduler"]


@pytest.fixture
def board(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> np.memmap[Any, Any]:
    """The node's board in a scratch file, and a view of it to play the other
    engines (this process holds one slot, whichever board it opens)."""
    path = tmp_path / "board"
    monkeypatch.setattr(
        scheduler, "RealtimeBoard", lambda: realtime_board.RealtimeBoard(path)
    )
    realtime_board.RealtimeBoard(path).close()  # creates it
    return np.memmap(path, np.float64, "r+")


def _steps(s: Guarded, n: int, step_s: float) -> None:
    """``n`` engine steps of ``step_s`` each (the model's time between calls)."""
    for _ in range(n):
        s.schedule()
        time.sleep(step_s)


def test_background_alone_idles_while_another_engine_holds_realtime(
    board: np.memmap[Any, Any],
) -> None:
    s = Guarded(_bg(3), [], mates=None, cpu_yield=0.5)
    _steps(s, 3, 0.02)
    assert s.yielded_s == 0  # nobody holds realtime
    board[7] = time.monotonic()  # another engine's realtime step
    _steps(s, 1, 0.02)
    # 0.5: it idles as long as its step took (the first step after the mark
    # sleeps for the one before it); the batch is not held.
    assert 0.02 <= s.yielded_s <= MAX_STEP_S
    assert s.guarded_steps == 0
    board[7] = time.monotonic() - 1  # its realtime left a second ago
    before = s.yielded_s
    _steps(s, 3, 0.02)
    assert s.yielded_s == before


def test_idle_time_between_steps_is_not_a_step(board: np.memmap[Any, Any]) -> None:
    s = Guarded(_bg(1), [], mates=None, cpu_yield=0.8)
    s.schedule()
    time.sleep(0.3)  # the engine sat waiting for work
    board[7] = time.monotonic()
    s.schedule()
    pause = MAX_STEP_S * 0.8 / 0.2
    assert pause <= s.yielded_s < pause + 0.05


def test_a_request_for_an_idling_engine_wakes_it(
    board: np.memmap[Any, Any], tmp_path: Path
) -> None:
    s = Guarded(_bg(2), [], mates=None, cpu_yield=0.9)
    # Its frontend: this process too, so the engine's own pid names it.
    frontend = realtime_board.RealtimeBoard(tmp_path / "board", claim=False)
    board[7] = time.monotonic() + 60  # another engine holds realtime
    s.schedule()
    time.sleep(0.04)  # a step: the next call idles 9 x 40 ms
    threading.Timer(0.05, frontend.wake, (os.getpid(),)).start()
    began = time.monotonic()
    s.schedule()
    assert 0.04 < time.monotonic() - began < 0.2  # woken, not 360 ms
    # A wake since the step began (a request on its way) skips the pause.
    time.sleep(0.04)
    assert frontend.wake(os.getpid()) == 1
    before = s.yielded_s
    s.schedule()
    assert s.yielded_s == before
    frontend.close()


@pytest.mark.parametrize(
    "requests",
    [
        [Req("rt", RT), *_bg(2)],  # it holds realtime itself: it marks instead
        [Req("n", NORMAL), *_bg(2)],  # normal requests are not held
        [],  # nothing to run
    ],
    ids=["realtime", "normal", "empty"],
)
def test_an_engine_with_realtime_or_normal_work_does_not_idle(
    board: np.memmap[Any, Any], requests: list[Req]
) -> None:
    s = Guarded(requests, [], mates=None, cpu_yield=0.9)
    board[7] = time.monotonic() + 60
    _steps(s, 3, 0.01)
    assert s.yielded_s == 0
    marked = board[s._board.slot]  # type: ignore[union-attr]
    if requests and requests[0].priority == RT:
        assert time.monotonic() - 1 < marked <= time.monotonic()
    else:
        assert marked == 0


def test_a_waiting_realtime_request_marks_the_board(
    board: np.memmap[Any, Any],
) -> None:
    s = Guarded(_bg(2), [Req("rt", RT)], mates=0, cpu_yield=0.5)
    s.schedule()
    assert board[s._board.slot] > 0  # type: ignore[union-attr]
    assert s.guarded_steps == 1  # and the batch guard holds its background


def test_without_the_cpu_yield_no_board_is_opened() -> None:
    s = Guarded(_bg(2), [Req("rt", RT)], mates=0)
    assert s._board is None
