"""Tool calls parsed out of an engine's output with vLLM's own tool parsers
(``deepseek_v3`` for DeepSeek's tool-call tokens), in the engine replica, where
vLLM is loaded already: the ingress never imports vLLM.

``ToolCallStream`` feeds each engine step to the parser's streaming entry point,
as vLLM's OpenAI server does, and at the end checks the streamed calls against
the parser's reading of the whole output, sending what streaming left out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from deployments.protocol import ToolCallDelta

DEEPSEEK_V3 = "deepseek_v3"


class ToolCallStream:
    def __init__(self, parser: str, tools_json: str, tokenizer: Any) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
        )
        from vllm.tool_parsers import ToolParserManager

        cls = ToolParserManager.get_tool_parser(parser)
        self._request = ChatCompletionRequest(
            model="-",
            messages=[],
            tools=json.loads(tools_json),
            tool_choice="auto",
        )
        self._parser = cls(tokenizer, self._request.tools)  # type: ignore[arg-type]
        self._text = ""
        self._ids: list[int] = []
        self._streamed: dict[int, str] = {}  # index -> arguments sent

    @property
    def called(self) -> bool:
        """Whether the output holds a tool call (so far)."""
        return bool(self._streamed)

    def feed(
        self, token_ids: Sequence[int], text: str
    ) -> tuple[str, tuple[ToolCallDelta, ...]]:
        """One engine step's output: the content outside tool calls, and the
        tool-call pieces it completes."""
        previous_text, previous_ids = self._text, list(self._ids)
        self._text += text
        self._ids += token_ids
        msg = self._parser.extract_tool_calls_streaming(
            previous_text,
            self._text,
            text,
            previous_ids,
            self._ids,
            list(token_ids),
            self._request,
        )
        if msg is None:
            return "", ()
        calls = []
        for c in msg.tool_calls or ():
            fn = c.function
            name = (fn.name if fn else None) or ""
            args = (fn.arguments if fn else None) or ""
            if c.index not in self._streamed:
                self._streamed[c.index] = ""
            self._streamed[c.index] += args
            calls.append(ToolCallDelta(c.index, c.id or "", name, args))
        return msg.content or "", tuple(calls)

    def finish(self) -> tuple[ToolCallDelta, ...]:
        """The arguments streaming left out (the parser streams a call's last
        piece only when a later token shows where its arguments end)."""
        whole = self._parser.extract_tool_calls(self._text, self._request)
        rest = []
        for i, call in enumerate(whole.tool_calls):
            sent = self._streamed.get(i)
            args = call.function.arguments or ""
            if sent is None:  # a call streaming never announced
                rest.append(ToolCallDelta(i, call.id, call.function.name, args))
                self._streamed[i] = args
            elif args.startswith(sent) and len(args) > len(sent):
                rest.append(ToolCallDelta(i, arguments=args[len(sent) :]))
                self._streamed[i] = args
        return tuple(rest)
