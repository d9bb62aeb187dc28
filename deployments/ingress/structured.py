"""Output constraints (structured outputs) and tool definitions, checked in the
ingress before any engine time is spent, and the tool-call shaping of a
response whose tool choice a constraint enforces.

A JSON schema is checked against its meta-schema here (``jsonschema``); the
engine's grammar backend (xgrammar) compiles it again when the request arrives,
before it is scheduled, and refuses what it cannot enforce: that refusal, too,
is INVALID_ARGUMENT / 400 naming the field (``Structured.field``).

Tool choice:
- ``auto``: the engine parses DeepSeek's tool-call tokens out of the output
  with vLLM's ``deepseek_v3`` parser (``deployments.engine.tools``);
- a named function: the output is constrained to that function's parameter
  schema, and is the call's arguments;
- ``required``: the output is constrained to a JSON array of
  ``{"name", "parameters"}`` objects, one per call (vLLM's own format);
- ``none``: tools are shown to the model, calls are not parsed.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from deployments.ingress.validation import InvalidRequest, Limits, prompt_text, utf8
from deployments.protocol import (
    EngineEvent,
    EngineRequest,
    Finish,
    Structured,
    TokenDelta,
    ToolCallDelta,
)

MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema, regex or grammar, as JSON text
MAX_CHOICES = 256
MAX_TOOLS = 128
TOOL_PARSER = "deepseek_v3"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"  # DeepSeek's, which TOOL_PARSER reads
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule


def _sized(text: str, field: str) -> str:
    utf8(text, field)
    if "\x00" in text:
        raise InvalidRequest(field, "must not contain a NUL character")
    size = len(text.encode("utf-8"))
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidRequest(
            field, f"is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}"
        )
    return text


def check_schema(schema: Any, field: str) -> dict[str, Any]:
    """``schema`` must be a JSON object that is a valid JSON Schema."""
    from jsonschema import exceptions, validators

    if not isinstance(schema, dict):
        raise InvalidRequest(field, "must be a JSON Schema object")
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        at = f" at {where!r}" if where else ""
        message = f"is not a valid JSON Schema{at}: {e.message}"
        raise InvalidRequest(field, message) from None
    except Exception as e:  # a $ref or format the checker cannot resolve
        raise InvalidRequest(field, f"is not a valid JSON Schema: {e}") from None
    return schema


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's strict mode: objects admit no properties their schema does not
    name (``additionalProperties: false`` wherever it is not set)."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "object" or "properties" in node:
                node.setdefault("additionalProperties", False)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def json_schema(schema: Any, field: str, strict: bool = False) -> Structured:
    checked = check_schema(schema, field)
    if strict:
        checked = strict_schema(checked)
    text = json.dumps(checked, ensure_ascii=False)
    return Structured("json", _sized(text, field), field=field)


def json_object(field: str) -> Structured:
    return Structured("json_object", field=field)


def regex(pattern: str, field: str) -> Structured:
    if not pattern:
        raise InvalidRequest(field, "must not be empty")
    return Structured("regex", _sized(pattern, field), field=field)


def grammar(ebnf: str, field: str) -> Structured:
    if not ebnf.strip():
        raise InvalidRequest(field, "must not be empty")
    return Structured("grammar", _sized(ebnf, field), field=field)


def choice(choices: Sequence[str], field: str) -> Structured:
    if not choices:
        raise InvalidRequest(field, "must list at least one choice")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest(field, f"at most {MAX_CHOICES} choices")
    for i, c in enumerate(choices):
        if not c:
            raise InvalidRequest(f"{field}[{i}]", "must not be empty")
    _sized(json.dumps(list(choices), ensure_ascii=False), field)
    return Structured("choice", choices=tuple(choices), field=field)


def response_format(value: Any, field: str = "response_format") -> Structured | None:
    """OpenAI's ``response_format``: text (no constraint), json_object or
    json_schema (``{"name", "schema", "strict"?, "description"?}``)."""
    if not isinstance(value, dict):
        raise InvalidRequest(field, "must be an object with a 'type'")
    kind = value.get("type")
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise InvalidRequest(f"{field}.{sorted(extra)[0]}", "is not supported")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object(field)
    if kind != "json_schema":
        raise InvalidRequest(
            f"{field}.type",
            f"must be text, json_object or json_schema, not {kind!r}",
        )
    spec = value.get("json_schema")
    where = f"{field}.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequest(where, "must be an object with 'name' and 'schema'")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise InvalidRequest(f"{where}.{sorted(unknown)[0]}", "is not supported")
    name = spec.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise InvalidRequest(
            f"{where}.name", "must be 1-64 letters, digits, '_' or '-'"
        )
    strict = spec.get("strict")
    if strict not in (None, True, False):
        raise InvalidRequest(f"{where}.strict", "must be a boolean")
    if "schema" not in spec:
        raise InvalidRequest(f"{where}.schema", "is required")
    return json_schema(spec["schema"], f"{where}.schema", bool(strict))


# -- chat turns ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One message of a chat, as either protocol spells it."""

    role: str  # system, user, assistant or tool
    text: str
    tool_calls: tuple[tuple[str, str, str], ...] = ()  # an assistant's (id, name, args)
    tool_call_id: str = ""  # the call a tool message answers


