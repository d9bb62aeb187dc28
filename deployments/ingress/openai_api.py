"""OpenAI-compatible request models and response shapes (no I/O here).

Requests accept OpenAI's fields plus four extensions: ``qos``, ``deadline_ms``,
``tenant`` and ``request_id``; the first two may also come as ``X-QoS`` and
``X-Deadline-Ms`` headers (for clients that cannot add body fields), the body
winning. A field this server does not know, or a value it does not serve
(``n`` > 1, penalties, ``echo`` ...), is refused with 400 naming it, never
ignored: it would change what the client expects back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from cluster.qos import QoS
from deployments.ingress import structured, validation
from deployments.ingress.errors import Status
from deployments.protocol import (
    EngineRequest,
    Finish,
    TokenLogprob,
    ToolCallDelta,
    merge_tool_calls,
)

if TYPE_CHECKING:
    from deployments.ingress.frontend import Frontend

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Deeper bodies are refused before anything walks them recursively (json.loads
# itself gives up near 1,000 levels; pydantic, logging and the span code below
# it would at less). OpenAI requests nest a handful of levels; a JSON schema,
# tens.
MAX_JSON_DEPTH = 128
MAX_TOP_LOGPROBS = validation.MAX_TOP_LOGPROBS


def _depth_within(data: Any, limit: int) -> bool:
    """Whether ``data`` nests at most ``limit`` arrays and objects deep (walked
    without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


class _Request(BaseModel):
    # A field this server does not know is refused (400 naming it), never
    # ignored: it may change what the client expects back.
    model_config = ConfigDict(extra="forbid", strict=False)

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    response_format: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Any = None
    user: str | None = None
    qos: Literal["realtime", "normal", "background"] = "normal"
    deadline_ms: int = Field(0, ge=0)
    tenant: str = ""
    request_id: str = ""
    # What engine_request made of tools and tool_choice.
    _choice: structured.ToolChoice = PrivateAttr(structured.NO_TOOLS)

    @property
    def tool_choice_parsed(self) -> structured.ToolChoice:
        return self._choice

    def unsupported(self) -> str | None:
        if self.n != 1:
            return "n"
        if self.presence_penalty not in (None, 0):
            return "presence_penalty"
        if self.frequency_penalty not in (None, 0):
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        if self.stream_options and set(self.stream_options) - {"include_usage"}:
            return "stream_options." + sorted(set(self.stream_options))[0]
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def top_logprobs_count(self) -> int | None:
        """None: no log probabilities; k: the sampled token's and the top k."""
        raise NotImplementedError


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):
            return "best_of"
        return super().unsupported()

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # who spoke; shown to no template, so unchecked
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> str | None:
        if self.parallel_tool_calls is False:
            return "parallel_tool_calls"  # one call at most is not enforced
        return super().unsupported()

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise validation.InvalidRequest("top_logprobs", "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


def parse(model: type[BaseModel], body: bytes) -> Any:
    """Parses a JSON body into ``model``; InvalidRequest names the bad field."""
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise validation.InvalidRequest("body", "is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise validation.InvalidRequest("body", f"is not valid JSON: {e}") from None
    except RecursionError:  # ~1,000 levels of arrays or objects, anywhere
        raise validation.InvalidRequest("body", "is nested too deeply") from None
    if not isinstance(data, dict):
        raise validation.InvalidRequest("body", "must be a JSON object")
    if not _depth_within(data, MAX_JSON_DEPTH):
        raise validation.InvalidRequest(
            "body", f"is nested too deeply (more than {MAX_JSON_DEPTH} levels)"
        )
    try:
        return model.model_validate(data)
    except RecursionError:
        raise validation.InvalidRequest("body", "is nested too deeply") from None
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            raise validation.InvalidRequest(
                field, "is not supported by this server"
            ) from None
        raise validation.InvalidRequest(field, err["msg"]) from None


def qos_of(req: _Request) -> QoS:
    return QoS.parse(req.qos)


def _apply_headers(req: Any, headers: Mapping[str, str]) -> None:
    fields = req.model_fields_set
    qos = headers.get("x-qos")
    if qos is not None and "qos" not in fields:
        try:
            req.qos = QoS.parse(qos).name.lower()
        except ValueError as e:
            raise validation.InvalidRequest("X-QoS", str(e)) from None
    deadline = headers.get("x-deadline-ms")
    if deadline is not None and "deadline_ms" not in fields:
        if not deadline.strip().isdigit():
            raise validation.InvalidRequest(
                "X-Deadline-Ms",
                f"must be a whole number of milliseconds, not {deadline!r}",
            )
        req.deadline_ms = int(deadline)


def engine_request(
    body: bytes,
    kind: Literal["completion", "chat"],
    frontend: Frontend,
    headers: Mapping[str, str] | None = None,
) -> tuple[Any, EngineRequest, float | None]:
    """Validates a request body (and the QoS headers); returns it parsed, the engine
    request and the time-to-first-token deadline in seconds."""
    limits = frontend.limits
    req: Any
    req = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, body)
    _apply_headers(req, headers or {})
    if req.model != frontend.facts.name:
        raise validation.InvalidRequest(
            "model",
            f"unknown model {req.model!r}; this server serves {frontend.facts.name!r}",
        )
    bad = req.unsupported()
    if bad:
        raise validation.InvalidRequest(bad, "is not supported by this server")
    constraint = None
    if req.response_format is not None:
        constraint = structured.response_format(req.response_format)
    choice = structured.NO_TOOLS
    tools: tuple[structured.Tool, ...] = ()
    if kind == "chat":
        tools = structured.tools(req.tools)
        choice = structured.tool_choice(req.tool_choice, tools)
        structured.check_parsable(choice, frontend.parses_tool_calls, "tool_choice")
        ids, field = _chat_prompt(req, frontend, tools), "messages"
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        ids, field = _completion_prompt(req, frontend), "prompt"
        max_tokens = req.max_tokens
        if max_tokens is None:
            room = limits.max_model_len - len(ids)
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, max(room, 1))
    validation.prompt_fits(len(ids), limits, field)
    sampling = validation.sampling(
        prompt_tokens=len(ids),
        limits=limits,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=req.top_logprobs_count(),
    )
    engine_req = EngineRequest(
        validation.request_id(req.request_id),
        tuple(ids),
        sampling,
        qos_of(req),
        validation.tenant(req.tenant),
    )
    engine_req = structured.with_tools(
        engine_req, constraint, choice, tools, "response_format"
    )
    req._choice = choice
    return req, engine_req, (req.deadline_ms / 1000 if req.deadline_ms else None)


