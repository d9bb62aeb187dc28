"""One trace per request across every hop, exported over OTLP/gRPC to a real
receiver: Serve's proxy and replicas, the ingress, the router actor, the engine
replica, vLLM and the page store's connector in vLLM's engine-core process."""

from __future__ import annotations

import random
import secrets
from pathlib import Path

import grpc
import httpx

from deployments.proto import inference_pb2 as pb
from tests.integration.conftest import PLATFORM, Served
from tests.otlp_receiver import OTLPReceiver, Span, tree

BLOCK = PLATFORM.block_size
MODEL = "tiny-deepseek-v2"
# Every hop a served request crosses, by span name (or its start). Each process
# exports its spans in its own batches, so each replica's span is named: the
# ingress's links the proxy's span to the request's.
INGRESS_REPLICA = "replica_handle_request Ingress"
HOPS = {
    "proxy_",
    INGRESS_REPLICA,
    "ingress.authenticate",
    "ingress.validate",
    "ingress.tokenize",
    "router.admit",
    "engine.generate",
    "llm_request",
    "kvstore.lookup",
}


def traceparent() -> tuple[str, str, str]:
    """A sampled W3C traceparent of a client span: (header, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def long_text(seed: int) -> str:
    """Text of well over one KV block of tokens (under the test's 4 KiB limit), so
    the page store is asked for the prompt's blocks."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghij", k=3)) for _ in range(2 * BLOCK)]
    return " ".join(words)[:3500]


def receiver(served: Served) -> OTLPReceiver:
    assert served.traces is not None
    return served.traces


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name.startswith(name)]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def ancestors(spans: list[Span], span: Span) -> list[Span]:
    by_id = {s.span_id: s for s in spans}
    out = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        out.append(span)
    return out


def check_structure(spans: list[Span], client_span: str, operation: str) -> Span:
    """Asserts the parent/child structure of a served request's trace; returns
    the request span."""
    assert {s.trace_id for s in spans} == {spans[0].trace_id}
    proxy = one(spans, "proxy_")
    assert proxy.parent_id == client_span  # the client's traceparent is the parent
    request = one(spans, f"{operation} {MODEL}")
    assert proxy in ancestors(spans, request)
    for name in ("ingress.authenticate", "ingress.validate", "router.admit"):
        assert one(spans, name).parent_id == request.span_id, name
    assert (
        one(spans, "ingress.tokenize").parent_id
        == one(spans, "ingress.validate").span_id
    )
    engine = one(spans, "engine.generate")
    # Its child over a direct stream; through Serve's handle call for a request
    # placed on a replica whose address the ingress is still asking for.
    assert request in ancestors(spans, engine)
    assert one(spans, "llm_request").parent_id == engine.span_id
    lookups = [s for s in spans if s.name == "kvstore.lookup"]
    assert lookups and all(s.parent_id == engine.span_id for s in lookups)
    services = {s.service for s in spans}
    assert "moe-cluster-test" in services
    return request


def check_genai(request: Span, operation: str, max_tokens: int) -> None:
    a = request.attributes
    assert a["gen_ai.operation.name"] == operation
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == max_tokens
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == 1.0
    assert a["gen_ai.usage.input_tokens"] == a["moe_cluster.prompt_tokens"] > BLOCK
    assert a["gen_ai.usage.output_tokens"] == max_tokens
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.response.id"]
    assert a["moe_cluster.qos"] == "realtime"
    assert a["moe_cluster.replica"]
    assert "first_token" in request.event_names()
    assert not request.error


