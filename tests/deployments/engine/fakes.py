"""A scripted stand-in for vLLM's ``AsyncLLM``: the calls ``VLLMEngine`` makes,
answered from a script, so the adapter and the deployment run without vLLM
engines (vLLM's own types, such as ``SamplingParams``, are real)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


@dataclass
class Step:
    """One ``RequestOutput`` delta: new tokens and text, and whether it finishes."""

    tokens: list[int]
    text: str = ""
    finish: str | None = None  # vLLM's finish reason on the last step
    cached: int = 0


@dataclass
class FakeAsyncLLM:
    steps: list[Step] = field(default_factory=list)
    fail_after: int | None = None  # raise this exception after that many steps
    failure: BaseException | None = None
    hold: asyncio.Event | None = None  # when set, streams wait on it after step 1
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    trace_headers: list[Any] = field(default_factory=list)  # per generate call
    aborted: list[str] = field(default_factory=list)
    unfinished: int = 0
    shut_down: bool = False
    block_size: int = 16

    @property
    def vllm_config(self) -> Any:
        return SimpleNamespace(
            cache_config=SimpleNamespace(
                block_size=self.block_size, enable_prefix_caching=False
            ),
            model_config=SimpleNamespace(dtype="torch.float32"),
        )

    async def generate(
        self,
        prompt: Any,
        params: Any,
        request_id: str,
        priority: int = 0,
        trace_headers: Any = None,
    ) -> AsyncIterator[Any]:
        self.calls.append((prompt, params, request_id, priority))
        self.trace_headers.append(trace_headers)
        self.unfinished += 1
        try:
            for i, step in enumerate(self.steps):
                if self.fail_after is not None and i == self.fail_after:
                    assert self.failure is not None
                    raise self.failure
                if i == 1 and self.hold is not None:
                    await self.hold.wait()
                if request_id in self.aborted:  # vLLM delivers a last output
                    seq = SimpleNamespace(token_ids=[], text="", finish_reason="abort")
                    yield SimpleNamespace(
                        outputs=[seq], finished=True, num_cached_tokens=0
                    )
                    return
                seq = SimpleNamespace(
                    token_ids=step.tokens, text=step.text, finish_reason=step.finish
                )
                yield SimpleNamespace(
                    outputs=[seq],
                    finished=step.finish is not None,
                    num_cached_tokens=step.cached,
                )
        finally:
            self.unfinished -= 1

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else request_id
        self.aborted.extend(ids)
        if self.hold is not None:  # a held stream gets its abort output
            self.hold.set()

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished

    async def check_health(self) -> None:
        return None

    async def collective_rpc(self, method: str) -> list[Any]:
        self.calls.append(("collective_rpc", method))
        if method == "moe_expert_load_install":
            return [((1, 2), 4)]
        return [[[1, 0, 0, 3], [0, 2, 2, 0]]]

    def shutdown(self) -> None:
        self.shut_down = True
