"""Servers that answer instantly, for testing and timing the load generator itself.

Both stream ``max_tokens`` one-token chunks and a final message at once. A prompt
starting with token 0 is refused (RESOURCE_EXHAUSTED / HTTP 429).
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator

import grpc
from aiohttp import web

from deployments.proto import inference_pb2 as pb
from deployments.proto.inference_pb2_grpc import (
    InferenceServicer,
    add_InferenceServicer_to_server,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class InstantInference(InferenceServicer):
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        ids = list(request.token_ids.ids)
        if ids and ids[0] == 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        n = request.sampling.max_tokens
        for i in range(n):
            yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[i % 100], text="x"))
        yield pb.GenerateResponse(
            finished=pb.Finished(
                finish_reason="length",
                prompt_tokens=len(ids) + 1,  # as a tokenizer adding BOS counts
                completion_tokens=n,
                cached_tokens=len(ids) // 2,
            )
        )


async def start_grpc() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add_InferenceServicer_to_server(InstantInference(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "instant"}]})


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    prompt = body["prompt"]
    if prompt and prompt[0] == 0:
        return web.json_response({"error": {"message": "full"}}, status=429)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = int(body["max_tokens"])
    for _ in range(n):
        chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = {
        "prompt_tokens": len(prompt) + 1,  # as a tokenizer adding BOS counts
        "completion_tokens": n,
        "prompt_tokens_details": {"cached_tokens": len(prompt) // 2},
    }
    await resp.write(
        f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
    )
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def start_openai() -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"
