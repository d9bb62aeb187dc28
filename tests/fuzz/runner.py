"""Sends fuzz cases to a running cluster and judges each answer.

A case passes when the server answers it with a client error or serves it:
never gRPC ``INTERNAL``/``UNKNOWN``, never HTTP 5xx other than a JSON-bodied
503/504, never a stack trace in an answer, never a hang (the client's timeout),
and every valid case served.
"""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
import httpx

from deployments.proto import inference_pb2 as pb
from tests.fuzz.cases import Case, GrpcCase, HttpCase

TIMEOUT_S = 60.0
BAD_GRPC = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@dataclass
class Verdict:
    case: Case
    answer: str  # "grpc OK", "grpc INVALID_ARGUMENT", "http 400" ...
    problem: str = ""  # empty: passed
    seconds: float = 0.0


@dataclass
class Report:
    cases: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    valid_served: int = 0
    valid: int = 0
    failures: list[Verdict] = field(default_factory=list)
    slowest: list[Verdict] = field(default_factory=list)

    def add(self, v: Verdict) -> None:
        self.cases += 1
        self.slowest = sorted([*self.slowest, v], key=lambda x: -x.seconds)[:5]
        self.answers[v.answer] += 1
        self.kinds[f"{v.case.protocol} {v.case.kind}"] += 1
        if v.case.valid:
            self.valid += 1
            self.valid_served += not v.problem
        if v.problem:
            self.failures.append(v)

    def table(self) -> str:
        lines = [f"{self.cases} cases, {len(self.failures)} failed"]
        lines.append(f"valid requests served: {self.valid_served} of {self.valid}")
        lines += [f"  {n:6d}  {a}" for a, n in sorted(self.answers.items())]
        for v in self.slowest:
            lines.append(f"slowest: {v.seconds:.2f} s {v.case.protocol} {v.case.kind}")
        for v in self.failures[:10]:
            lines.append(f"FAILED {v.case.protocol} {v.case.kind}: {v.problem}")
        return "\n".join(lines)


class Target:
    def __init__(self, grpc_target: str, http_base: str, api_key: str) -> None:
        self.http_base, self.api_key = http_base, api_key
        self._channel = grpc.insecure_channel(
            grpc_target,
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        self._generate = self._channel.unary_stream(
            "/moecluster.v1.Inference/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        self._http = httpx.Client(timeout=TIMEOUT_S)

    def close(self) -> None:
        self._channel.close()
        self._http.close()

    def run(self, case: Case) -> Verdict:
        t0 = time.monotonic()
        try:
            if isinstance(case, GrpcCase):
                v = self._grpc(case)
            elif case.raw is not None:
                v = self._raw(case)
            else:
                v = self._http_case(case)
        except Exception as e:  # the client could not even get an answer
            v = Verdict(case, "no answer", f"{type(e).__name__}: {e}")
        v.seconds = time.monotonic() - t0
        return v

    def _grpc(self, case: GrpcCase) -> Verdict:
        md = [("authorization", f"Bearer {self.api_key}")]
        finished = None
        call = self._generate(case.payload, metadata=md, timeout=TIMEOUT_S)
        try:
            for msg in call:
                if msg.HasField("finished"):
                    finished = msg.finished
                elif not case.valid:
                    # Served (a mutation that still parses as a request, maybe
                    # one running to the end of the context): that is an answer.
                    call.cancel()
                    return Verdict(case, "grpc OK (streaming)")
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            v = Verdict(case, f"grpc {code.name}")
            if code in BAD_GRPC:
                v.problem = f"{code.name}: {details}"
            elif "Traceback" in details:
                v.problem = f"a stack trace in the details: {details[:200]}"
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED and not details:
                v.problem = "no answer within the client's timeout"
            elif case.valid:
                v.problem = f"a valid request refused: {code.name} {details}"
            return v
        v = Verdict(case, "grpc OK")
        if finished is None:
            v.problem = "the stream ended without a finished message"
        elif case.valid and finished.completion_tokens < 1:
            v.problem = f"a valid request produced nothing: {finished}"
        return v

    def _http_case(self, case: HttpCase) -> Verdict:
        headers = {"Authorization": f"Bearer {self.api_key}"} | case.headers
        r = self._http.request(
            case.method, self.http_base + case.path, content=case.body, headers=headers
        )
        return self._judge_http(case, r.status_code, r.text)

    def _raw(self, case: HttpCase) -> Verdict:
        """A request no HTTP client library would send, on a socket."""
        url = urlsplit(self.http_base)
        with socket.create_connection((url.hostname, url.port), TIMEOUT_S) as s:
            assert case.raw is not None
            s.sendall(case.raw)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        answer = b"".join(chunks)
        try:
            status = int(answer.split(b" ", 2)[1])
        except (IndexError, ValueError):
            return Verdict(case, "http none", f"not an HTTP answer: {answer[:80]!r}")
        body = answer.split(b"\r\n\r\n", 1)[-1].decode("utf-8", "replace")
        return self._judge_http(case, status, body)

    @staticmethod
    def _judge_http(case: HttpCase, status: int, body: str) -> Verdict:
        v = Verdict(case, f"http {status}")
        if "Traceback" in body:
            v.problem = f"a stack trace in the body: {body[:200]}"
        elif status >= 500:
            try:
                shaped = "error" in json.loads(body)
            except ValueError:
                shaped = False
            if status not in (503, 504) or not shaped:
                v.problem = f"{status}: {body[:200]}"
        elif case.valid:
            if status != 200:
                v.problem = f"a valid request refused: {status} {body[:200]}"
            elif json.loads(body)["usage"]["completion_tokens"] < 1:
                v.problem = "a valid request produced nothing"
        return v


def run(target: Target, cases: Iterable[Case], workers: int = 4) -> Report:
    report = Report()
    with ThreadPoolExecutor(workers) as pool:
        for verdict in pool.map(target.run, cases):
            report.add(verdict)
    return report
