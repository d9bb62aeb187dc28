from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.qos import QoS
from deployments.ingress import grpc_api
from deployments.ingress.grpc_api import MalformedRequest, add_inference_servicer
from deployments.ingress.validation import InvalidRequest, Limits
from deployments.proto import inference_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]


def test_regenerating_the_stubs_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "deployments" / "proto").mkdir(parents=True)
    shutil.copy(
        ROOT / "deployments/proto/inference.proto", tmp_path / "deployments/proto"
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--pyi_out=.",
            "--grpc_python_out=.",
            "deployments/proto/inference.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"):
        assert filecmp.cmp(
            tmp_path / "deployments/proto" / name,
            ROOT / "deployments/proto" / name,
            shallow=False,
        ), f"{name} is stale: run `make proto`"


class Recorder:
    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic += handlers

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self.registered[service] = handlers


def test_registration_keeps_every_method_and_checks_parsing() -> None:
    server = Recorder()
    servicer = type("Servicer", (), {"Generate": 1, "Abort": 2, "GetModelInfo": 3})()
    add_inference_servicer(servicer, server)
    (handler,) = server.generic
    assert handler.service_name() == "moecluster.v1.Inference"
    methods = server.registered["moecluster.v1.Inference"]
    assert set(methods) == {"Generate", "Abort", "GetModelInfo"}
    assert methods["Generate"].response_streaming
    parse = methods["Generate"].request_deserializer
    ok = pb.GenerateRequest(text="hi", tenant="t").SerializeToString()
    assert parse(ok).text == "hi"
    assert parse(ok.replace(b"hi", b"h\xff")) == MalformedRequest(
        "field text is not valid UTF-8"
    )
    nested = pb.GenerateRequest(sampling=pb.SamplingParams(stop=["ab", "cd"]))
    bad = nested.SerializeToString().replace(b"cd", b"c\xc3")
    assert parse(bad).message == "field sampling.stop[1] is not valid UTF-8"
    assert "not a valid" in parse(b"\xff\xff").message
    generic = handler.service(
        type("Details", (), {"method": "/moecluster.v1.Inference/Abort"})()
    )
    assert isinstance(generic, grpc.RpcMethodHandler)


class Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 50 for c in text]


class FakeFrontend:
    parses_tool_calls = True
    limits = Limits(max_model_len=20, vocab_size=50, max_prompt_bytes=64)

    def encode_text(self, text: str) -> list[int]:
        return Tokenizer().encode(text)

    def encode_chat(
        self, messages: list[dict[str, Any]], field: str, tools: Any = None
    ) -> list[int]:
        self.seen = (messages, tools)
        return [0] + [t for m in messages for t in self.encode_text(m["content"])]


def convert(req: pb.GenerateRequest) -> Any:
    return grpc_api.engine_request(req, FakeFrontend())  # type: ignore[arg-type]


def test_engine_request_conversion() -> None:
    req = pb.GenerateRequest(
        request_id="r-1",
        text="abcd",
        sampling=pb.SamplingParams(max_tokens=5, temperature=0.0, stop=["x"]),
        qos=pb.REALTIME,
        deadline_ms=250,
        tenant="acme",
    )
    engine_req, deadline, _ = convert(req)
    assert engine_req.request_id == "r-1" and engine_req.tenant == "acme"
    assert engine_req.prompt_token_ids == (47, 48, 49, 0)
    assert engine_req.qos is QoS.REALTIME and deadline == 0.25
    s = engine_req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.stop) == (5, 0.0, 1.0, ("x",))


def test_unset_fields_take_defaults() -> None:
    engine_req, deadline, _ = convert(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]))
    )
    assert engine_req.qos is QoS.NORMAL and deadline is None
    assert engine_req.sampling.max_tokens == 18 and engine_req.sampling.temperature == 1
    assert len(engine_req.request_id) == 32


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (pb.GenerateRequest(), "input"),
        (pb.GenerateRequest(text="a" * 20), "text"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 20)), "token_ids"),
        (pb.GenerateRequest(text="ab", qos=7), "qos"),  # type: ignore[arg-type]
        (
            pb.GenerateRequest(text="ab", sampling=pb.SamplingParams(top_p=0)),
            "sampling.top_p",
        ),
    ],
)
def test_bad_requests_name_the_field(req: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        convert(req)
    assert e.value.field == field


WEATHER = pb.Tool(
    name="get_weather",
    parameters_json='{"type": "object", "properties": {"city": {"type": "string"}}}',
)


def test_chat_input_with_tools_and_their_history() -> None:
    frontend = FakeFrontend()
    call = pb.ToolCall(id="c1", name="get_weather", arguments='{"city": "P"}')
    req = pb.GenerateRequest(
        chat=pb.Chat(
            messages=[
                pb.ChatMessage(role="user", content="ab"),
                pb.ChatMessage(role="assistant", tool_calls=[call]),
                pb.ChatMessage(role="tool", content="c", tool_call_id="c1"),
            ]
        ),
        tools=[WEATHER],
        sampling=pb.SamplingParams(max_tokens=3, logprobs=2),
    )
    engine_req, _, choice = grpc_api.engine_request(req, frontend)  # type: ignore[arg-type]
    messages, tools = frontend.seen
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tools[0]["function"]["name"] == "get_weather"
    assert choice.mode == "auto" and engine_req.tool_parser == "deepseek_v3"
    assert engine_req.prompt_token_ids == (0, 47, 48, 49)
    assert engine_req.sampling.logprobs == 2
    named = pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="ab")]),
        tools=[WEATHER],
        tool_function="get_weather",
    )
    engine_req, _, choice = grpc_api.engine_request(named, frontend)  # type: ignore[arg-type]
    assert choice.name == "get_weather" and engine_req.sampling.structured is not None


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([pb.ChatMessage(role="robot", content="x")], "chat.messages[0].role"),
        ([pb.ChatMessage(role="tool", content="x")], "chat.messages[0].tool_call_id"),
        (
            [pb.ChatMessage(role="user", tool_calls=[pb.ToolCall(id="c", name="f")])],
            "chat.messages[0].tool_calls",
        ),
        ([], "chat.messages"),
    ],
)
def test_bad_chat_messages_name_the_field(
    messages: list[pb.ChatMessage], field: str
) -> None:
    req = pb.GenerateRequest(chat=pb.Chat(messages=messages))
    with pytest.raises(InvalidRequest) as e:
        convert(req)
    assert e.value.field == field
