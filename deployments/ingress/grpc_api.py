"""gRPC adapter: ``moecluster.v1.Inference`` messages ↔ the engine contract.

``add_inference_servicer`` replaces the generated registration so that a request
protobuf cannot parse (invalid UTF-8 in a string field, truncated bytes) reaches
the ingress as a ``MalformedRequest`` naming the field, and is answered with
INVALID_ARGUMENT instead of gRPC's opaque "Exception deserializing request".
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError, Message

from cluster.qos import QoS
from deployments.ingress import structured, validation
from deployments.ingress.frontend import Frontend, ModelFacts
from deployments.proto import inference_pb2 as pb
from deployments.proto.inference_pb2_grpc import add_InferenceServicer_to_server
from deployments.protocol import (
    EngineRequest,
    Finish,
    Structured,
    TokenDelta,
    ToolCallDelta,
    merge_tool_calls,
)

SERVICE = "moecluster.v1.Inference"
QOS_OF_PROTO = {
    pb.QOS_UNSPECIFIED: QoS.NORMAL,
    pb.REALTIME: QoS.REALTIME,
    pb.NORMAL: QoS.NORMAL,
    pb.BACKGROUND: QoS.BACKGROUND,
}


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """Stands in for a request message that did not parse."""

    message: str


def add_inference_servicer(servicer: Any, server: Any) -> None:
    """Drop-in for ``add_InferenceServicer_to_server`` with checked parsing."""
    table = _MethodTable()
    add_InferenceServicer_to_server(servicer, table)
    for service, handlers in table.services.items():
        checked = {name: _checked(h) for name, h in handlers.items()}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, checked),)
        )
        server.add_registered_method_handlers(service, checked)


class _MethodTable:
    """Records what generated code registers, to register it again, checked."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers arrive by name below

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self.services[service] = dict(handlers)


def _checked(handler: Any) -> Any:
    parse = handler.request_deserializer
    cls = getattr(parse, "__self__", None)
    if cls is None or not hasattr(cls, "DESCRIPTOR"):
        return handler
    return handler._replace(request_deserializer=_parser(cls))


