"""gRPC adapter: ``moecluster.v1.Inference`` messages ↔ the engine contract.

``add_inference_servicer`` replaces the generated registration so that a request
protobuf cannot parse (invalid UTF-8 in a string field, truncated bytes) reaches
the ingress as a ``MalformedRequest`` naming the field, and is answered with
INVALID_ARGUMENT instead of gRPC's opaque "Exception deserializing request".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError, Message

from cluster.qos import QoS
from deployments.ingress import validation
from deployments.ingress.frontend import Frontend, ModelFacts
from deployments.proto import inference_pb2 as pb
from deployments.proto.inference_pb2_grpc import add_InferenceServicer_to_server
from deployments.protocol import EngineRequest, Finish, TokenDelta

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


def engine_request(
    req: pb.GenerateRequest, frontend: Frontend
) -> tuple[EngineRequest, float | None]:
    """Validates a GenerateRequest; returns the engine request and TTFT deadline."""
    limits = frontend.limits
    rid = validation.request_id(req.request_id)
    tenant = validation.tenant(req.tenant)
    kind = req.WhichOneof("input")
    if kind == "text":
        validation.prompt_text(req.text, limits, "text")
        ids = tuple(frontend.encode_text(req.text))
        if not ids:
            raise validation.InvalidRequest("text", "tokenizes to no tokens")
        field = "text"
    elif kind == "token_ids":
        ids = validation.token_ids(req.token_ids.ids, limits, "token_ids.ids")
        field = "token_ids"
    else:
        raise validation.InvalidRequest("input", "set one of text or token_ids")
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
        prefix="sampling.",
    )
    request = EngineRequest(rid, ids, sampling, QOS_OF_PROTO[req.qos], tenant)
    deadline = req.deadline_ms / 1000 if req.deadline_ms else None
    return request, deadline


def chunk_message(rid: str, delta: TokenDelta) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=rid, chunk=pb.Chunk(token_ids=delta.token_ids, text=delta.text)
    )


def finished_message(rid: str, f: Finish) -> pb.GenerateResponse:
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
        ),
    )


def model_info(facts: ModelFacts, replicas: int) -> pb.ModelInfo:
    fields = dataclasses.asdict(facts)
    fields["model"] = fields.pop("name")  # every other field has the proto's name
    return pb.ModelInfo(**fields, engine_replicas=replicas)
