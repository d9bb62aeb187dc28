"""Request validation shared by the gRPC and the OpenAI HTTP front ends.

Every check raises ``InvalidRequest`` naming the offending field as the client
spelled it (``sampling.top_p`` on gRPC, ``top_p`` on HTTP), so a client can fix
its request from the message alone.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.config import MAX_ID_CHARS, is_id
from deployments.protocol import Sampling

# vLLM's own bounds (vllm/sampling_params.py, SamplingParams._verify_args),
# checked here so that the engine never refuses what the ingress let through
# (tests/deployments/engine/test_args.py holds them against vLLM's).
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
_INT32_MAX = 2**31 - 1


class InvalidRequest(ValueError):
    """A client error: maps to gRPC INVALID_ARGUMENT and HTTP 400."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_prompt_bytes: int


def request_id(value: str, field: str = "request_id") -> str:
    """The client's id, or a fresh one when empty."""
    if not value:
        return uuid.uuid4().hex
    if not is_id(value):
        raise InvalidRequest(
            field,
            f"must be 1-{MAX_ID_CHARS} characters of letters, digits and '._:-'",
        )
    return value


def tenant(value: str, field: str = "tenant") -> str:
    if value and not is_id(value):
        raise InvalidRequest(
            field, f"must be at most {MAX_ID_CHARS} letters, digits and '._:-'"
        )
    return value


def utf8(value: str, field: str) -> str:
    """``value`` must be encodable as UTF-8 (JSON's "\\ud800" escapes decode to
    lone surrogates, which are not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(field, "is not valid UTF-8 (a lone surrogate)") from None
    return value


def prompt_text(value: str, limits: Limits, field: str) -> str:
    if not value:
        raise InvalidRequest(field, "must not be empty")
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > limits.max_prompt_bytes:
        raise InvalidRequest(
            field, f"is {size} bytes; the limit is {limits.max_prompt_bytes}"
        )
    return utf8(value, field)


def token_ids(ids: Sequence[int], limits: Limits, field: str) -> tuple[int, ...]:
    if not ids:
        raise InvalidRequest(field, "must not be empty")
    for i, t in enumerate(ids):
        if not 0 <= t < limits.vocab_size:
            raise InvalidRequest(
                f"{field}[{i}]",
                f"token id {t} is outside the vocabulary [0, {limits.vocab_size})",
            )
    return tuple(ids)


def prompt_fits(num_tokens: int, limits: Limits, field: str) -> None:
    if num_tokens >= limits.max_model_len:
        raise InvalidRequest(
            field,
            f"prompt is {num_tokens} tokens; the context is {limits.max_model_len} "
            "tokens and at least one must be left to generate",
        )


def sampling(
    *,
    prompt_tokens: int,
    limits: Limits,
    max_tokens: int | None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    logprobs_field: str = "logprobs",
    prefix: str = "",
) -> Sampling:
    """Checks each parameter; ``max_tokens=None`` means up to the context's end."""
    room = limits.max_model_len - prompt_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens <= 0:
        raise InvalidRequest(f"{prefix}max_tokens", f"must be > 0, got {max_tokens}")
    elif max_tokens > room:
        raise InvalidRequest(
            f"{prefix}max_tokens",
            f"{max_tokens} exceeds the {room} tokens left in the context "
            f"({limits.max_model_len}) after the {prompt_tokens}-token prompt",
        )
    if temperature is None:
        temperature = 1.0
    elif not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidRequest(
            f"{prefix}temperature",
            f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}",
        )
    if top_p is None:
        top_p = 1.0
    elif not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest(f"{prefix}top_p", f"must be in (0, 1], got {top_p}")
    if top_k is None or top_k == -1:
        top_k = 0
    elif top_k < 0:
        raise InvalidRequest(
            f"{prefix}top_k", f"must be >= 0 (0 or -1 disables), got {top_k}"
        )
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise InvalidRequest(f"{prefix}seed", "must fit in a signed 64-bit integer")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{prefix}stop", f"at most {MAX_STOP_STRINGS} strings")
    for i, s in enumerate(stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"{prefix}stop[{i}]", f"must be 1-{MAX_STOP_CHARS} characters"
            )
        utf8(s, f"{prefix}stop[{i}]")
    for i, t in enumerate(stop_token_ids):
        if not 0 <= t < limits.vocab_size:
            raise InvalidRequest(
                f"{prefix}stop_token_ids[{i}]",
                f"token id {t} is outside the vocabulary [0, {limits.vocab_size})",
            )
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"{prefix}{logprobs_field}",
            f"must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}",
        )
    return Sampling(
        max_tokens=min(max_tokens, _INT32_MAX),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=bool(ignore_eos),
        logprobs=logprobs,
    )