def _parser(cls: type[Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError:
            return MalformedRequest(_explain(cls.DESCRIPTOR, data))

    return parse


def _explain(desc: Descriptor, data: bytes) -> str:
    name = desc.full_name
    try:
        twin = _bytes_twin(desc).FromString(data)
    except DecodeError:
        return f"request is not a valid {name} message"
    bad = _first_invalid_utf8(twin)
    if bad is None:
        return f"request is not a valid {name} message"
    return f"field {bad} is not valid UTF-8"


@cache
def _bytes_twin(desc: Descriptor) -> type[Message]:
    """The message class of ``desc`` with every string field read as bytes."""
    fdp = descriptor_pb2.FileDescriptorProto()
    desc.file.CopyToProto(fdp)
    for msg in fdp.message_type:
        for f in msg.field:
            if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(desc.full_name))


def _first_invalid_utf8(msg: Message, prefix: str = "") -> str | None:
    for field, value in msg.ListFields():
        path = prefix + field.name
        is_repeated = field.is_repeated
        items = list(value) if is_repeated else [value]
        for i, item in enumerate(items):
            where = f"{path}[{i}]" if is_repeated else path
            if isinstance(item, bytes):
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return where
            elif isinstance(item, Message):
                found = _first_invalid_utf8(item, where + ".")
                if found:
                    return found
    return None


TOOL_MODES = {
    pb.TOOL_CHOICE_NONE: "none",
    pb.TOOL_CHOICE_AUTO: "auto",
    pb.TOOL_CHOICE_REQUIRED: "required",
}
CHAT_ROLES = ("system", "user", "assistant", "tool")


def engine_request(
    req: pb.GenerateRequest, frontend: Frontend
) -> tuple[EngineRequest, float | None, structured.ToolChoice]:
    """Validates a GenerateRequest; returns the engine request, its TTFT
    deadline and its tool choice."""
    limits = frontend.limits
    rid = validation.request_id(req.request_id)
    tenant = validation.tenant(req.tenant)
    kind = req.WhichOneof("input")
    tools = structured.tools(
        [_tool_json(t, f"tools[{i}]") for i, t in enumerate(req.tools)] or None
    )
    choice = structured.tool_choice(_tool_choice(req, tools), tools)
    structured.check_parsable(choice, frontend.parses_tool_calls, "tool_mode")
    if tools and kind != "chat":
        raise validation.InvalidRequest("tools", "need chat input")
    if kind == "text":
        validation.prompt_text(req.text, limits, "text")
        ids = tuple(frontend.encode_text(req.text))
        if not ids:
            raise validation.InvalidRequest("text", "tokenizes to no tokens")
        field = "text"
    elif kind == "token_ids":
        ids = validation.token_ids(req.token_ids.ids, limits, "token_ids.ids")
        field = "token_ids"
    elif kind == "chat":
        ids = tuple(_chat_prompt(req.chat, frontend, tools))
        field = "chat"
    else:
        raise validation.InvalidRequest("input", "set one of text, token_ids or chat")
    validation.prompt_fits(len(ids), limits, field)
    if req.qos not in QOS_OF_PROTO:
        raise validation.InvalidRequest("qos", f"unknown QoS value {req.qos}")
    s = req.sampling

    def opt(name: str) -> Any:
        return getattr(s, name) if s.HasField(name) else None

    sampling = validation.sampling(
        prompt_tokens=len(ids),
        limits=limits,
        max_tokens=opt("max_tokens"),
        temperature=opt("temperature"),
        top_p=opt("top_p"),
        top_k=opt("top_k"),
        seed=opt("seed"),
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=opt("logprobs"),
        prefix="sampling.",
    )
    constraint = _structured(s) if s.HasField("structured") else None
    request = structured.with_tools(
        EngineRequest(rid, ids, sampling, QOS_OF_PROTO[req.qos], tenant),
        constraint,
        choice,
        tools,
        "sampling.structured",
    )
    deadline = req.deadline_ms / 1000 if req.deadline_ms else None
    return request, deadline, choice


def _tool_json(t: pb.Tool, field: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name, "description": t.description}
    if t.parameters_json:
        try:
            fn["parameters"] = json.loads(t.parameters_json)
        except ValueError as e:
            raise validation.InvalidRequest(
                f"{field}.parameters_json", f"is not valid JSON: {e}"
            ) from None
    if t.strict:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def _tool_choice(req: pb.GenerateRequest, tools: tuple[structured.Tool, ...]) -> Any:
    which = req.WhichOneof("tool_choice")
    if which == "tool_function":
        if req.tool_function not in {t.name for t in tools}:
            raise validation.InvalidRequest(
                "tool_function", f"{req.tool_function!r} is not one of the tools"
            )
        return {"type": "function", "function": {"name": req.tool_function}}
    if which == "tool_mode" and req.tool_mode != pb.TOOL_CHOICE_UNSPECIFIED:
        if req.tool_mode not in TOOL_MODES:
            raise validation.InvalidRequest(
                "tool_mode", f"unknown tool choice mode {req.tool_mode}"
            )
        return TOOL_MODES[req.tool_mode]
    return None


def _structured(s: pb.SamplingParams) -> Structured:
    c = s.structured
    field = "sampling.structured"
    kind = c.WhichOneof("kind")
    if kind == "json_schema":
        where = f"{field}.json_schema"
        try:
            schema = json.loads(c.json_schema)
        except ValueError as e:
            raise validation.InvalidRequest(where, f"is not valid JSON: {e}") from None
        return structured.json_schema(schema, where, c.strict)
    if c.strict:
        raise validation.InvalidRequest(f"{field}.strict", "applies to json_schema")
    if kind == "regex":
        return structured.regex(c.regex, f"{field}.regex")
    if kind == "grammar":
        return structured.grammar(c.grammar, f"{field}.grammar")
    if kind == "choice":
        return structured.choice(list(c.choice.choices), f"{field}.choice.choices")
    if kind == "json_object":
        if not c.json_object:
            raise validation.InvalidRequest(f"{field}.json_object", "must be true")
        return structured.json_object(f"{field}.json_object")
    raise validation.InvalidRequest(field, "set one kind of constraint")


def _chat_prompt(
    chat: pb.Chat, frontend: Frontend, tools: tuple[structured.Tool, ...]
) -> list[int]:
    if not chat.messages:
        raise validation.InvalidRequest("chat.messages", "must not be empty")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise validation.InvalidRequest(
                f"chat.messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}"
            )
    turns = [
        structured.ChatTurn(
            m.role,
            m.content,
            tuple((c.id, c.name, c.arguments) for c in m.tool_calls),
            m.tool_call_id,
        )
        for m in chat.messages
    ]
    messages = structured.chat_messages(turns, frontend.limits, "chat.messages")
    rendered = [t.openai() for t in tools] or None
    return frontend.encode_chat(messages, "chat.messages", rendered)


def chunk_message(rid: str, delta: TokenDelta) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=rid,
        chunk=pb.Chunk(
            token_ids=delta.token_ids,
            text=delta.text,
            logprobs=[
                pb.TokenLogprob(
                    token_id=lp.token_id,
                    token=lp.text,
                    logprob=lp.logprob,
                    rank=lp.rank,
                    top=[
                        pb.TopLogprob(token_id=t, token=text, logprob=v)
                        for t, text, v in lp.top
                    ],
                )
                for lp in delta.logprobs
            ],
            tool_calls=[
                pb.ToolCallDelta(
                    index=c.index, id=c.id, name=c.name, arguments=c.arguments
                )
                for c in delta.tool_calls
            ],
        ),
    )


def finished_message(
    rid: str, f: Finish, calls: Sequence[ToolCallDelta] = ()
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=rid,
        finished=pb.Finished(
            finish_reason=f.reason,
            prompt_tokens=f.prompt_tokens,
            completion_tokens=f.completion_tokens,
            cached_tokens=f.cached_tokens,
            replica_id=f.replica_id,
            predicted_expert_hits=f.expert_hist,
            migrations=f.migrations,
            tool_calls=[
                pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                for c in merge_tool_calls(calls)
            ],
        ),
    )


def model_info(facts: ModelFacts, replicas: int) -> pb.ModelInfo:
    fields = dataclasses.asdict(facts)
    fields["model"] = fields.pop("name")  # every other field has the proto's name
    return pb.ModelInfo(**fields, engine_replicas=replicas)