def _chat_prompt(
    req: ChatCompletionRequest,
    frontend: Frontend,
    tools: tuple[structured.Tool, ...] = (),
) -> list[int]:
    turns = [
        structured.ChatTurn(
            "system" if m.role == "developer" else m.role,
            m.text(),
            tuple(
                (c.id, c.function.name, c.function.arguments)
                for c in m.tool_calls or ()
            ),
            m.tool_call_id or "",
        )
        for m in req.messages
    ]
    messages = structured.chat_messages(turns, frontend.limits, "messages")
    rendered = [t.openai() for t in tools] or None
    return frontend.encode_chat(messages, "messages", rendered)


def _completion_prompt(req: CompletionRequest, frontend: Frontend) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        raise validation.InvalidRequest("prompt", "one prompt per request")
    if isinstance(prompt, str):
        validation.prompt_text(prompt, frontend.limits, "prompt")
        ids = frontend.encode_text(prompt)
    else:
        ids = list(validation.token_ids(prompt, frontend.limits, "prompt"))  # type: ignore[arg-type]
    if not ids:
        raise validation.InvalidRequest("prompt", "tokenizes to no tokens")
    return ids


def error_body(status: Status, message: str, param: str | None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": status.openai_type,
            "param": param,
            "code": status.http_status,
        }
    }


def usage(f: Finish) -> dict[str, Any]:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
        # moe-cluster's: times the stream moved to another replica.
        "migrations": f.migrations,
    }


class ResponseShape:
    """Builds completion or chat-completion JSON objects for one request."""

    def __init__(self, kind: Literal["completion", "chat"], rid: str, model: str):
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + rid
        self.model = model
        self.created = int(time.time())
        self._offset = 0  # characters of completion text so far (text_offset)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (chat or completion form)."""
        if not entries:
            return None
        if self.chat:
            return {
                "content": [
                    _chat_logprob(e.text, e.logprob)
                    | {"top_logprobs": [_chat_logprob(t, lp) for _, t, lp in e.top]}
                    for e in entries
                ]
            }
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.text)
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for _, t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def chunk(
        self,
        text: str,
        finish: str | None = None,
        calls: Sequence[ToolCallDelta] = (),
        logprobs: Sequence[TokenLogprob] = (),
    ) -> dict[str, Any]:
        lp = self.logprobs(logprobs)
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [_call_delta(c) for c in calls]
            choice = {"index": 0, "delta": delta, "logprobs": lp}
            choice["finish_reason"] = finish
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def role_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        return self._envelope(
            "chat.completion.chunk", [choice | {"finish_reason": None}]
        )

    def usage_chunk(self, f: Finish) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, []) | {"usage": usage(f)}

    def full(
        self,
        text: str,
        f: Finish,
        calls: Sequence[ToolCallDelta] = (),
        logprobs: Sequence[TokenLogprob] = (),
    ) -> dict[str, Any]:
        lp = self.logprobs(logprobs)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["content"] = text or None
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in merge_tool_calls(calls)
                ]
            choice = {"index": 0, "message": message, "logprobs": lp}
            choice["finish_reason"] = f.reason
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": lp}
            body = self._envelope(
                "text_completion", [choice | {"finish_reason": f.reason}]
            )
        return body | {"usage": usage(f)}


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def _call_delta(c: ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": c.index}
    if c.id:
        out |= {"id": c.id, "type": "function"}
    fn: dict[str, Any] = {"arguments": c.arguments}
    if c.name:
        fn["name"] = c.name
    return out | {"function": fn}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
