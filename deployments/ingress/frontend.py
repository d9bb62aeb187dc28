"""What the ingress does for every request, whatever the protocol.

Authenticates, tokenizes, opens the engine stream, keeps the in-flight table that
``Abort`` uses, enforces the time-to-first-token deadline and turns engine and
Serve failures into client-facing ``ServiceError``s. Independent of Serve's
ingress wiring: the engine is reached through an injected ``open_stream``.

A replica whose node is lost takes its actors with it silently: Ray declares
them dead only when the node misses its health checks (~15 s), and until then
a stream from one just waits. The router drops a replica whose reports stop
(``router.replica_stale_s``) and says so (``Admission.watch_lost``); a stream
still waiting on such a replica, silent for ``LOST_SILENCE_S``, is then ended
here as that engine's failure (its task is cancelled at the wait and the
cancellation turned into ``EngineFailed``, as ``asyncio.timeout`` turns one into
``TimeoutError``) and goes on elsewhere, as any failed stream does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ray.serve.exceptions import BackPressureError, RequestCancelledError

from cluster import tracing
from cluster.checkpoint import Checkpoint
from cluster.tracing import Attr
from deployments.ingress import resume, structured
from deployments.ingress.errors import (
    CLIENT_ERRORS,
    AlreadyInFlight,
    DeadlineMissed,
    EngineUnavailable,
    Overloaded,
    PermissionDenied,
    Unauthenticated,
)
from deployments.ingress.resume import ResumedText
from deployments.ingress.telemetry import RequestTelemetry
from deployments.ingress.validation import InvalidRequest, Limits
from deployments.protocol import (
    EngineEvent,
    EngineFailed,
    EngineLost,
    EngineRequest,
    Finish,
    FinishReason,
    HandedOff,
    HandOff,
    RequestRejected,
    Started,
    TokenDelta,
)
from router.tickets import TicketMaker
from router.types import Outcome, Release, ReplicaId, RouteDecision, Shed, Ticket

logger = logging.getLogger("moe_cluster.ingress")

OVERLOAD_RETRY_S = 1.0
OPEN_ATTEMPTS = 3  # engine failures before the first output are retried
ADMIT_GRACE_S = 1.0
LOST_SILENCE_S = 1.0  # a lost replica's stream silent this long is ended
LOST_SWEEP_S = 0.25  # how often streams on lost replicas are looked at
LOST_MEMORY_S = 60.0  # a lost replica is forgotten after this long


class EngineStream(Protocol):
    def __aiter__(self) -> AsyncIterator[EngineEvent]: ...
    def cancel(self) -> None: ...


OpenStream = Callable[[EngineRequest], EngineStream]


class Admission(Protocol):
    """The DeepSeekRouter as the ingress sees it."""

    tickets: TicketMaker

    async def admit(self, ticket: Ticket) -> RouteDecision:
        """Waits until the request may run and says where; raises ``Shed``."""
        ...

    def release(self, release: Release) -> None: ...

    def watch_lost(self, on_lost: Callable[[list[str]], None]) -> None:
        """Calls ``on_lost`` with the replicas the router drops because their
        reports stopped, from now on."""
        ...


@dataclass(frozen=True, slots=True)
class Credential:
    """What an authenticated request may name: its key's tenants (``"*"``: any).
    The first is the tenant of a request that names none."""

    tenants: tuple[str, ...]

    def allows(self, tenant: str) -> bool:
        return tenant in self.tenants or "*" in self.tenants

    def tenant(self, requested: str) -> str:
        """The tenant a request runs as; raises ``PermissionDenied`` for one its
        key does not allow (it would share, or time, that tenant's cache)."""
        if not requested:
            return "" if self.tenants[0] == "*" else self.tenants[0]
        if not self.allows(requested):
            raise PermissionDenied(
                f"tenant {requested!r} is not allowed for this API key"
            )
        return requested


ANY_TENANT = Credential(("*",))  # no API keys configured: nothing to bind


@dataclass(slots=True)
class _Placement:
    replica_id: str  # where the router put it; then where it actually started
    dispatched_at: float
    started: bool = False
    ttft_s: float | None = None
    expert_hist: tuple[int, ...] = ()
    trace: tuple[tuple[str, str], ...] = ()
    # While the stream's task waits for the engine's next event: since when,
    # and that task (to end the wait if the replica is lost).
    waiting_since: float | None = None
    task: asyncio.Task[Any] | None = None
    cut: bool = False  # the task was cancelled because the replica is lost


async def _next_event(
    events: AsyncIterator[EngineEvent], timeout: float | None, watch: _Placement | None
) -> EngineEvent:
    """The stream's next event, within ``timeout``, its wait watched."""
    if watch is None:
        return await asyncio.wait_for(anext(events), timeout)
    _waiting(watch)
    try:
        event = await asyncio.wait_for(anext(events), timeout)
    except BaseException as e:
        if _cut_off(watch, e):
            raise _lost(watch) from None
        raise
    finally:
        watch.waiting_since = None
    if watch.cut:  # the cancel was absorbed on the way: the stream goes on
        _cut_off(watch, None)
    return event


def _waiting(watch: _Placement) -> None:
    watch.task = asyncio.current_task()
    watch.waiting_since = asyncio.get_running_loop().time()


def _cut_off(watch: _Placement, e: BaseException | None) -> bool:
    """After a wait the sweeper cut (cancelled its task at the wait): takes
    that cancel back, and says whether the wait ended because of it, so that
    the stream ends as its engine's failure. Not when the task is also being
    cancelled for itself (that cancel goes on), nor when the wait ended some
    other way (``e`` None: an event came; the stream's end)."""
    if not watch.cut:
        return False
    watch.cut = False
    task = asyncio.current_task()
    if task is None or task.uncancel() > 0:
        return False
    return e is not None and not isinstance(e, StopAsyncIteration)


def _lost(watch: _Placement) -> EngineFailed:
    return EngineFailed(f"replica {watch.replica_id} was lost")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What clients may ask about the served model (read from config.json)."""

    name: str
    architecture: str
    max_context: int
    vocab_size: int
    num_layers: int
    num_moe_layers: int
    num_routed_experts: int
    num_shared_experts: int
    experts_per_token: int
    num_expert_groups: int
    topk_groups: int

    @classmethod
    def from_checkpoint(cls, path: str, name: str, max_model_len: int) -> ModelFacts:
        ckpt = Checkpoint.read(path)
        return cls(
            name=name,
            architecture=ckpt.architecture,
            max_context=min(max_model_len, ckpt.max_positions),
            vocab_size=ckpt.vocab_size,
            num_layers=ckpt.num_layers,
            num_moe_layers=ckpt.num_moe_layers,
            num_routed_experts=ckpt.num_routed_experts,
            num_shared_experts=ckpt.num_shared_experts,
            experts_per_token=ckpt.experts_per_token,
            num_expert_groups=ckpt.num_expert_groups,
            topk_groups=ckpt.topk_groups,
        )


class _NotOpen:
    """Placeholder in the in-flight table while a request's stream opens."""

    def __init__(self, waiting: asyncio.Future[Any] | None = None) -> None:
        self.waiting = waiting  # the admission wait, cancelled by an abort

    def cancel(self) -> None:
        if self.waiting is not None:
            self.waiting.cancel()

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        raise RuntimeError("not open")


_NOT_OPEN = _NotOpen()


# Raised by a stream for the client's or the deadline's sake, not an engine's.
_NOT_ENGINE_FAILURES = (
    *CLIENT_ERRORS,
    RequestRejected,
    RequestCancelledError,
    asyncio.CancelledError,
    TimeoutError,
    BackPressureError,
)


def _raise_ended(event: HandOff | EngineLost) -> None:
    """A replica ended the stream early: it is stopping (a hand-off, not its
    failure) or its engine died (its failure). The request goes on elsewhere."""
    if isinstance(event, HandOff):
        raise HandedOff(f"replica {event.replica_id} stopped")
    raise EngineFailed(f"engine of {event.replica_id} died")


def _outcome_of(e: Exception) -> Outcome:
    """How a stream that raised ``e`` on its replica ended, for the router."""
    return Outcome.HANDED_OFF if isinstance(e, HandedOff) else Outcome.FAILED


def _unresumable() -> EngineUnavailable:
    return EngineUnavailable(
        "the engine replica serving this request failed and it could not be "
        "resumed on another; the tokens sent so far stand; retry for the rest"
    )


def _tokenize_span() -> Any:
    return tracing.tracer().start_as_current_span("ingress.tokenize")


def _cancel(stream: EngineStream) -> None:
    """Best-effort cancel: Serve re-raises a request's assignment failure (e.g.
    BackPressureError) from ``cancel()`` when there is nothing left to cancel."""
    with contextlib.suppress(Exception):
        stream.cancel()


async def _chain(
    head: list[EngineEvent],
    rest: AsyncIterator[EngineEvent],
    watch: _Placement | None = None,
) -> AsyncIterator[EngineEvent]:
    for event in head:
        yield event
    if watch is None:
        async for event in rest:
            yield event
        return
    while True:
        try:
            event = await _next_event(rest, None, watch)
        except StopAsyncIteration:
            return
        yield event


class Frontend:
    def __init__(
        self,
        *,
        tokenizer: Any,
        facts: ModelFacts,
        limits: Limits,
        api_keys: Iterable[str | tuple[str, Sequence[str]]],
        open_stream: OpenStream,
        admission: Admission | None = None,
        migration_limit: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        # tool_choice auto needs the tool-call tokens vLLM's parser looks for.
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.parses_tool_calls = structured.TOOL_CALLS_BEGIN in vocab
        self.facts = facts
        self.limits = limits
        # (key, its tenants); a bare key allows the default tenant only.
        self._api_keys = tuple(
            (k.encode(), Credential(("",)))
            if isinstance(k, str)
            else (k[0].encode(), Credential(tuple(k[1])))
            for k in api_keys
        )
        self._tenants: dict[str, str] = {}  # in-flight request id -> its tenant
        self._open_stream = open_stream
        self._admission = admission
        # Times a stream may move to another replica when its engine fails.
        self._migration_limit = migration_limit
        self._inflight: dict[str, EngineStream] = {}  # request id -> open stream
        self._aborted: set[str] = set()
        self._placed: dict[str, _Placement] = {}  # requests the router dispatched
        self._lost: dict[str, float] = {}  # replicas the router lost -> when
        self._sweeper: asyncio.Task[None] | None = None
        self._watching_lost = False

    # -- admission -----------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Credential:
        """Accepts ``Bearer KEY`` (or a bare key) when keys are configured;
        returns what the key allows."""
        if not self._api_keys:
            return ANY_TENANT
        if not authorization:
            raise Unauthenticated("missing API key (Authorization: Bearer KEY)")
        presented = (
            authorization.removeprefix("Bearer ").strip().encode("utf-8", "replace")
        )
        # compare_digest against every key, each time: timing reveals nothing
        # about which key matched, or how much of one.
        found: Credential | None = None
        for key, credential in self._api_keys:
            if hmac.compare_digest(presented, key):
                found = credential
        if found is None:
            raise Unauthenticated("invalid API key")
        return found

    def bind(self, credential: Credential, request: EngineRequest) -> EngineRequest:
        """``request`` as the tenant its credential allows (the key's default when
        it names none); ``PermissionDenied`` for another tenant."""
        tenant = credential.tenant(request.tenant)
        if tenant == request.tenant:
            return request
        return dataclasses.replace(request, tenant=tenant)

    def encode_text(self, text: str) -> list[int]:
        """A text prompt's ids as vLLM's completions make them: with the
        tokenizer's special tokens (DeepSeek's BOS), so a prompt sent here and to
        bare vLLM reaches the engine as the same ids."""
        with _tokenize_span() as span:
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True)
            span.set_attribute(Attr.PROMPT_TOKENS, len(ids))
        return ids

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        field: str,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat template's prompt for ``messages`` (and ``tools``, which the
        template lists for the model)."""
        with _tokenize_span() as span:
            try:
                ids = self.tokenizer.apply_chat_template(
                    list(messages),
                    tools=tools,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            except Exception as e:  # a template raising on odd input: client error
                raise InvalidRequest(
                    field, f"chat template rejected the messages: {e}"
                ) from None
            span.set_attribute(Attr.PROMPT_TOKENS, len(ids))
        return [int(t) for t in ids]

    # -- streaming -----------------------------------------------------------

    def stream(
        self,
        request: EngineRequest,
        deadline_s: float | None = None,
        telemetry: RequestTelemetry | None = None,
    ) -> AsyncGenerator[EngineEvent, None]:
        """Engine events of ``request``; ends with one ``Finish`` or raises.

        ``deadline_s`` bounds the wait for the first token. An ``abort`` ends the
        stream with ``Finish(reason="abort")``. ``telemetry`` (the request's span)
        is told what happens and ended with the stream.
        """
        events = self._stream(request, deadline_s, telemetry)
        return events if telemetry is None else self._observed(events, telemetry)

    async def _observed(
        self, events: AsyncGenerator[EngineEvent, None], tel: RequestTelemetry
    ) -> AsyncGenerator[EngineEvent, None]:
        """``events``, each told to the request's telemetry, which ends with them."""
        try:
            async for event in events:
                if isinstance(event, TokenDelta):
                    tel.first_token()
                elif isinstance(event, Started):
                    tel.started(event.replica_id)
                elif isinstance(event, Finish):
                    tel.finished(event)
                yield event
        except Shed as e:
            tel.failed(e, f"shed:{e.reason}")
            raise
        except Exception as e:
            tel.failed(e)
            raise
        finally:
            await events.aclose()
            tel.end()

    async def _stream(
        self,
        request: EngineRequest,
        deadline_s: float | None,
        tel: RequestTelemetry | None,
    ) -> AsyncGenerator[EngineEvent, None]:
        rid = request.request_id
        if rid in self._inflight:
            raise AlreadyInFlight(f"request_id {rid!r} is already in flight")
        self._inflight[rid] = _NOT_OPEN
        self._tenants[rid] = request.tenant
        replica = ""
        sent: list[int] = []  # output tokens the client has
        shown: list[str] = []  # and their text
        migrations = 0
        resumed: ResumedText | None = None  # the text past a migration
        current = request
        done = False
        outcome = Outcome.CANCELLED  # unless it finishes, or the replica fails it

        def final(reason: FinishReason, cached: int = 0) -> Finish:
            return Finish(
                reason,
                len(request.prompt_token_ids),
                len(sent),
                cached,
                replica,
                migrations=migrations,
            )

        try:
            while True:
                try:
                    events, head = await self._open(
                        current,
                        deadline_s,
                        tel,
                        resumed=migrations > 0,
                        avoid=replica if migrations else "",
                    )
                    watch = self._placed.get(rid)
                    async for event in _chain(head, events, watch):
                        if rid in self._aborted:
                            # abort() cancelled the engine stream; what it still
                            # delivers (its Finish among it) is not the client's.
                            break
                        stopped = False
                        if isinstance(event, Started):
                            replica = event.replica_id
                        elif isinstance(event, TokenDelta):
                            if resumed is not None:
                                event, stopped = resumed.delta(event)
                            sent.extend(event.token_ids)
                            shown.append(event.text)
                        elif isinstance(event, Finish):
                            if resumed is not None and (rest := resumed.flush()):
                                yield TokenDelta((), rest)
                            # Served, even if the caller stops reading at its
                            # Finish (the HTTP handlers close the stream there).
                            done, outcome = True, Outcome.OK
                            placed = self._placed.get(rid)
                            hist = placed.expert_hist if placed else ()
                            event = dataclasses.replace(
                                final(event.reason, event.cached_tokens),
                                expert_hist=hist or event.expert_hist,
                            )
                        elif isinstance(event, HandOff | EngineLost):
                            _raise_ended(event)
                        yield event
                        if stopped:  # a stop string that straddled the seam
                            done, outcome = True, Outcome.OK
                            _cancel(self._inflight.get(rid, _NOT_OPEN))
                            yield final("stop")
                            break
                    break
                except Exception as e:
                    if not sent or not self._may_migrate(e, request, migrations):
                        raise
                    if len(sent) >= request.sampling.max_tokens:
                        # It failed after its last token: the client has it all.
                        self._settle(rid, Outcome.FAILED)
                        done = True
                        yield final("length")
                        break
                    migrations += 1
                    # A failure counts against the replica; a hand-off does not.
                    self._settle(rid, _outcome_of(e))
                    _cancel(self._inflight.get(rid, _NOT_OPEN))
                    logger.warning(
                        "request %s: replica %r failed or stopped after %d tokens "
                        "(%r); resuming it elsewhere (migration %d of at most %d)",
                        rid,
                        replica,
                        len(sent),
                        e,
                        migrations,
                        self._migration_limit,
                    )
                    if tel is not None:
                        tel.migrated(replica, len(sent), e)
                    current = resume.continuation(request, sent)
                    resumed = ResumedText(
                        self.tokenizer, sent, "".join(shown), request.sampling.stop
                    )
            if rid in self._aborted and not done:
                done = True
                yield final("abort")
                return
            if not done:
                raise EngineUnavailable("engine stream ended without finishing")
            outcome = Outcome.OK
        except (RequestCancelledError, asyncio.CancelledError):
            if rid not in self._aborted:
                raise
            done = True
            yield final("abort")
        except TimeoutError:
            placed = self._placed.get(rid)
            if placed is not None and not placed.started:
                outcome = Outcome.TIMEOUT  # the replica never took it: stuck
            if sent:  # its resumption missed the first-token deadline
                raise _unresumable() from None
            raise DeadlineMissed(
                f"no first token within deadline_ms={round((deadline_s or 0) * 1000)}"
            ) from None
        except BackPressureError:
            if sent:
                raise _unresumable() from None
            raise Overloaded(
                "all engine replicas are at capacity; retry later",
                retry_after_s=OVERLOAD_RETRY_S,
            ) from None
        except Shed as e:
            if sent:  # no replica could take the rest of the stream
                raise _unresumable() from e
            raise
        except CLIENT_ERRORS:
            raise
        except RequestRejected as e:  # the engine refused what the request asks
            outcome = Outcome.REJECTED
            raise InvalidRequest(e.parameter or "request", str(e)) from None
        except Exception as e:
            outcome = Outcome.FAILED
            logger.warning("request %s failed on replica %r: %r", rid, replica, e)
            if sent:
                raise _unresumable() from None
            raise EngineUnavailable(
                "the engine replica serving this request failed; retry"
            ) from None
        finally:
            stream = self._inflight.pop(rid, _NOT_OPEN)
            self._tenants.pop(rid, None)
            self._aborted.discard(rid)
            if not done:
                _cancel(stream)
            self._settle(rid, outcome)

    def _may_migrate(
        self, e: Exception, request: EngineRequest, migrations: int
    ) -> bool:
        """Whether a stream that raised ``e`` after its client got tokens goes on
        on another replica: an engine failure (not the client's error, not a
        cancel or a missed deadline), with migrations left to spend. A stream
        whose output is constrained or parsed does not: the grammar's and the
        tool parser's state would start again at the seam (vLLM cannot advance
        a grammar over prompt tokens)."""
        if isinstance(e, _NOT_ENGINE_FAILURES) or request.request_id in self._aborted:
            return False
        if request.sampling.structured is not None or request.tool_parser:
            return False
        return migrations < self._migration_limit

    async def _admit(
        self,
        request: EngineRequest,
        deadline: float | None,
        tel: RequestTelemetry | None,
        *,
        resumed: bool = False,
        avoid: str = "",
    ) -> EngineRequest:
        """Waits for the router to dispatch ``request``; returns it placed
        (elsewhere than ``avoid``, the replica it just failed on, if it can)."""
        if self._admission is None:
            return request
        if not self._watching_lost:  # the first request: follow lost replicas
            self._watching_lost = True
            self._admission.watch_lost(self.replicas_lost)
        loop = asyncio.get_running_loop()
        remaining = None if deadline is None else max(deadline - loop.time(), 1e-3)
        trace = tel.carrier() if tel is not None else {}
        ticket = self._admission.tickets.make(
            request.request_id,
            request.qos,
            request.prompt_token_ids,
            request.sampling.max_tokens,
            remaining,
            request.tenant,
            trace,
            resumed,
            avoid,
        )
        waiting = asyncio.ensure_future(self._admission.admit(ticket))
        self._inflight[request.request_id] = _NotOpen(waiting)
        try:
            # The router sheds what cannot meet its deadline; the grace only
            # guards against a router that does not answer.
            limit = None if remaining is None else remaining + ADMIT_GRACE_S
            decision = await asyncio.wait_for(waiting, limit)
        except (asyncio.CancelledError, TimeoutError):
            # Aborted, disconnected or out of time while queued: leave the queue.
            self._admission.release(Release(request.request_id, Outcome.CANCELLED))
            raise
        self._placed[request.request_id] = _Placement(
            decision.replica_id,
            loop.time(),
            expert_hist=decision.expert_hist,
            trace=ticket.trace,
        )
        return dataclasses.replace(request, replica_id=decision.replica_id)

    def _settle(self, rid: str, outcome: Outcome) -> None:
        placed = self._placed.pop(rid, None)
        if placed is None or self._admission is None:
            return
        replica = ReplicaId(placed.replica_id)
        self._admission.release(
            Release(rid, outcome, replica, placed.ttft_s, placed.trace)
        )

    async def _open(
        self,
        request: EngineRequest,
        deadline_s: float | None,
        tel: RequestTelemetry | None = None,
        *,
        resumed: bool = False,
        avoid: str = "",
    ) -> tuple[AsyncIterator[EngineEvent], list[EngineEvent]]:
        """Admits the request, opens its engine stream and reads up to its first
        output. ``resumed``: it goes on from a failed stream (rate limits charged
        it already) on ``avoid``, a replica it is placed away from if it can be.

        Returns the stream's remaining events and those already read. An engine
        failure before any output is retried on a fresh stream (the router
        places it on another replica if one has room): nothing has reached the
        client yet.
        """
        rid = request.request_id
        loop = asyncio.get_running_loop()
        deadline = None if deadline_s is None else loop.time() + deadline_s
        for attempt in range(1, OPEN_ATTEMPTS + 1):
            placed_request = await self._admit(
                request, deadline, tel, resumed=resumed or attempt > 1, avoid=avoid
            )
            if tel is None:
                stream = self._open_stream(placed_request)
            else:
                with tel.current():  # Serve's handle call: a child of this request
                    stream = self._open_stream(placed_request)
            self._inflight[rid] = stream
            events = aiter(stream)
            head: list[EngineEvent] = []
            watch = self._placed.get(rid)
            try:
                while not head or isinstance(head[-1], Started):
                    timeout = None if deadline is None else deadline - loop.time()
                    head.append(await _next_event(events, timeout, watch))
                    if isinstance(head[-1], HandOff | EngineLost):  # no output yet
                        _raise_ended(head[-1])
                    self._mark(rid, head[-1], loop.time())
                return events, head
            except StopAsyncIteration:
                return events, head
            except (
                RequestCancelledError,
                BackPressureError,
                TimeoutError,
                RequestRejected,  # the same request would be refused again
            ):
                raise
            except Exception as e:
                _cancel(stream)
                if attempt == OPEN_ATTEMPTS or rid in self._aborted:
                    raise
                placed = self._placed.get(rid)
                avoid = placed.replica_id if placed else placed_request.replica_id
                self._settle(rid, _outcome_of(e))
                logger.warning(
                    "request %s: engine failed before output (%r); retrying", rid, e
                )
        raise AssertionError("unreachable")

    def replicas_lost(self, replica_ids: Iterable[str]) -> None:
        """The router dropped these replicas: their reports stopped. Streams
        still waiting on them are ended as their engine's failure once silent
        for ``LOST_SILENCE_S`` (a live replica's streams go on)."""
        loop = asyncio.get_running_loop()
        for r in replica_ids:
            self._lost[r] = loop.time()
        logger.warning(
            "replicas lost (no reports): %s; resuming their silent streams",
            ", ".join(replica_ids),
        )
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep_lost())

    async def _sweep_lost(self) -> None:
        loop = asyncio.get_running_loop()
        while self._lost:
            now = loop.time()
            waiting = False
            for rid, placed in self._placed.items():
                if placed.replica_id not in self._lost:
                    continue
                waiting = True
                since, task = placed.waiting_since, placed.task
                if (
                    since is not None
                    and now - since >= LOST_SILENCE_S
                    and task is not None
                    and not placed.cut
                ):
                    placed.cut = True
                    logger.warning(
                        "request %s: replica %s is lost and its stream silent "
                        "for %.1f s; ending it there",
                        rid,
                        placed.replica_id,
                        now - since,
                    )
                    task.cancel()
            for r, at in list(self._lost.items()):
                if not waiting or now - at > LOST_MEMORY_S:
                    del self._lost[r]
            await asyncio.sleep(LOST_SWEEP_S)

    def _mark(self, rid: str, event: EngineEvent, now: float) -> None:
        placed = self._placed.get(rid)
        if placed is None:
            return
        if isinstance(event, Started):
            placed.started = True
            placed.replica_id = event.replica_id  # Serve may have had to move it
        elif placed.ttft_s is None:
            placed.ttft_s = now - placed.dispatched_at

    def abort(self, request_id: str, credential: Credential = ANY_TENANT) -> bool:
        """Cancels an in-flight request; False when none has that id (or none
        of a tenant ``credential`` allows: another tenant's is not there)."""
        stream = self._inflight.get(request_id)
        if stream is None or not credential.allows(self._tenants.get(request_id, "")):
            return False
        self._aborted.add(request_id)
        _cancel(stream)
        return True

    def in_flight(self) -> list[str]:
        return sorted(self._inflight)
