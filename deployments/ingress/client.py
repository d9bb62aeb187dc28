"""A small gRPC client for ``moecluster.v1.Inference`` (used by the CLI and tests)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from deployments.proto import inference_pb2 as pb
from deployments.proto.inference_pb2_grpc import InferenceStub

MAX_MESSAGE_BYTES = 64 << 20


class InferenceClient:
    def __init__(self, target: str, api_key: str = "", application: str = "") -> None:
        """``application``: the Serve app to reach where the cluster runs several
        (Serve's gRPC proxy picks it by this metadata key)."""
        self.channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self.stub = InferenceStub(self.channel)
        metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
        if application:
            metadata.append(("application", application))
        self.metadata: Sequence[tuple[str, str]] = tuple(metadata)

    def generate(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> Iterator[pb.GenerateResponse]:
        call: Iterator[pb.GenerateResponse] = self.stub.Generate(
            request, metadata=self.metadata, timeout=timeout
        )
        return call

    def abort(self, request_id: str) -> bool:
        resp = self.stub.Abort(
            pb.AbortRequest(request_id=request_id), metadata=self.metadata
        )
        return bool(resp.found)

    def model_info(self) -> pb.ModelInfo:
        info: pb.ModelInfo = self.stub.GetModelInfo(
            pb.ModelInfoRequest(), metadata=self.metadata
        )
        return info

    def close(self) -> None:
        self.channel.close()
