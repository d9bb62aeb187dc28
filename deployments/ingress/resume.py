"""What a stream needs to go on on another replica after its engine failed.

``continuation`` is the request the new replica runs: the prompt plus every token
the client already has, ``max_tokens`` less those, the same sampling. Its KV is
in the page store (the dead engine saved each block as it filled), so the new
replica loads it instead of computing it.

``ResumedText`` makes the text of the resumed tokens in the ingress. The resumed
engine's own text cannot be used at the seam: vLLM primes its detokenizer with
the prompt (``tokenizers.DecodeStream(ids=prompt)``), and when that prompt ends
inside a UTF-8 character (a byte-level token of a multi-byte character, whose
text the client has not got yet) the first text it emits is the whole prompt's.
The ingress decodes a short window of tokens instead, emitting only complete
characters, as vLLM's own incremental detokenizer does. It also applies the
request's stop strings, which the continuation does not pass to the engine: a
stop string may straddle the seam.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from deployments.protocol import EngineRequest, TokenDelta

_INCOMPLETE = "\ufffd"  # what decoding a cut multi-byte character ends with
_MAX_CHAR_TOKENS = 4  # a UTF-8 character is at most 4 byte tokens
_WINDOW = 6  # tokens decoded before the new ones (word boundaries, spacing)
_SEED_MODULUS = 2**63


def continuation(request: EngineRequest, sent: Sequence[int]) -> EngineRequest:
    """The request that resumes ``request`` after its client got ``sent`` tokens
    (at least one, fewer than ``max_tokens``). A seeded request's seed moves on
    by the tokens sent: the same failure at the same token resumes the same
    way. The router places it anew; stop strings stay with the ingress."""
    s = request.sampling
    if not 0 < len(sent) < s.max_tokens:
        raise ValueError(f"cannot resume after {len(sent)} of {s.max_tokens} tokens")
    seed = None if s.seed is None else (s.seed + len(sent)) % _SEED_MODULUS
    sampling = dataclasses.replace(
        s, max_tokens=s.max_tokens - len(sent), seed=seed, stop=()
    )
    return dataclasses.replace(
        request,
        prompt_token_ids=request.prompt_token_ids + tuple(sent),
        sampling=sampling,
        replica_id="",
    )


class ResumedText:
    """The text (and stop strings) of a stream's tokens past a seam.

    ``sent``: the output tokens the client has; ``shown``: all the text it has.
    That may be less than the text of ``sent``: the last character may be cut,
    and with stop strings vLLM holds back the last ``len(longest) - 1``
    characters until it knows they do not start one. Both are made up here."""

    def __init__(
        self, tokenizer: Any, sent: Sequence[int], shown: str, stop: Sequence[str]
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(sent)
        # sent[:read] decodes to whole characters; what follows is one cut.
        read = len(self._ids)
        for _ in range(_MAX_CHAR_TOKENS):
            if read == 0 or not self._decode(read - _WINDOW, read).endswith(
                _INCOMPLETE
            ):
                break
            read -= 1
        self._read = read
        self._prefix = max(read - _WINDOW, 0)
        self._stop = tuple(stop)
        self._keep = max((len(s) for s in self._stop), default=1) - 1
        # Decided but not shown yet: what vLLM held back.
        self._pending = self._decode(0, read)[len(shown) :]
        self._tail = shown[-self._keep :] if self._keep else ""

    def _decode(self, start: int, end: int | None = None) -> str:
        text: str = self._tokenizer.decode(
            self._ids[max(start, 0) : end], skip_special_tokens=True
        )
        return text

    def delta(self, event: TokenDelta) -> tuple[TokenDelta, bool]:
        """``event`` with its text made here; True when a stop string ended the
        stream in it (its text then stops short of the stop string)."""
        self._ids.extend(event.token_ids)
        before = self._decode(self._prefix, self._read)
        # The text up to the last token after which it ends in whole characters
        # (vLLM's detokenizer, stepping token by token, emits it there).
        for end in range(len(self._ids), self._read, -1):
            now = self._decode(self._prefix, end)
            if len(now) > len(before) and not now.endswith(_INCOMPLETE):
                self._pending += now[len(before) :]
                self._prefix, self._read = self._read, end
                break
        if not self._stop:
            text, self._pending = self._pending, ""
            return dataclasses.replace(event, text=text), False
        window = self._tail + self._pending
        found = [i for s in self._stop if (i := window.find(s)) != -1]
        if found:
            text = window[len(self._tail) : min(found)]
            self._pending = ""
            return dataclasses.replace(event, text=text), True
        # Hold back what may begin a stop string, as vLLM does.
        cut = max(len(self._pending) - self._keep, 0)
        text, self._pending = self._pending[:cut], self._pending[cut:]
        self._tail = (self._tail + text)[-self._keep :] if self._keep else ""
        return dataclasses.replace(event, text=text), False

    def flush(self) -> str:
        """The text still held back, for the stream's end (no stop string came)."""
        text, self._pending = self._pending, ""
        return text
