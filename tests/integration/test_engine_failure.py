"""A replica whose vLLM engine dies: its streams fail fast, Serve replaces it."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import psutil

from deployments.proto import inference_pb2 as pb
from tests.integration.conftest import Served, engine_stats, wait_until

RUN_LAST = True  # kills an engine; the cluster heals within the test


def test_dead_engine_fails_its_streams_and_the_replica_is_replaced(
    served: Served, engine_handle: Any
) -> None:
    request = pb.GenerateRequest(
        request_id="doomed-1",
        token_ids=pb.TokenIds(ids=[410, 465, 14]),
        sampling=pb.SamplingParams(max_tokens=480, temperature=0, ignore_eos=True),
    )
    outcome: dict[str, Any] = {}
    started = threading.Event()

    def stream() -> None:
        try:
            for msg in served.client().generate(request, timeout=120):
                if msg.HasField("chunk"):
                    started.set()
                else:
                    outcome["finished"] = msg.finished
        except grpc.RpcError as e:
            outcome["code"], outcome["details"] = e.code(), e.details()
        started.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(60)
    before = wait_until(lambda: engine_stats(engine_handle), 30, "both replicas")
    (victim,) = [s for s in before.values() if "doomed-1" in s.request_ids]
    children = psutil.Process(victim.pid).children(recursive=True)
    assert children, "the engine core runs in a child process of the replica"
    for child in children:
        child.kill()
    killed_at = time.monotonic()

    reader.join(60)
    assert not reader.is_alive(), "the stream hung after its engine died"
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    assert "Traceback" not in outcome["details"]

    # The surviving replica keeps serving while the dead one is replaced.
    ok = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6]), sampling=pb.SamplingParams(max_tokens=4)
    )
    for _ in range(4):
        msgs = list(served.client().generate(ok, timeout=60))
        assert msgs[-1].finished.completion_tokens == 4

    def replaced() -> bool:
        now = engine_stats(engine_handle)
        return len(now) == 2 and victim.replica_id not in now

    wait_until(replaced, 180, "Serve to replace the replica with the dead engine")
    print(
        f"replica replaced {time.monotonic() - killed_at:.1f} s after its engine died"
    )
