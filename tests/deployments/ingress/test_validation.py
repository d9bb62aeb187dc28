from __future__ import annotations

from typing import Any

import pytest

from deployments.ingress import validation
from deployments.ingress.validation import InvalidRequest, Limits
from deployments.protocol import Sampling

LIMITS = Limits(max_model_len=100, vocab_size=50, max_prompt_bytes=16)


def sampling(**kw: Any) -> Sampling:
    kw.setdefault("max_tokens", None)
    return validation.sampling(prompt_tokens=10, limits=LIMITS, prefix="s.", **kw)


def test_defaults_fill_the_context() -> None:
    assert sampling() == Sampling(max_tokens=90)
    assert sampling(top_k=-1).top_k == 0


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_tokens": 0}, "s.max_tokens"),
        ({"max_tokens": 91}, "s.max_tokens"),
        ({"temperature": -0.1}, "s.temperature"),
        ({"temperature": float("inf")}, "s.temperature"),
        ({"temperature": 2.0001}, "s.temperature"),  # vLLM's bound
        ({"top_p": 0.0}, "s.top_p"),
        ({"top_p": 1.0001}, "s.top_p"),
        ({"top_p": float("nan")}, "s.top_p"),
        ({"top_k": -2}, "s.top_k"),
        ({"seed": 2**63}, "s.seed"),
        ({"stop": ["a"] * 17}, "s.stop"),
        ({"stop": ["ok", ""]}, "s.stop[1]"),
        ({"stop": ["ok", "a\ud800"]}, "s.stop[1]"),  # a lone surrogate
        ({"stop_token_ids": [3, 50]}, "s.stop_token_ids[1]"),
    ],
)
def test_bad_sampling_names_the_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        sampling(**kw)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")


def test_boundaries_are_accepted() -> None:
    s = sampling(max_tokens=90, temperature=0.0, top_p=1.0, top_k=0, seed=-(2**63))
    assert (s.max_tokens, s.temperature, s.top_p) == (90, 0.0, 1.0)
    assert sampling(temperature=2.0).temperature == 2.0


def test_prompts() -> None:
    assert validation.token_ids([0, 49], LIMITS, "ids") == (0, 49)
    with pytest.raises(InvalidRequest, match=r"ids\[1\]"):
        validation.token_ids([0, 50], LIMITS, "ids")
    with pytest.raises(InvalidRequest, match="empty"):
        validation.token_ids([], LIMITS, "ids")
    with pytest.raises(InvalidRequest, match="17 bytes"):
        validation.prompt_text("é" * 8 + "x", LIMITS, "text")
    with pytest.raises(InvalidRequest, match="UTF-8"):
        validation.prompt_text("a\ud800", LIMITS, "text")
    validation.prompt_fits(99, LIMITS, "text")
    with pytest.raises(InvalidRequest, match="context is 100"):
        validation.prompt_fits(100, LIMITS, "text")


def test_ids() -> None:
    assert len(validation.request_id("")) == 32
    assert validation.request_id("job-1.a:b_c") == "job-1.a:b_c"
    for bad in ("a b", "x" * 129, "ü"):
        with pytest.raises(InvalidRequest, match="request_id"):
            validation.request_id(bad)
    assert validation.tenant("") == ""
    with pytest.raises(InvalidRequest, match="tenant"):
        validation.tenant("a/b")
