"""moecluster.v1.Inference over Ray Serve's gRPC proxy, on real vLLM engines."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.tiny_model import (
    EOS,
    TinyModelSpec,
    cycle_order,
    greedy_chain,
    greedy_successors,
)
from cluster.tiny_tokenizer import NUM_RESERVED
from deployments.proto import inference_pb2 as pb
from tests.integration.conftest import ENGINE, Served, engine_stats, wait_until
from tests.integration.test_router import router_snapshot

PROMPT_IDS = [410, 465, 14, 318, 496]


@pytest.fixture(scope="module")
def successor(tiny_model: Path) -> np.ndarray:
    return greedy_successors(tiny_model)


def greedy(ids: list[int], n: int, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_tokens=n, temperature=0.0, **sampling),
    )


def run(served: Served, request: pb.GenerateRequest) -> tuple[list[int], Any, int]:
    """(token ids, Finished, number of chunk messages) of one Generate call."""
    client = served.client()
    tokens: list[int] = []
    chunks = 0
    finished = None
    for msg in client.generate(request, timeout=120):
        if msg.HasField("chunk"):
            chunks += 1
            tokens += msg.chunk.token_ids
        else:
            assert finished is None, "more than one final message"
            finished = msg.finished
    client.close()
    assert finished is not None, "stream ended without a final message"
    return tokens, finished, chunks


def test_generate_streams_the_models_greedy_tokens(
    served: Served, successor: np.ndarray
) -> None:
    tokens, fin, chunks = run(served, greedy(PROMPT_IDS, 16))
    assert tokens == greedy_chain(successor, PROMPT_IDS[-1], 16)
    assert chunks >= 2, "tokens arrived in one message: not streamed"
    assert fin.finish_reason == "length"
    assert (fin.prompt_tokens, fin.completion_tokens) == (5, 16)
    assert fin.replica_id


def test_text_input_is_tokenized_and_detokenized(served: Served) -> None:
    client = served.client()
    request = pb.GenerateRequest(
        text="hello world", sampling=pb.SamplingParams(max_tokens=8, temperature=0)
    )
    msgs = list(client.generate(request, timeout=120))
    text = "".join(m.chunk.text for m in msgs if m.HasField("chunk"))
    assert msgs[-1].finished.prompt_tokens == 3  # BOS, "hello", " world"
    assert msgs[-1].finished.completion_tokens == 8
    assert text  # the engine's incremental detokenization reached the client


def test_both_replicas_give_identical_greedy_tokens(
    served: Served, successor: np.ndarray
) -> None:
    expected = greedy_chain(successor, PROMPT_IDS[-1], 32)
    by_replica: dict[str, list[list[int]]] = {}
    with ThreadPoolExecutor(8) as pool:
        for _ in range(4):  # concurrent batches spread over both replicas
            results = list(
                pool.map(lambda _: run(served, greedy(PROMPT_IDS, 32)), range(8))
            )
            for tokens, fin, _ in results:
                by_replica.setdefault(fin.replica_id, []).append(tokens)
            if len(by_replica) == 2:
                break
    assert len(by_replica) == 2, f"only replicas {list(by_replica)} answered"
    for replica, runs in by_replica.items():
        for tokens in runs:
            assert tokens == expected, f"replica {replica} diverged"


def test_eos_stops_unless_ignored(served: Served, tiny_model: Path) -> None:
    order = cycle_order(TinyModelSpec(), num_special=NUM_RESERVED)
    before_eos = [int(order[-3])]  # greedy: order[-2], order[-1], EOS
    tokens, fin, _ = run(served, greedy(before_eos, 10))
    assert fin.finish_reason == "stop"
    assert tokens[:2] == [int(order[-2]), int(order[-1])]
    assert fin.completion_tokens == len(tokens) <= 3
    tokens, fin, _ = run(served, greedy(before_eos, 10, ignore_eos=True))
    assert fin.finish_reason == "length"
    assert tokens[2] == EOS.id and len(tokens) == 10


def test_stop_token_ids_end_the_stream(served: Served, successor: np.ndarray) -> None:
    chain = greedy_chain(successor, PROMPT_IDS[-1], 10)
    tokens, fin, _ = run(served, greedy(PROMPT_IDS, 10, stop_token_ids=[chain[4]]))
    assert fin.finish_reason == "stop"
    assert tokens[:4] == chain[:4] and len(tokens) <= 5


def test_model_info(served: Served) -> None:
    info = served.client().model_info()
    assert info.model == "tiny-deepseek-v2"
    assert info.architecture == "DeepseekV2ForCausalLM"
    assert (info.max_context, info.vocab_size) == (ENGINE["max_model_len"], 1024)
    assert (info.num_routed_experts, info.experts_per_token) == (16, 2)
    assert (info.num_shared_experts, info.num_moe_layers) == (1, 3)
    assert (info.num_expert_groups, info.topk_groups) == (4, 2)
    assert info.engine_replicas == 2


def test_health_check(served: Served) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(served.grpc_target))
    for service in ("", "moecluster.v1.Inference"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(health_pb2.HealthCheckRequest(service="nope.v1.X"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(served: Served) -> None:
    channel = grpc.insecure_channel(served.grpc_target)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reqs = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="moecluster.v1.Inference"
        ),
    ]
    listed, file_resp = list(stub.ServerReflectionInfo(iter(reqs), timeout=30))
    names = {s.name for s in listed.list_services_response.service}
    assert {"moecluster.v1.Inference", "grpc.health.v1.Health"} <= names
    assert file_resp.file_descriptor_response.file_descriptor_proto


def _stream_in_background(served: Served, request: pb.GenerateRequest) -> Any:
    client = served.client()
    call = client.generate(request, timeout=120)
    got: dict[str, Any] = {"tokens": [], "finished": None, "error": None}
    started = threading.Event()

    def read() -> None:
        try:
            for msg in call:
                if msg.HasField("chunk"):
                    got["tokens"] += msg.chunk.token_ids
                    if len(got["tokens"]) >= 3:
                        started.set()
                else:
                    got["finished"] = msg.finished
        except grpc.RpcError as e:
            got["error"] = e.code()
        finally:
            started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(60), "no tokens within 60 s"
    return call, reader, got


def _engine_holds(engine_handle: Any, request_id: str) -> bool:
    """Whether any engine replica holds ``request_id``."""
    stats = engine_stats(engine_handle)
    assert len(stats) == 2
    return any(request_id in s.request_ids for s in stats.values())


def test_abort_mid_stream_frees_the_engine_slot(
    served: Served, engine_handle: Any
) -> None:
    request = greedy(PROMPT_IDS, 480, ignore_eos=True)
    request.request_id = "abort-me-1"
    _, reader, got = _stream_in_background(served, request)
    assert served.client().abort("abort-me-1") is True
    reader.join(30)
    assert not reader.is_alive(), "stream did not end after Abort"
    fin = got["finished"]
    assert got["error"] is None and fin is not None
    assert fin.finish_reason == "abort"
    assert 3 <= fin.completion_tokens < 480
    wait_until(
        lambda: not _engine_holds(engine_handle, "abort-me-1"), 30, "engine to drop it"
    )
    assert served.client().abort("abort-me-1") is False


def test_client_cancel_frees_the_engine_slot(
    served: Served, engine_handle: Any
) -> None:
    request = greedy(PROMPT_IDS, 480, ignore_eos=True)
    request.request_id = "cancel-me-1"
    call, reader, got = _stream_in_background(served, request)
    assert _engine_holds(engine_handle, "cancel-me-1")
    call.cancel()
    reader.join(30)
    assert got["error"] == grpc.StatusCode.CANCELLED
    wait_until(
        lambda: not _engine_holds(engine_handle, "cancel-me-1"), 30, "engine to drop it"
    )


def test_duplicate_in_flight_request_id_is_refused(served: Served) -> None:
    request = greedy(PROMPT_IDS, 480, ignore_eos=True)
    request.request_id = "twice-1"
    call, reader, _ = _stream_in_background(served, request)
    with pytest.raises(grpc.RpcError) as e:
        run(served, request)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    reader.join(30)


def test_an_impossible_deadline_never_reaches_an_engine(
    served: Served, engine_handle: Any
) -> None:
    request = greedy(PROMPT_IDS, 16)
    request.request_id = "too-late-1"
    request.deadline_ms = 1
    shed_before = router_snapshot(served).shed.get("normal/deadline", 0)
    with pytest.raises(grpc.RpcError) as e:
        run(served, request)
    # The router refuses it up front (a deadline missed after dispatch would be
    # DEADLINE_EXCEEDED, and the engine request aborted: see test_frontend).
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "deadline_ms=1" in (e.value.details() or "")
    assert router_snapshot(served).shed["normal/deadline"] == shed_before + 1
    assert not _engine_holds(engine_handle, "too-late-1")


def test_health_watch_streams_the_status(served: Served) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(served.grpc_target))
    call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
    first = next(call)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    call.cancel()
