"""OpenAI-compatible HTTP through Ray Serve's proxy, driven by the `openai` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from cluster.tiny_model import greedy_chain, greedy_successors
from tests.integration.conftest import Served, engine_stats
from tests.waiting import wait_until

MODEL = "tiny-deepseek-v2"


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http_base}/v1", api_key=served.api_key)


@pytest.fixture(scope="module")
def successor(tiny_model: Path) -> np.ndarray:
    return greedy_successors(tiny_model)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_streams_the_models_greedy_tokens(
    client: openai.OpenAI, successor: np.ndarray, served: Served
) -> None:
    prompt = [410, 465, 14, 318, 496]
    expected = greedy_chain(successor, prompt[-1], 12)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    assert len(chunks) >= 3  # streamed, not one blob
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, 12)
    # The streamed text is the expected tokens' text (same as gRPC's detokenizer).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served.config.model.path)
    assert text == tokenizer.decode(expected)


def test_completion_without_stream_has_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=6)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    # BOS, "hello", " world": text is encoded as vLLM's completions encode it.
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 6)
    assert r.usage.total_tokens == 9


def test_chat_completion_applies_the_chat_template(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
        ],
        max_tokens=5,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.usage is not None
    # BOS + "be brief\n\n" + "User: hello\n\n" + "Assistant:" is more than 6 tokens.
    assert r.usage.prompt_tokens > 6 and r.usage.completion_tokens == 5


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_http_health(served: Served) -> None:
    r = httpx.get(f"{served.http_base}/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_a_request_id_is_free_again_once_answered(served: Served) -> None:
    headers = {"Authorization": f"Bearer {served.api_key}"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "request_id": "again-1"}
    for stream in (False, False, True, True, False):
        r = httpx.post(
            f"{served.http_base}/v1/completions",
            json=body | {"stream": stream},
            headers=headers,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.text.endswith("data: [DONE]\n\n") if stream else r.json()["usage"]


def test_a_client_that_hangs_up_mid_stream_frees_the_engine_slot(
    served: Served, engine_handle: Any
) -> None:
    """The client closes its connection while tokens still stream: the engine
    drops the request (Serve cancels the ingress's handler, and the engine
    stream with it), rather than generating the rest for nobody. The rest is
    1,900 tokens, 5 s or more at this CPU engine's pace; the request must be
    gone within 2 s."""
    rid = "hang-up-1"
    body = {
        "model": MODEL,
        "prompt": "hang up",
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": True,
        "request_id": rid,
    }
    headers = {"Authorization": f"Bearer {served.api_key}"}

    def holds() -> bool:
        return any(rid in s.request_ids for s in engine_stats(engine_handle).values())

    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{served.http_base}/v1/completions", json=body, headers=headers
        ) as r,
    ):
        assert r.status_code == 200
        # Kept: an iterator of httpx's let go closes the connection itself.
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # streaming
        assert holds()
        # Leaving the block closes the response and the connection.
    wait_until(lambda: not holds(), 2, "the engine to drop it")
