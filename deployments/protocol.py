"""The contract between the ingress and the engine replicas.

Plain frozen dataclasses: they cross Ray process boundaries and import neither
vLLM nor protobuf, so the ingress never loads the engine's dependencies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from cluster.qos import QoS

FinishReason = Literal["stop", "length", "abort", "tool_calls"]
StructuredKind = Literal["json", "regex", "choice", "grammar", "json_object"]


@dataclass(frozen=True, slots=True)
class Structured:
    """A constraint on the output, enforced by the engine's grammar backend.

    ``json``: a JSON schema (as JSON text); ``regex``; ``grammar`` (EBNF);
    ``choice``: one of ``choices``; ``json_object``: any JSON object. ``field``
    names the request field it came from, for the engine's refusal."""

    kind: StructuredKind
    value: str = ""
    choices: tuple[str, ...] = ()
    field: str = ""


@dataclass(frozen=True, slots=True)
class Sampling:
    """Validated sampling parameters (see ``validation.py`` for the bounds)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured: Structured | None = None
    # Log probabilities: None none; k >= 0 the sampled token's and the top k.
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    qos: QoS = QoS.NORMAL
    tenant: str = ""
    replica_id: str = ""  # where the DeepSeekRouter placed it ("" = anywhere)
    # The engine parses tool calls out of the output with this vLLM tool parser
    # ("": none), for these tools (OpenAI ``tools`` as JSON text).
    tool_parser: str = ""
    tools_json: str = ""


@dataclass(frozen=True, slots=True)
class Started:
    """First event of every stream: the engine replica accepted the request."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log probability, its rank in the vocabulary (1 is the
    most likely) and the ``top`` most likely tokens there: (id, text, logprob)."""

    token_id: int
    text: str
    logprob: float
    rank: int
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of the ``index``-th tool call of a response: its id and name come
    with the first piece, its arguments (JSON text) in pieces."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def merge_tool_calls(calls: Sequence[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """Pieces of the same call joined (id and name from the first that has them,
    arguments concatenated), in order of first appearance."""
    merged: dict[int, ToolCallDelta] = {}
    for c in calls:
        m = merged.get(c.index)
        merged[c.index] = (
            c
            if m is None
            else ToolCallDelta(
                c.index, m.id or c.id, m.name or c.name, m.arguments + c.arguments
            )
        )
    return tuple(merged.values())


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one request and their text (incrementally detokenized).

    With a tool parser, ``text`` is the content outside tool calls and
    ``tool_calls`` the calls parsed so far; ``logprobs``: one per token, when
    the request asked for them. ``finishing``: the stream's ``Finish`` comes
    right after it (the engine output that ended the request), so a hop may
    pass the two on together."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finishing: bool = False


@dataclass(frozen=True, slots=True)
class Finish:
    """Last event of every stream."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    replica_id: str
    expert_hist: tuple[int, ...] = ()  # the router's predicted expert hits
    migrations: int = 0  # times the stream moved to another replica


class RequestRejected(Exception):
    """The engine refused the request for what it asks (vLLM's validation of its
    parameters), before running it: the client's error, not the replica's.
    ``parameter``: vLLM's name of the refused parameter, where it says."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter

    def __reduce__(self) -> tuple[type[RequestRejected], tuple[str, str | None]]:
        return (RequestRejected, (str(self), self.parameter))


@dataclass(frozen=True, slots=True)
class HandOff:
    """Last event of a stream its replica handed off: Serve is stopping the
    replica and its drain timeout ran out before the stream finished. The ingress
    resumes the request on another replica from the tokens already sent."""

    replica_id: str


class HandedOff(Exception):
    """Raised in the ingress for a ``HandOff``: not the replica's failure."""


@dataclass(frozen=True, slots=True)
class EngineLost:
    """Last event of a stream whose replica's vLLM engine died; the replica exits
    right after. An event rather than an error: a stream's events reach the
    ingress as they are yielded, while the error that ends a Serve stream came
    only with the replica's exit, seconds later. The ingress resumes the request
    on another replica, and the router counts a failure of this one."""

    replica_id: str


class EngineFailed(Exception):
    """Raised in the ingress for an ``EngineLost``: the replica's failure."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    replica_id: str
    running: int  # requests the engine holds (scheduled or waiting)
    request_ids: tuple[str, ...] = field(default=())
    pid: int = 0  # the replica's process; the engine core is its child
    warmed_prefixes: int = 0  # prefixes run at start, before taking traffic
    warmed_cached_tokens: int = 0  # of their tokens, those loaded from the store
    node_id: str = ""  # the Ray node the replica runs on
    group: str = ""  # EP group this replica is a rank of ("": none)
    rank: int = 0
    group_size: int = 1
    # What the engine runs with, read back from vLLM once it started.
    attention_backend: str = ""
    dtype: str = ""
    block_size: int = 0
    prefix_caching: bool = False


@dataclass(frozen=True, slots=True)
class Pin:
    """Sends a call that carries no ``EngineRequest`` (``stats``) to the replica
    ``replica_id``; one that has left answers from another (check the reply's
    ``replica_id``)."""

    replica_id: str


EngineEvent = Started | TokenDelta | Finish | HandOff | EngineLost
