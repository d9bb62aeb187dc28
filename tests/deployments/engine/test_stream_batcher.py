import pytest

from deployments.engine.stream_batcher import DeltaBatcher
from deployments.protocol import TokenDelta


def test_first_delta_goes_out_at_once_then_every_interval() -> None:
    b = DeltaBatcher(0.05)
    assert b.add([1], "a", now=10.0) == TokenDelta((1,), "a")
    assert b.add([2], "b", now=10.01) is None
    assert b.add([3], "c", now=10.04) is None
    assert b.add([4], "d", now=10.05) == TokenDelta((2, 3, 4), "bcd")
    assert b.add([5], "e", now=10.06) is None
    assert b.flush(now=10.07) == TokenDelta((5,), "e")
    assert b.flush(now=10.08) is None


def test_zero_interval_sends_every_step() -> None:
    b = DeltaBatcher(0.0)
    assert [b.add([i], str(i), now=1.0) for i in range(3)] == [
        TokenDelta((0,), "0"),
        TokenDelta((1,), "1"),
        TokenDelta((2,), "2"),
    ]


def test_steps_without_tokens_send_nothing() -> None:
    b = DeltaBatcher(0.05)
    assert b.add([], "", now=1.0) is None
    assert b.add([7], "x", now=1.001) == TokenDelta((7,), "x")


def test_negative_interval_is_an_error() -> None:
    with pytest.raises(ValueError):
        DeltaBatcher(-1)


def test_first_text_goes_out_at_once_when_the_first_token_shows_none() -> None:
    # The first token ends inside a multi-byte character: it decodes to no text
    # until the next one completes it, which must not wait for the interval.
    b = DeltaBatcher(0.05)
    assert b.add([1], "", now=10.0) == TokenDelta((1,), "")
    assert b.add([2], "é", now=10.005) == TokenDelta((2,), "é")
    assert b.add([3], "f", now=10.01) is None
    assert b.flush(now=10.02) == TokenDelta((3,), "f")


def test_deltas_without_text_are_batched_after_the_first() -> None:
    # Tokens that never decode to text (no detokenizer) only ever wait.
    b = DeltaBatcher(0.05)
    assert b.add([1], "", now=10.0) == TokenDelta((1,), "")
    assert b.add([2], "", now=10.01) is None
    assert b.add([3], "", now=10.05) == TokenDelta((2, 3), "")