def check_hops(spans: list[Span], request: Span) -> None:
    admit = one(spans, "router.admit").attributes
    assert admit["moe_cluster.replica"] == request.attributes["moe_cluster.replica"]
    assert admit["moe_cluster.router.policy"] == "least_loaded"
    assert admit["moe_cluster.router.reason"]
    assert admit["moe_cluster.router.queue_wait_s"] >= 0
    assert "moe_cluster.router.cached_blocks" in admit
    engine = one(spans, "engine.generate").attributes
    assert engine["moe_cluster.replica"] == request.attributes["moe_cluster.replica"]
    assert engine["moe_cluster.node"]
    for key in ("queued_s", "prefill_s", "decode_s", "time_to_first_token_s"):
        assert engine[f"moe_cluster.engine.{key}"] >= 0, key
    assert engine["gen_ai.response.finish_reasons"] == ["length"]
    llm = one(spans, "llm_request").attributes  # vLLM's own span and names
    assert (
        llm["gen_ai.usage.prompt_tokens"]
        == request.attributes["gen_ai.usage.input_tokens"]
    )
    lookup = [s for s in spans if s.name == "kvstore.lookup"][-1].attributes
    prompt = request.attributes["moe_cluster.prompt_tokens"]
    assert lookup["moe_cluster.kv.pages_asked"] == (prompt - 1) // BLOCK


def test_a_grpc_request_is_one_trace_through_every_hop(served: Served) -> None:
    header, trace_id, client_span = traceparent()
    metadata = (*served.client().metadata, ("traceparent", header))
    request = pb.GenerateRequest(
        text=long_text(1),
        sampling=pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        qos=pb.REALTIME,
    )
    client = served.client()
    try:
        msgs = list(client.stub.Generate(request, metadata=metadata, timeout=120))
    finally:
        client.close()
    assert msgs[-1].HasField("finished")
    spans = receiver(served).wait_for(trace_id, HOPS)
    print("\n" + tree(spans))
    req = check_structure(spans, client_span, "text_completion")
    check_genai(req, "text_completion", 6)
    check_hops(spans, req)
    assert req.attributes["moe_cluster.protocol"] == "grpc"
    assert req.attributes["moe_cluster.auth"] == "ok"
    proxy = one(spans, "proxy_grpc_request")
    assert proxy.attributes.get("rpc.method") or proxy.attributes.get("method")


def test_an_http_request_is_one_trace_through_every_hop(served: Served) -> None:
    header, trace_id, client_span = traceparent()
    r = httpx.post(
        f"{served.http_base}/v1/chat/completions",
        headers={
            "Authorization": f"Bearer {served.api_key}",
            "traceparent": header,
            "x-qos": "realtime",
        },
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": long_text(2)}],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    spans = receiver(served).wait_for(trace_id, HOPS)
    req = check_structure(spans, client_span, "chat")
    check_genai(req, "chat", 5)
    check_hops(spans, req)
    assert req.attributes["gen_ai.request.stream"] is True
    assert req.attributes["moe_cluster.protocol"] == "http"
    assert one(spans, "proxy_http_request").attributes


def test_a_shed_request_is_an_error_in_its_trace(served: Served) -> None:
    header, trace_id, _ = traceparent()
    metadata = (*served.client().metadata, ("traceparent", header))
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(max_tokens=4),
        qos=pb.REALTIME,
        deadline_ms=1,  # no replica can meet it: shed at once
    )
    client = served.client()
    try:
        list(client.stub.Generate(request, metadata=metadata, timeout=60))
        raise AssertionError("not shed")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        client.close()
    spans = receiver(served).wait_for(
        trace_id, {"proxy_grpc_request", "router.admit", "text_completion"}
    )
    admit = one(spans, "router.admit")
    assert admit.error
    assert admit.attributes["moe_cluster.router.shed_reason"] == "deadline"
    assert admit.attributes["error.type"] == "shed:deadline"
    assert "shed" in admit.event_names()
    req = one(spans, "text_completion")
    assert req.error and req.attributes["error.type"] == "shed:deadline"
    assert not any(s.name == "engine.generate" for s in spans)  # never ran


