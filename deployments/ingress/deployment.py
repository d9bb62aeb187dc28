"""The ingress deployment: gRPC ``moecluster.v1.Inference`` + health, and OpenAI HTTP.

One deployment behind both Ray Serve proxies (gRPC methods by name, HTTP through
FastAPI). Everything protocol-independent lives in ``Frontend``; this module maps
protocols onto it and failures onto status codes, never onto stack traces.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import gc_pauses, tracing
from cluster.config import ClusterConfig
from deployments.direct import DirectStreams, Endpoint
from deployments.ingress import (
    grpc_api,
    kv_warm,
    openai_api,
    structured,
    telemetry,
    validation,
)
from deployments.ingress.errors import CLIENT_ERRORS, ServiceError, Status, status_of
from deployments.ingress.frontend import Credential, Frontend, ModelFacts
from deployments.ingress.grpc_api import MalformedRequest
from deployments.ingress.kv_warm import WarmRequest
from deployments.ingress.router_client import RouterClient
from deployments.ingress.telemetry import RequestTelemetry
from deployments.proto import inference_pb2 as pb
from deployments.protocol import (
    EngineEvent,
    EngineRequest,
    Finish,
    Pin,
    TokenDelta,
    TokenLogprob,
    ToolCallDelta,
)
from router import actor as router_actor
from router.experts import ExpertPredictor
from router.tickets import TicketMaker

logger = logging.getLogger("moe_cluster.ingress")
app = FastAPI(title="moe-cluster", docs_url=None, redoc_url=None)


@app.exception_handler(StarletteHTTPException)
async def _routing_error(_request: Request, exc: StarletteHTTPException) -> Response:
    """FastAPI's own answers (an unknown path, a method a path does not take) in
    OpenAI's error shape, like every other error of this server."""
    status = Status(grpc.StatusCode.NOT_FOUND, exc.status_code, "invalid_request_error")
    message = {404: "no such endpoint", 405: "method not allowed on this endpoint"}
    body = openai_api.error_body(
        status, message.get(exc.status_code, str(exc.detail)), None
    )
    return JSONResponse(body, exc.status_code, headers=getattr(exc, "headers", None))


HEALTH_PROBE_TIMEOUT_S = 5.0


class StreamFailed(Exception):
    """Ends a gRPC stream whose status is already set on the context.

    NOTE: Serve sends the gRPC context back only with each yielded message, so a
    status set on a stream is lost unless the method raises; Serve then carries
    the code and details set on the context to the client.
    """