def chat_messages(
    turns: Sequence[ChatTurn], limits: Limits, field: str
) -> list[dict[str, Any]]:
    """The chat template's messages: each turn's text checked like a prompt's
    (empty turns are fine), tool calls on assistant turns only, every tool result
    naming its call, and the whole within ``limits.max_prompt_bytes``."""
    messages: list[dict[str, Any]] = []
    size = 0
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        prompt_text(turn.text or " ", limits, f"{where}.content")
        size += len(turn.text.encode("utf-8"))
        message: dict[str, Any] = {"role": turn.role, "content": turn.text}
        if turn.tool_calls:
            if turn.role != "assistant":
                raise InvalidRequest(
                    f"{where}.tool_calls", "only an assistant message has them"
                )
            for j, (_, _, args) in enumerate(turn.tool_calls):
                utf8(args, f"{where}.tool_calls[{j}].arguments")
                size += len(args.encode("utf-8"))
            message["tool_calls"] = [
                {
                    "id": cid,
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
                for cid, name, args in turn.tool_calls
            ]
        if turn.role == "tool" and not turn.tool_call_id:
            raise InvalidRequest(f"{where}.tool_call_id", "is required")
        messages.append(message)
    if size > limits.max_prompt_bytes:
        raise InvalidRequest(
            field, f"are {size} bytes; the limit is {limits.max_prompt_bytes}"
        )
    return messages


# -- tools ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str = ""


NO_TOOLS = ToolChoice("none")


def tool(value: Any, field: str) -> Tool:
    if not isinstance(value, dict) or value.get("type") != "function":
        raise InvalidRequest(f"{field}.type", "must be 'function'")
    if set(value) - {"type", "function"}:
        extra = sorted(set(value) - {"type", "function"})[0]
        raise InvalidRequest(f"{field}.{extra}", "is not supported")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequest(f"{field}.function", "must be an object")
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise InvalidRequest(
            f"{field}.function.{sorted(unknown)[0]}", "is not supported"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise InvalidRequest(
            f"{field}.function.name", "must be 1-64 letters, digits, '_' or '-'"
        )
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequest(f"{field}.function.description", "must be a string")
    utf8(description, f"{field}.function.description")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    check_schema(params, f"{field}.function.parameters")
    if fn.get("strict"):
        params = strict_schema(params)
    return Tool(name, description, params)


def tools(value: Any, field: str = "tools") -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest(field, "must be a list of tools")
    if len(value) > MAX_TOOLS:
        raise InvalidRequest(field, f"at most {MAX_TOOLS} tools")
    parsed = tuple(tool(t, f"{field}[{i}]") for i, t in enumerate(value))
    names = [t.name for t in parsed]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(f"{field}[{i}].function.name", f"{name!r} twice")
    return parsed


def tool_choice(
    value: Any, defined: Sequence[Tool], field: str = "tool_choice"
) -> ToolChoice:
    """OpenAI's ``tool_choice``; unset is ``auto`` with tools, ``none`` without."""
    if value is None:
        return ToolChoice("auto") if defined else NO_TOOLS
    if value in ("none", "auto", "required"):
        if value != "none" and not defined:
            raise InvalidRequest(field, f"is {value!r} but no tools are given")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest(f"{field}.function.name", "is required")
        if name not in {t.name for t in defined}:
            raise InvalidRequest(
                f"{field}.function.name", f"{name!r} is not one of the tools"
            )
        return ToolChoice("named", name)
    raise InvalidRequest(
        field, "must be 'none', 'auto', 'required' or {'type': 'function', ...}"
    )


def check_parsable(choice: ToolChoice, parses_tool_calls: bool, field: str) -> None:
    """``auto`` needs the model's tokenizer to have DeepSeek's tool-call tokens."""
    if choice.mode == "auto" and not parses_tool_calls:
        raise InvalidRequest(
            field,
            "tool_choice auto needs DeepSeek's tool-call tokens, which this model's "
            "tokenizer lacks: name a function or use 'required'",
        )


def constraint_for(choice: ToolChoice, defined: Sequence[Tool]) -> Structured | None:
    """The output constraint that enforces a named or required tool choice."""
    if choice.mode == "named":
        [fn] = [t for t in defined if t.name == choice.name]
        text = json.dumps(fn.parameters, ensure_ascii=False)
        return Structured("json", _sized(text, "tools"), field="tools")
    if choice.mode == "required":
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [
                    {
                        "properties": {
                            "name": {"type": "string", "enum": [t.name]},
                            "parameters": t.parameters,
                        },
                        "required": ["name", "parameters"],
                    }
                    for t in defined
                ],
            },
        }
        text = json.dumps(schema, ensure_ascii=False)
        return Structured("json", _sized(text, "tools"), field="tools")
    return None


