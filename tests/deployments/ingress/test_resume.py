"""The request and the text of a stream resumed on another replica."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deployments.ingress.resume import ResumedText, continuation
from deployments.protocol import EngineRequest, Sampling, TokenDelta

TEXT = "hello wörld, ünd 日本 stop here"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def shown_before(tokenizer: Any, ids: list[int], stop: tuple[str, ...] = ()) -> str:
    """The text a client has of ``ids``, as vLLM streams it: complete characters
    only (a cut one is held back), and with stop strings, less the last
    ``len(longest) - 1`` characters."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=True)
    text = "".join(stream.step(tokenizer._tokenizer, t) or "" for t in ids)
    keep = max((len(s) for s in stop), default=1) - 1
    return text[: len(text) - keep] if keep else text


def resume(
    tokenizer: Any, ids: list[int], cut: int, stop: tuple[str, ...] = (), step: int = 1
) -> tuple[str, bool]:
    shown = shown_before(tokenizer, ids[:cut], stop)
    text = ResumedText(tokenizer, ids[:cut], shown, stop)
    out, stopped = [], False
    for i in range(cut, len(ids), step):
        delta, stopped = text.delta(TokenDelta(tuple(ids[i : i + step]), "engine's"))
        out.append(delta.text)
        if stopped:
            break
    if not stopped:
        out.append(text.flush())
    return shown + "".join(out), stopped


def test_the_resumed_text_is_whole_at_every_seam(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # Byte-level tokens: several seams cut a character in two.
    cut_chars = [
        c for c in range(1, len(ids)) if tokenizer.decode(ids[:c]).endswith("\ufffd")
    ]
    assert len(cut_chars) >= 3
    for cut in range(1, len(ids)):
        for step in (1, 3):
            assert resume(tokenizer, ids, cut, step=step) == (TEXT, False), cut
            # With a stop string that never comes: held back, then flushed.
            assert resume(tokenizer, ids, cut, ("nowhere",), step) == (TEXT, False)


def test_a_stop_string_across_the_seam_ends_the_stream_before_it(
    tokenizer: Any,
) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    before_stop = TEXT.index("stop")
    stop = ("xyz", "stop h")
    seams = 0
    for cut in range(1, len(ids)):
        if "stop h" in tokenizer.decode(ids[:cut]):
            break  # the engine had the stop string already
        for step in (1, 2):
            text, stopped = resume(tokenizer, ids, cut, stop, step)
            assert stopped and text == TEXT[:before_stop], (cut, step)
        seams += 1
    assert seams > 10


def test_the_continuation_carries_what_was_sent() -> None:
    request = EngineRequest(
        "r1",
        (1, 2, 3),
        Sampling(max_tokens=10, temperature=0.7, seed=41, stop=("x",)),
        tenant="acme",
        replica_id="dead",
    )
    c = continuation(request, [7, 8, 9])
    assert c.prompt_token_ids == (1, 2, 3, 7, 8, 9)
    assert (c.request_id, c.tenant, c.replica_id) == ("r1", "acme", "")
    assert c.sampling == Sampling(max_tokens=7, temperature=0.7, seed=44, stop=())
    assert continuation(request, [7, 8, 9]) == c  # deterministic
    with pytest.raises(ValueError):
        continuation(request, [])
    with pytest.raises(ValueError):
        continuation(request, list(range(10)))


def test_seeded_random_streams_resume_with_the_text_vllm_would_give(
    tokenizer: Any,
) -> None:
    """Random tokens (invalid and cut UTF-8 among them), cut anywhere, resumed
    in deltas of 1-5 tokens: the client's text is what vLLM's detokenizer,
    stepping token by token through the uninterrupted stream, gives."""
    import random

    from tokenizers.decoders import DecodeStream

    rng = random.Random(7)
    for _ in range(1500):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(2, 40))]
        stream = DecodeStream(ids=[410, 465, 14], skip_special_tokens=True)
        steps = [stream.step(tokenizer._tokenizer, t) or "" for t in ids]
        cut = rng.randint(1, len(ids) - 1)
        text = ResumedText(tokenizer, ids[:cut], "".join(steps[:cut]), ())
        out, i = [], cut
        while i < len(ids):
            n = rng.randint(1, 5)
            out.append(text.delta(TokenDelta(tuple(ids[i : i + n]), "x"))[0].text)
            i += n
        out.append(text.flush())
        assert "".join(steps[:cut] + out) == "".join(steps), (ids, cut)
