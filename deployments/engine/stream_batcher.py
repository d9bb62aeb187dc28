"""Coalesces an engine's per-step token deltas into fewer stream messages.

Each message crosses Ray twice (engine replica -> ingress -> proxy); at high
concurrency one message per token per request costs more CPU than the model on
small machines. The first delta goes out at once (TTFT is untouched), and so does
the first one that shows the client something: a token that ends inside a
multi-byte character decodes to no text until the next one completes it, and an
OpenAI client sees its first output only then. Later ones are held until
``interval_s`` has passed since the last message, and the last one goes out with
the finish. No timer: a held delta leaves with the next engine step
that crosses the interval, so it waits at most one step longer than the interval.
"""

from __future__ import annotations

from deployments.protocol import (
    TokenDelta,
    TokenLogprob,
    ToolCallDelta,
    merge_tool_calls,
)


class DeltaBatcher:
    def __init__(self, interval_s: float) -> None:
        if interval_s < 0:
            raise ValueError("interval_s must be >= 0")
        self._interval_s = interval_s
        self._ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._calls: list[ToolCallDelta] = []
        self._last_sent: float | None = None
        self._shown = False  # whether a message carried text or a tool call

    def add(
        self,
        token_ids: list[int],
        text: str,
        now: float,
        logprobs: tuple[TokenLogprob, ...] = (),
        tool_calls: tuple[ToolCallDelta, ...] = (),
    ) -> TokenDelta | None:
        """Adds one engine step's delta; returns a message when one is due."""
        self._ids += token_ids
        self._text.append(text)
        self._logprobs += logprobs
        self._calls += tool_calls
        due = (
            self._last_sent is None
            or (not self._shown and bool(text or tool_calls))
            or now - self._last_sent >= self._interval_s
        )
        return self._take(now) if due and self._ids else None

    def flush(self, now: float) -> TokenDelta | None:
        """Whatever is held (call before the finish)."""
        return self._take(now) if self._ids else None

    def _take(self, now: float) -> TokenDelta:
        delta = TokenDelta(
            tuple(self._ids),
            "".join(self._text),
            tuple(self._logprobs),
            merge_tool_calls(self._calls),
        )
        self._shown = self._shown or bool(delta.text or delta.tool_calls)
        self._ids, self._text, self._logprobs, self._calls = [], [], [], []
        self._last_sent = now
        return delta