def test_without_a_traceparent_the_proxy_starts_the_trace(served: Served) -> None:
    r = httpx.post(
        f"{served.http_base}/v1/completions",
        headers={"Authorization": f"Bearer {served.api_key}"},
        json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    rid = r.json()["id"]

    def request_span() -> Span | None:
        for s in receiver(served).spans():
            if s.attributes.get("gen_ai.response.id") == rid and s.name.startswith(
                "text_completion"
            ):
                return s
        return None

    from tests.waiting import wait_until

    span = wait_until(request_span, timeout=30, what="the request's span")
    spans = receiver(served).wait_for(
        span.trace_id, {"proxy_http_request", INGRESS_REPLICA}
    )
    proxy = one(spans, "proxy_http_request")
    assert proxy.parent_id == ""  # a root: the trace began at the proxy
    assert proxy in ancestors(spans, span)


def test_log_lines_carry_the_request_and_its_trace(served: Served) -> None:
    """The ingress's access line for a request names its request, trace and span
    ids, so a log search by trace id finds it. It is in the ingress replica's
    Serve log file, not on the stderr that Ray ships to the driver's console;
    so is Serve's own access line for the request."""
    import ray

    header, trace_id, _ = traceparent()
    serve_id = secrets.token_hex(8)  # Serve's request id, in its access line
    r = httpx.post(
        f"{served.http_base}/v1/completions",
        headers={
            "Authorization": f"Bearer {served.api_key}",
            "traceparent": header,
            "x-request-id": serve_id,
        },
        json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("cmpl-")
    spans = receiver(served).wait_for(trace_id, {"text_completion"})
    request = one(spans, "text_completion")
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"

    def lines(*parts: str) -> list[tuple[Path, str]]:
        found = []
        for path in logs.rglob("*"):
            if not path.is_file() or path.suffix not in (".log", ".out", ".err"):
                continue
            for text in path.read_text(errors="replace").splitlines():
                if all(part in text for part in parts):
                    found.append((path, text))
        return found

    from tests.waiting import wait_until

    [(path, found)] = wait_until(
        lambda: lines(f"request {rid} ", trace_id),
        timeout=30,
        what="the request's access line",
    )
    assert f"span_id={request.span_id}" in found
    assert path.parent.name == "serve" and "Ingress" in path.name
    # Serve's proxy writes one too (where Serve's proxy serves), to its file.
    serves = wait_until(
        lambda: lines(serve_id, "POST /v1/completions 200"),
        timeout=30,
        what="Serve's access line for the request",
    )
    assert all(path.parent.name == "serve" for path, _ in serves), serves
    assert any("Ingress" in path.name for path, _ in serves), serves


def test_pages_loaded_from_the_store_are_in_the_trace(served: Served) -> None:
    """A prompt computed once, then sent to both replicas at once: the replica
    whose engine lacks it loads its pages, and that request's trace says so."""
    import concurrent.futures

    prompt = long_text(3)

    def send() -> str:
        header, trace_id, _ = traceparent()
        r = httpx.post(
            f"{served.http_base}/v1/completions",
            headers={
                "Authorization": f"Bearer {served.api_key}",
                "traceparent": header,
            },
            json={"model": MODEL, "prompt": prompt, "max_tokens": 16},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return trace_id

    send()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        traces = list(pool.map(lambda _: send(), range(4)))

    def loads() -> list[Span]:
        return [
            s
            for t in traces
            for s in receiver(served).spans(t)
            if s.name == "kvstore.load"
        ]

    from tests.waiting import wait_until

    [load, *_] = wait_until(loads, timeout=30, what="a kvstore.load span")
    spans = receiver(served).wait_for(load.trace_id, {"engine.generate"})
    assert load.parent_id == one(spans, "engine.generate").span_id
    a = load.attributes
    assert a["moe_cluster.kv.pages_loaded"] == a["moe_cluster.kv.pages_planned"] >= 1
    assert a["moe_cluster.kv.bytes_loaded"] > 0
    assert a["moe_cluster.kv.checksum_failures"] == 0
    lookup = [s for s in spans if s.name == "kvstore.lookup"][-1]
    assert lookup.attributes["moe_cluster.kv.pages_found"] >= 1