class _AnsweredStreams(logging.Filter):
    """Keeps Serve's logger from logging a traceback for each gRPC stream this
    ingress ended with a status of its own (``StreamFailed``): refusals under
    overload and bad requests. Serve logs two 25-line tracebacks for each, which
    its log monitor then ships to the driver: under a flood of refusals, CPU the
    requests being served need. They are answered, counted and traced already,
    and Serve's access log still has a line for each; an internal error is
    logged by the ingress itself (``_grpc_fail``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        original = getattr(exc, "original_exception", None)  # Serve's wrapper
        return not isinstance(exc, StreamFailed) and not isinstance(
            original, StreamFailed
        )


ANSWERED_STREAMS = _AnsweredStreams()


def _client_message(exc: BaseException) -> str:
    if isinstance(exc, CLIENT_ERRORS):
        return str(exc)
    return "internal error"


# NOTE: helpers precede the class: @serve.ingress serializes it when applied.
async def _first_output(events: AsyncGenerator[EngineEvent, None]) -> EngineEvent:
    async for event in events:
        if isinstance(event, (TokenDelta, Finish)):
            return event
    raise ServiceError("engine stream ended without output")


@dataclass(slots=True)
class _Collected:
    text: str
    finish: Finish
    calls: list[ToolCallDelta]
    logprobs: list[TokenLogprob]


async def _collect(
    first: EngineEvent, events: AsyncGenerator[EngineEvent, None]
) -> _Collected:
    parts: list[str] = []
    calls: list[ToolCallDelta] = []
    logprobs: list[TokenLogprob] = []
    event = first
    try:
        while not isinstance(event, Finish):
            if isinstance(event, TokenDelta):
                parts.append(event.text)
                calls += event.tool_calls
                logprobs += event.logprobs
            event = await anext(events)
    finally:
        await events.aclose()  # leave the in-flight table now, not at GC
    return _Collected("".join(parts), event, calls, logprobs)


_DONE = openai_api.sse("[DONE]")


async def _sse(
    shape: openai_api.ResponseShape,
    first: EngineEvent,
    events: AsyncGenerator[EngineEvent, None],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    if shape.chat:
        yield openai_api.sse(shape.role_chunk())
    event: EngineEvent | None = first
    held = b""  # the last tokens' chunk, written with the end
    try:
        while event is not None:
            if isinstance(event, TokenDelta) and (
                event.text or event.tool_calls or event.logprobs
            ):
                chunk = shape.chunk(event.text, None, event.tool_calls, event.logprobs)
                if event.finishing:
                    held += openai_api.sse(chunk)
                else:
                    yield held + openai_api.sse(chunk)
                    held = b""
            elif isinstance(event, Finish):
                # The last tokens, the finish, the usage and the end in one
                # write: the client has its whole answer (and may send its next
                # request) before the request's own bookkeeping runs (its span,
                # metrics and access line, the router's release).
                tail = held + openai_api.sse(shape.chunk("", event.reason))
                if include_usage:
                    tail += openai_api.sse(shape.usage_chunk(event))
                yield tail + _DONE
                return
            event = await anext(events, None)
    except Exception as e:
        status = status_of(e)
        error = openai_api.error_body(status, _client_message(e), None)
        yield held + openai_api.sse(error)
        held = b""
    finally:
        await events.aclose()  # leave the in-flight table now, not at GC
    yield held + _DONE


def _route() -> str:
    """The route of the request this task serves, as Serve tags its replicas'
    metrics with it (Serve's request context; empty outside a request)."""
    return serve.context._get_serve_request_context().route


def _router_client(config: ClusterConfig) -> RouterClient | None:
    r = config.router
    if not r.enabled:
        return None
    use_experts = r.policy == "expert" or r.expert_capacity_tokens is not None
    tickets = TicketMaker(
        block_size=config.engine.kv_block_size,
        hash_blocks=r.policy == "prefix",
        predictor=(
            ExpertPredictor.from_checkpoint(config.model.path) if use_experts else None
        ),
    )
    app, model = config.server.app_name, config.model.path
    stores = config.kvstore.enabled
    # This config wins.
    router_actor.get_or_create(r, app, model, follow_stores=stores, replace=True)
    return RouterClient(
        lambda: router_actor.get_or_create(r, app, model, follow_stores=stores),
        tickets,
        socket=r.admission_socket,
    )


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, config: ClusterConfig, engine: DeploymentHandle) -> None:
        from transformers import AutoTokenizer

        self._config = config
        self._engine = engine
        tracing.install_log_context()
        logging.getLogger("ray.serve").addFilter(ANSWERED_STREAMS)
        telemetry.access_lines_to_file()
        facts = ModelFacts.from_checkpoint(
            config.model.path, config.model.served_name, config.engine.max_model_len
        )
        self.frontend = Frontend(
            tokenizer=AutoTokenizer.from_pretrained(config.model.path),
            facts=facts,
            limits=validation.Limits(
                max_model_len=facts.max_context,
                vocab_size=facts.vocab_size,
                max_prompt_bytes=config.server.max_prompt_bytes,
            ),
            api_keys=[
                (k.key.get_secret_value(), k.tenants)
                for k in config.server.credentials()
            ],
            open_stream=self._open_stream,
            admission=(router := _router_client(config)),
            migration_limit=config.router.migration_limit,
        )
        self._router = router
        transport = config.server.engine_transport
        self._direct = (
            DirectStreams(self._endpoint_of) if transport == "direct" else None
        )
        gc_pauses.settle("ingress", freeze=False)  # Serve freezes it

    def _open_stream(self, request: EngineRequest) -> Any:
        if self._direct is not None and request.replica_id:
            # Placed by the router: straight to its replica, once its endpoint is
            # known (its first requests go through Serve's handle meanwhile).
            direct = self._direct.open(request, tracing.carrier(), _route())
            if direct is not None:
                return direct
        # _by_reference=False: Serve's gRPC transport (server.engine_transport).
        by_reference = self._config.server.engine_transport == "actor"
        stream = self._engine.options(stream=True, _by_reference=by_reference)
        return stream.generate.remote(request)

    async def _endpoint_of(self, replica_id: str) -> Endpoint | None:
        endpoint: Endpoint | None = await self._engine.direct_endpoint.remote(
            Pin(replica_id)
        )
        return endpoint

    async def _engines_alive(self) -> bool:
        """Whether the app takes requests: an engine replica answers, and the
        cluster is not stopping (the router closed: health then says so, and
        a load balancer that probes it sends no more)."""
        if self._router is not None and await self._router.closing(
            HEALTH_PROBE_TIMEOUT_S
        ):
            return False
        try:
            await asyncio.wait_for(
                self._engine.stats.remote(), timeout=HEALTH_PROBE_TIMEOUT_S
            )
            return True
        except Exception:
            return False

    # -- gRPC: moecluster.v1.Inference ---------------------------------------

    def _grpc_auth(
        self, ctx: RayServegRPCContext, tel: RequestTelemetry | None = None
    ) -> Credential:
        metadata = dict(ctx.invocation_metadata())
        return self._authenticate(metadata.get("authorization"), tel)

    def _authenticate(
        self, authorization: str | None, tel: RequestTelemetry | None
    ) -> Credential:
        if tel is None:
            return self.frontend.authenticate(authorization)
        with tel.child("ingress.authenticate") as span:
            try:
                credential = self.frontend.authenticate(authorization)
            except Exception:
                span.set_attribute(tracing.Attr.AUTH, "refused")
                raise
            outcome = "ok" if self._config.server.api_keys else "not-required"
            span.set_attribute(tracing.Attr.AUTH, outcome)
            tel.span.set_attribute(tracing.Attr.AUTH, outcome)
        return credential

    @staticmethod
    def _grpc_fail(ctx: RayServegRPCContext, exc: BaseException) -> None:
        status = status_of(exc)
        if status.grpc_code == grpc.StatusCode.INTERNAL:
            logger.exception("internal error", exc_info=exc)
        ctx.set_code(status.grpc_code)
        details = _client_message(exc)
        retry = getattr(exc, "retry_after_s", None)
        if retry is not None:
            # In the details: Serve carries code and details of a failed stream
            # to the client, not trailing metadata.
            details += f" (retry after {retry:g} s)"
        ctx.set_details(details)

    async def Generate(
        self, request: Any, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        tel = RequestTelemetry("text_completion", self.frontend.facts.name, "grpc")
        try:
            credential = self._grpc_auth(grpc_context, tel)
            if isinstance(request, MalformedRequest):
                raise validation.InvalidRequest("request", request.message)
            with tel.child("ingress.validate"):
                req, deadline, choice = grpc_api.engine_request(request, self.frontend)
                req = self.frontend.bind(credential, req)
            tel.request(req, stream=True)
            calls: list[ToolCallDelta] = []
            events = self.frontend.stream(req, deadline, tel)
            async for event in structured.shape_calls(events, choice):
                if isinstance(event, TokenDelta):
                    calls += event.tool_calls
                    yield grpc_api.chunk_message(req.request_id, event)
                elif isinstance(event, Finish):
                    yield grpc_api.finished_message(req.request_id, event, calls)
        except Exception as e:
            tel.failed(e)
            self._grpc_fail(grpc_context, e)
            raise StreamFailed(grpc_context.details()) from None
        finally:
            tel.end()

    async def Abort(
        self, request: Any, grpc_context: RayServegRPCContext
    ) -> pb.AbortResponse:
        try:
            credential = self._grpc_auth(grpc_context)
            if isinstance(request, MalformedRequest):
                raise validation.InvalidRequest("request", request.message)
            rid = validation.request_id(request.request_id)
            return pb.AbortResponse(found=self.frontend.abort(rid, credential))
        except Exception as e:
            self._grpc_fail(grpc_context, e)
            return pb.AbortResponse()

    async def GetModelInfo(
        self, request: Any, grpc_context: RayServegRPCContext
    ) -> pb.ModelInfo:
        try:
            self._grpc_auth(grpc_context)
            return grpc_api.model_info(
                self.frontend.facts, self._config.deployment.num_replicas
            )
        except Exception as e:
            self._grpc_fail(grpc_context, e)
            return pb.ModelInfo()

    # -- gRPC: grpc.health.v1.Health -----------------------------------------

    async def _health_status(self, service: str) -> int | None:
        if service not in ("", grpc_api.SERVICE):
            return None
        if await self._engines_alive():
            return health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(
        self, request: Any, grpc_context: RayServegRPCContext
    ) -> health_pb2.HealthCheckResponse:
        status = await self._health_status(request.service)
        if status is None:
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: Any, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = await self._health_status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(1.0)

    # -- OpenAI HTTP ---------------------------------------------------------

    @staticmethod
    def _http_error(exc: BaseException) -> JSONResponse:
        status = status_of(exc)
        if status.http_status >= 500 and not isinstance(exc, ServiceError):
            logger.exception("internal error", exc_info=exc)
        param = getattr(exc, "field", None)
        headers = {}
        retry = getattr(exc, "retry_after_s", None)
        if retry is not None:
            headers["Retry-After"] = str(max(1, round(retry)))
        body = openai_api.error_body(status, _client_message(exc), param)
        return JSONResponse(body, status_code=status.http_status, headers=headers)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self.frontend.authenticate(request.headers.get("authorization"))
        except ServiceError as e:
            return self._http_error(e)
        facts = self.frontend.facts
        card = {
            "id": facts.name,
            "object": "model",
            "created": 0,
            "owned_by": "moe-cluster",
            "max_model_len": facts.max_context,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health(self) -> Response:
        ok = await self._engines_alive()
        return JSONResponse(
            {"status": "ok" if ok else "unavailable"}, 200 if ok else 503
        )

    @app.post("/v1/kv/warm")
    async def warm(self, request: Request) -> Response:
        """Computes (or loads) a prompt's KV pages once, then has every node's
        page store hold them: e.g. a system prompt or a document about to be
        used. Answers how many pages each node now holds."""
        try:
            credential = self.frontend.authenticate(
                request.headers.get("authorization")
            )
            req = openai_api.parse(WarmRequest, await request.body())
            limits = self.frontend.limits
            if (req.prompt is None) == (req.token_ids is None):
                raise validation.InvalidRequest(
                    "prompt", "give exactly one of prompt and token_ids"
                )
            if req.prompt is not None:
                text = validation.prompt_text(req.prompt, limits, "prompt")
                ids = tuple(self.frontend.encode_text(text))
            else:
                ids = validation.token_ids(req.token_ids or [], limits, "token_ids")
            validation.prompt_fits(len(ids), limits, "prompt")
            tenant = credential.tenant(validation.tenant(req.tenant))
            if not self._config.kvstore.enabled:
                raise validation.InvalidRequest("kvstore", "the page store is off")
            cached = await self._engine.prefill.remote(list(ids), tenant)
            held = await kv_warm.replicate(
                self._config.server.app_name,
                kv_warm.page_hashes(ids, self._config.engine.kv_block_size, tenant),
            )
        except Exception as e:
            return self._http_error(e)
        return JSONResponse(
            {
                "prompt_tokens": len(ids),
                "pages": len(ids) // self._config.engine.kv_block_size,
                "cached_tokens": cached,
                "nodes": held,
            }
        )

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._openai(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, "chat")

    async def _openai(self, request: Request, kind: str) -> Response:
        operation = "chat" if kind == "chat" else "text_completion"
        tel = RequestTelemetry(operation, self.frontend.facts.name, "http")
        streaming = False
        try:
            credential = self._authenticate(request.headers.get("authorization"), tel)
            body = await request.body()
            limit = self._config.server.max_prompt_bytes + 64 * 1024
            with tel.child("ingress.validate"):
                if len(body) > limit:
                    raise validation.InvalidRequest(
                        "body", f"is {len(body)} bytes; the limit is {limit}"
                    )
                req, engine_req, deadline = openai_api.engine_request(
                    body, kind, self.frontend, request.headers
                )
                engine_req = self.frontend.bind(credential, engine_req)
            tel.request(engine_req, stream=bool(req.stream))
            shape = openai_api.ResponseShape(
                "chat" if kind == "chat" else "completion",
                engine_req.request_id,
                self.frontend.facts.name,
            )
            tel.response_id(shape.id)
            events = structured.shape_calls(
                self.frontend.stream(engine_req, deadline, tel),
                req.tool_choice_parsed,
            )
            # Wait for the first token before answering, so that overload, a
            # missed deadline or a dead engine still get a proper status code.
            first = await _first_output(events)
            if req.stream:
                streaming = True  # the stream ends the span
                return StreamingResponse(
                    _sse(shape, first, events, req.include_usage()),
                    media_type="text/event-stream",
                )
            got = await _collect(first, events)
            return JSONResponse(
                shape.full(got.text, got.finish, got.calls, got.logprobs)
            )
        except Exception as e:
            tel.failed(e)
            return self._http_error(e)
        finally:
            if not streaming:
                tel.end()
