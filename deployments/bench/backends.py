"""How to send: streaming clients for moe-cluster's gRPC API and any OpenAI server.

A backend turns a ``RequestSpec`` into a stream of ``Chunk``s and one ``Done``;
failures raise ``RequestFailed`` carrying a short code ("RESOURCE_EXHAUSTED",
"HTTP 429", "ReadTimeout", ...) so the report can count them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from deployments.bench.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class Chunk:
    tokens: int  # tokens in this chunk (best knowledge: 1 per SSE event on HTTP)


@dataclass(frozen=True, slots=True)
class Done:
    output_tokens: int | None  # as the server counted them, when it says
    cached_tokens: int | None  # prompt tokens served from cache, when it says
    # The prompt as the server tokenized it, when it says (a text prompt can
    # tokenize to more or fewer tokens than the ids it was made from).
    prompt_tokens: int | None = None


class RequestFailed(Exception):
    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code


class Backend(Protocol):
    name: str

    def stream(self, spec: RequestSpec) -> AsyncIterator[Chunk | Done]: ...
    async def close(self) -> None: ...


class GrpcBackend:
    """moe-cluster's ``moecluster.v1.Inference/Generate``."""

    name = "grpc"

    def __init__(self, target: str, api_key: str = "", timeout_s: float = 600) -> None:
        import grpc

        self._channel = grpc.aio.insecure_channel(target)
        from deployments.proto.inference_pb2_grpc import InferenceStub

        self._stub = InferenceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Chunk | Done]:
        import grpc

        from deployments.proto import inference_pb2 as pb

        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=spec.prompt),
            sampling=pb.SamplingParams(
                max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True
            ),
            qos=pb.QoS.Value(spec.qos.upper()),
            deadline_ms=spec.deadline_ms,
        )
        call = self._stub.Generate(
            request, metadata=self._metadata, timeout=self._timeout_s
        )
        try:
            async for msg in call:
                if msg.HasField("chunk"):
                    yield Chunk(len(msg.chunk.token_ids))
                else:
                    f = msg.finished
                    yield Done(f.completion_tokens, f.cached_tokens, f.prompt_tokens)
        except grpc.aio.AioRpcError as e:
            raise RequestFailed(e.code().name, e.details() or "") from None

    async def close(self) -> None:
        await self._channel.close()


class OpenAIBackend:
    """Any OpenAI-compatible server's streaming ``/v1/completions``.

    Prompts are sent as token id lists (vLLM, Ray Serve LLM and moe-cluster all
    accept them), or as text when ``detokenize`` is given (some routers read only
    text: Ray Serve LLM's prefix-aware router fails on token ids), with
    ``ignore_eos`` so every server generates the same lengths.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str = "",
        timeout_s: float = 600,
        send_qos: bool = True,
        detokenize: Callable[[tuple[int, ...]], str] | None = None,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self._model = model
        self._send_qos = send_qos
        self._detokenize = detokenize

    async def model(self) -> str:
        if self._model is None:
            r = await self._client.get("/v1/models")
            r.raise_for_status()
            self._model = str(r.json()["data"][0]["id"])
        return self._model

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Chunk | Done]:
        import httpx

        body: dict[str, object] = {
            "model": await self.model(),
            "prompt": (
                self._detokenize(spec.prompt) if self._detokenize else list(spec.prompt)
            ),
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self._send_qos:
            body["qos"] = spec.qos
            if spec.deadline_ms:
                body["deadline_ms"] = spec.deadline_ms
        usage: dict[str, object] | None = None
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RequestFailed(f"HTTP {r.status_code}", r.text[:200])
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise RequestFailed("stream-error", str(event["error"])[:200])
                    if event.get("usage"):
                        usage = event["usage"]
                    choices = event.get("choices") or []
                    if choices and (choices[0].get("text") or choices[0].get("delta")):
                        yield Chunk(1)
        except httpx.HTTPError as e:
            raise RequestFailed(type(e).__name__, str(e)[:200]) from None
        yield _done_from_usage(usage)

    async def close(self) -> None:
        await self._client.aclose()


def _done_from_usage(usage: dict[str, object] | None) -> Done:
    if not usage:
        return Done(None, None)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    out, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
    return Done(
        int(out) if isinstance(out, int) else None,
        int(cached) if isinstance(cached, int) else None,
        int(prompt) if isinstance(prompt, int) else None,
    )
