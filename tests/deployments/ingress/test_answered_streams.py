"""Serve logs no traceback for a gRPC stream the ingress answered with its own
status (a refusal, a bad request); it still does for anything else."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest
from ray.serve._private.grpc_util import get_grpc_response_status
from ray.serve.exceptions import gRPCStatusError

from deployments.ingress.deployment import ANSWERED_STREAMS, StreamFailed


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def serve_log() -> Iterator[_Records]:
    logger = logging.getLogger("ray.serve")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.addFilter(ANSWERED_STREAMS)  # as the ingress does when it starts
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeFilter(ANSWERED_STREAMS)
        logger.removeHandler(records)
        logger.setLevel(level)


def _serve_fails(exc: BaseException) -> grpc.StatusCode:
    """What Serve's direct ingress does with a stream that raised ``exc`` after
    the ingress set ``RESOURCE_EXHAUSTED`` on its context: wraps it, logs it, and
    answers with the code set."""
    try:
        raise exc
    except Exception as e:
        wrapped = gRPCStatusError(
            original_exception=e,
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
            details="the background queue is full; retry later (retry after 1 s)",
        )
        status = get_grpc_response_status(wrapped, None, "rid")
        logging.getLogger("ray.serve").exception("Request failed.", exc_info=wrapped)
    assert isinstance(status.code, grpc.StatusCode)
    return status.code


def test_a_stream_the_ingress_answered_logs_no_traceback(serve_log: _Records) -> None:
    code = _serve_fails(StreamFailed("the background queue is full; retry later"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # the client still gets it
    assert [r.getMessage() for r in serve_log.records if r.exc_info] == []


def test_any_other_failure_is_still_logged_with_its_traceback(
    serve_log: _Records,
) -> None:
    _serve_fails(ValueError("a bug"))
    logged = [r for r in serve_log.records if r.exc_info]
    assert len(logged) == 2  # Serve's two: the status, and "Request failed."
    assert "user-set gRPC status code" in logged[0].getMessage()