def with_tools(
    request: EngineRequest,
    constraint: Structured | None,
    choice: ToolChoice,
    defined: Sequence[Tool],
    constraint_field: str,
) -> EngineRequest:
    """``request`` with its output constraint (the client's, or the one a named
    or required tool choice forces: not both) and, for ``auto``, the engine's
    tool parser and the tools it parses for."""
    if (forced := constraint_for(choice, defined)) is not None:
        if constraint is not None:
            raise InvalidRequest(
                constraint_field,
                f"cannot be combined with tool_choice {choice.mode!r}",
            )
        constraint = forced
    request = replace(
        request, sampling=replace(request.sampling, structured=constraint)
    )
    if choice.mode != "auto":
        return request
    return replace(
        request,
        tool_parser=TOOL_PARSER,
        tools_json=json.dumps([t.openai() for t in defined]),
    )


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def shape_calls(
    events: AsyncGenerator[EngineEvent, None], choice: ToolChoice
) -> AsyncGenerator[EngineEvent, None]:
    """A named or required tool choice's events with its output read as tool
    calls: a named call streams its arguments as they come; ``required`` calls
    come whole, parsed from the finished JSON array. A response that holds
    calls finishes with ``tool_calls``. Other events pass as they are."""
    if choice.mode not in ("named", "required"):
        return events
    return _shaped(events, choice)


async def _shaped(
    events: AsyncGenerator[EngineEvent, None], choice: ToolChoice
) -> AsyncGenerator[EngineEvent, None]:
    named = choice.mode == "named"
    cid = call_id()
    text: list[str] = []  # required: the call list, parsed at the end
    announced = False  # named: the call's id and name went with its first piece
    try:
        async for event in events:
            if isinstance(event, TokenDelta):
                if named and event.text:
                    head = ("", "") if announced else (cid, choice.name)
                    piece = ToolCallDelta(0, *head, event.text)
                    announced = True
                    event = replace(event, text="", tool_calls=(piece,))
                else:
                    text.append(event.text)
                    event = replace(event, text="")
            elif isinstance(event, Finish):
                if named:
                    if announced and event.reason == "stop":
                        event = replace(event, reason="tool_calls")
                else:
                    whole = "".join(text)
                    calls = _required_calls(whole)
                    if calls:
                        yield TokenDelta((), "", tool_calls=calls)
                        if event.reason == "stop":
                            event = replace(event, reason="tool_calls")
                    elif whole:  # cut short (length, abort): what came, as content
                        yield TokenDelta((), whole)
            yield event
    finally:
        await events.aclose()  # the stream leaves the in-flight table now


def _required_calls(text: str) -> tuple[ToolCallDelta, ...]:
    try:
        calls = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(calls, list):
        return ()
    out = []
    for i, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return ()
        args = json.dumps(c.get("parameters", {}), ensure_ascii=False)
        out.append(ToolCallDelta(i, call_id(), c["name"], args))
    return tuple(out)
