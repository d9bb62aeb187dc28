"""Seeded fuzzing over both protocols (``tests/fuzz``): thousands of malformed
requests, valid ones mixed in, against the session's cluster.

``MOE_CLUSTER_FUZZ_CASES`` sets how many (``make fuzz`` runs 10,000) and
``MOE_CLUSTER_FUZZ_SEED`` which ones.
"""

from __future__ import annotations

import os
import time

import httpx

from deployments.proto import inference_pb2 as pb
from tests.fuzz import cases, runner
from tests.integration.conftest import Served


def test_malformed_requests_get_client_errors_and_serving_goes_on(
    served: Served,
) -> None:
    n = int(os.environ.get("MOE_CLUSTER_FUZZ_CASES", "2000"))
    seed = int(os.environ.get("MOE_CLUSTER_FUZZ_SEED", "20261202"))
    target = runner.Target(served.grpc_target, served.http_base, served.api_key)
    t0 = time.monotonic()
    try:
        report = runner.run(target, cases.cases(seed, n))
    finally:
        target.close()
    print(f"\nfuzz seed {seed}: {time.monotonic() - t0:.0f} s\n{report.table()}")
    assert report.cases == n
    assert report.failures == [], report.table()
    assert report.valid >= n // cases.VALID_EVERY
    assert report.valid_served == report.valid
    # Alive and serving afterwards, on both protocols.
    msgs = list(
        served.client().generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5, 6, 7]),
                sampling=pb.SamplingParams(max_tokens=3, temperature=0),
            ),
            timeout=60,
        )
    )
    assert msgs[-1].finished.completion_tokens == 3
    assert httpx.get(f"{served.http_base}/health", timeout=30).status_code == 200
