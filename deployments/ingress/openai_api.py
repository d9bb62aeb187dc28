"""OpenAI-compatible request models and response shapes (no I/O here).

Requests accept OpenAI's fields plus three extensions: ``qos``, ``deadline_ms``
and ``tenant``; the first two may also come as ``X-QoS`` and ``X-Deadline-Ms``
headers (for clients that cannot add body fields), the body winning. Fields that
would change the meaning of the answer and are not implemented (``n`` > 1,
``logprobs``, ``echo``, ``tools`` ...) are rejected with 400 rather than ignored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.qos import QoS
from deployments.ingress import validation
from deployments.ingress.errors import Status
from deployments.protocol import EngineRequest, Finish

if TYPE_CHECKING:
    from deployments.ingress.frontend import Frontend

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Deeper bodies are refused before anything walks them recursively (json.loads
# itself gives up near 1,000 levels; pydantic, logging and the span code below
# it would at less). OpenAI requests nest a handful of levels; a JSON schema,
# tens.
MAX_JSON_DEPTH = 128


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
    # Unknown fields are ignored as OpenAI clients send many optional ones.
    model_config = ConfigDict(extra="ignore", strict=False)

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
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Any = None
    user: str | None = None
    qos: Literal["realtime", "normal", "background"] = "normal"
    deadline_ms: int = Field(0, ge=0)
    tenant: str = ""
    request_id: str = ""

    def unsupported(self) -> str | None:
        if self.n != 1:
            return "n"
        if self.logprobs not in (None, False, 0):
            return "logprobs"
        if self.top_logprobs not in (None, 0):
            return "top_logprobs"
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none"):
            return "tool_choice"
        if self.functions or self.function_call not in (None, "none"):
            return "functions" if self.functions else "function_call"
        fmt = self.response_format
        if fmt is not None and not (
            isinstance(fmt, dict) and fmt.get("type") == "text"
        ):
            return "response_format"  # constrained output is not served: say so
        if self.presence_penalty not in (None, 0):
            return "presence_penalty"
        if self.frequency_penalty not in (None, 0):
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):
            return "best_of"
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


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
    if kind == "chat":
        ids, field = _chat_prompt(req, frontend), "messages"
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
    )
    engine_req = EngineRequest(
        validation.request_id(req.request_id),
        tuple(ids),
        sampling,
        qos_of(req),
        validation.tenant(req.tenant),
    )
    return req, engine_req, (req.deadline_ms / 1000 if req.deadline_ms else None)


def _chat_prompt(req: ChatCompletionRequest, frontend: Frontend) -> list[int]:
    limits = frontend.limits
    messages = [m.model_dump() for m in req.messages]
    for i, m in enumerate(messages):
        # Empty turns are fine; their text is checked like any prompt's.
        validation.prompt_text(m["content"] or " ", limits, f"messages[{i}].content")
    size = sum(len(m["content"].encode("utf-8")) for m in messages)
    if size > limits.max_prompt_bytes:
        raise validation.InvalidRequest(
            "messages", f"are {size} bytes; the limit is {limits.max_prompt_bytes}"
        )
    return frontend.encode_chat(messages, "messages")


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

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, text: str, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def role_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        return self._envelope(
            "chat.completion.chunk", [choice | {"finish_reason": None}]
        )

    def usage_chunk(self, f: Finish) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, []) | {"usage": usage(f)}

    def full(self, text: str, f: Finish) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": f.reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            body = self._envelope(
                "text_completion", [choice | {"finish_reason": f.reason}]
            )
        return body | {"usage": usage(f)}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
