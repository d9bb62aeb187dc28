"""``VLLMEngine``: one vLLM ``AsyncLLM`` with priority scheduling, speaking the
``protocol`` dataclasses (requests in, ``EngineEvent`` streams and ``EngineStats``
out). vLLM is imported here and in no module the ingress loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import SpanKind

from cluster import cpu_layout, tracing
from cluster.config import ClusterConfig
from cluster.platform import Backend, EnginePlatform
from cluster.qos import QoS
from deployments.engine.args import (
    check_platform,
    check_started,
    engine_args,
    engine_env,
    sampling_params,
)
from deployments.engine.expert_load import ExpertLoadWindow
from deployments.engine.realtime_board import RealtimeBoard
from deployments.engine.stream_batcher import DeltaBatcher
from deployments.ep import group as ep_group
from deployments.ep.group import GroupRank
from deployments.protocol import (
    EngineEvent,
    EngineRequest,
    EngineStats,
    Finish,
    HandOff,
    RequestRejected,
    Started,
    TokenLogprob,
    ToolCallDelta,
)
from router.types import ExpertLoad, RequestProgress

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("moe_cluster.engine")


@dataclass(slots=True)
class _Running:
    request: EngineRequest
    output_tokens: int = 0
    first_token: bool = False
    handed_off: bool = False


class VLLMEngine:
    """Streams ``EngineEvent``s for ``EngineRequest``s from one ``AsyncLLM``.

    Invariant: every stream opens with ``Started`` and ends with exactly one
    ``Finish``, unless the engine fails (the stream raises); a stream whose
    consumer goes away (cancellation) aborts its engine request before returning.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        replica_id: str,
        stream_interval_s: float = 0.0,
        background_stream_interval_s: float = 0.0,
    ) -> None:
        self._engine = engine
        self.replica_id = replica_id
        self._stream_interval_s = stream_interval_s
        self._background_interval_s = background_stream_interval_s
        self._running: dict[str, _Running] = {}
        self.tokens_generated = 0
        self.warmed = (0, 0)  # prefixes run before taking traffic, tokens loaded
        self.expert_load: ExpertLoadWindow | None = None
        self._started = 0  # requests (and warmup prefills) begun since has_work
        self.platform: EnginePlatform | None = None  # as vLLM runs it, once started
        # Set on every request's span (replica, node, EP group and rank).
        self.span_attributes: dict[str, Any] = {tracing.Attr.REPLICA: replica_id}
        # vLLM takes trace headers only with its otlp_traces_endpoint set.
        self._trace_headers = tracing.traces_endpoint() is not None
        self._tracer = tracing.tracer()
        # engine.background_cpu_yield: the node's board, to wake this replica's
        # engine (idling for realtime elsewhere) before a request it must not
        # keep waiting. Open for the replica's life: closing it would drop the
        # slot of an engine core running in this process (POSIX locks).
        self.board: RealtimeBoard | None = None
        # engine.cpu_cores: the slot of cores its engine computes on, held until
        # shutdown (or this process's end).
        self.cores: cpu_layout.Claim | None = None

    @classmethod
    def start(
        cls,
        config: ClusterConfig,
        replica_id: str,
        kv_events_endpoint: str | None,
        kv_store_socket: str | None = None,
        group: GroupRank | None = None,
    ) -> VLLMEngine:
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.update(engine_env(config.engine))
        backend = check_platform(config.engine)
        parallel = None
        if group is not None:
            parallel = group.engine_kwargs() | ep_group.gpu_engine_kwargs(config)
        gpu_memory = None
        if backend is Backend.GPU and kv_store_socket is not None:
            from vllm.platforms import current_platform

            gpu_memory = current_platform.get_device_total_memory()  # NVML
        args = engine_args(
            config.model.path,
            config.model.served_name,
            config.engine,
            kv_events_endpoint,
            kv_store_socket,
            parallel,
            kv_staging_bytes=config.kvstore.gpu_staging_mib << 20,
            gpu_memory_bytes=gpu_memory,
        )
        from deployments.engine.stat_logger import EngineStatLogger

        # vLLM's metrics under its own names, recorded in this replica's process
        # (ray_vllm_* on Ray's endpoint, with a ReplicaId tag), as Ray Serve LLM
        # records them: its Grafana dashboard joins on them.
        layout = cpu_layout.current() if backend is not Backend.GPU else None
        cores = _claim_cores(layout)
        e = config.engine
        spawning: Any = contextlib.nullcontext()
        if layout is not None:
            one_thread = e.omp_num_threads == 1 and e.executor == "uni"
            spawning = cpu_layout.spawning(layout, cores, one_thread)
        try:
            with spawning:
                engine = AsyncLLM.from_engine_args(
                    args, stat_loggers=[EngineStatLogger]
                )
            try:
                check_started(config.engine, engine.vllm_config)
            except RuntimeError:
                engine.shutdown()
                raise
        except BaseException:
            if cores is not None:
                cores.release()
            raise
        started = cls(
            engine,
            replica_id,
            config.engine.stream_interval_ms / 1000,
            config.engine.background_stream_interval_ms / 1000,
        )
        started.cores = cores
        if config.engine.background_cpu_yield > 0:
            started.board = RealtimeBoard(claim=False)
        cache = engine.vllm_config.cache_config
        started.platform = EnginePlatform(
            backend,
            str(engine.vllm_config.model_config.dtype).removeprefix("torch."),
            cache.block_size,
            bool(cache.enable_prefix_caching),
        )
        logger.info("engine %s: %s", replica_id, started.platform.describe())
        return started

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        A = tracing.Attr
        s = request.sampling
        tracing.REQUEST_ID.set(request.request_id)
        span = self._tracer.start_span(
            "engine.generate",
            kind=SpanKind.INTERNAL,
            attributes=self.span_attributes
            | {
                A.RESPONSE_ID: request.request_id,
                A.QOS: request.qos.name.lower(),
                A.MAX_TOKENS: s.max_tokens,
                A.TEMPERATURE: s.temperature,
                A.TOP_P: s.top_p,
                A.INPUT_TOKENS: len(request.prompt_token_ids),
            },
        )
        events = self._generate(request, span)
        try:
            async for event in events:
                yield event
        except BaseException as e:
            if not isinstance(e, (GeneratorExit, asyncio.CancelledError)):
                tracing.fail(span, e)
            raise
        finally:
            await events.aclose()  # aborts the engine request now, not at GC
            span.end()

    async def _generate(
        self, request: EngineRequest, span: Any
    ) -> AsyncGenerator[EngineEvent, None]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        rid = request.request_id
        s = request.sampling
        running = self._running[rid] = _Running(request)
        self._started += 1
        completion = 0
        finished = False
        headers = tracing.carrier(span) if self._trace_headers else None
        try:
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
            if request.tenant:  # tenants never share (or time) cached prefixes
                prompt["cache_salt"] = request.tenant
            if self.board is not None and request.qos != QoS.BACKGROUND:
                self.board.wake(os.getpid(), realtime=request.qos == QoS.REALTIME)
            outputs = self._engine.generate(
                prompt,
                sampling_params(request.sampling),
                rid,
                priority=int(request.qos),
                trace_headers=headers or None,
            )
            yield Started(self.replica_id)
            batcher = DeltaBatcher(
                self._background_interval_s
                if request.qos == QoS.BACKGROUND
                else self._stream_interval_s
            )
            clock = asyncio.get_running_loop().time
            tools = None
            if request.tool_parser:
                from deployments.engine.tools import ToolCallStream

                tools = ToolCallStream(
                    request.tool_parser, request.tools_json, self._engine.tokenizer
                )
            async for out in outputs:
                if running.handed_off:  # not a failure: it goes on elsewhere
                    attrs = {tracing.Attr.OUTPUT_TOKENS: completion}
                    span.add_event("handed_off", attrs)
                    yield HandOff(self.replica_id)
                    return
                seq = out.outputs[0]
                completion += len(seq.token_ids)
                running.output_tokens = completion
                self.tokens_generated += len(seq.token_ids)
                ids, text = list(seq.token_ids), seq.text
                calls: tuple[ToolCallDelta, ...] = ()
                if tools is not None:
                    text, calls = tools.feed(ids, text)
                    if out.finished:
                        calls += tools.finish()
                logprobs = _logprobs(seq, s.logprobs) if s.logprobs is not None else ()
                delta = batcher.add(ids, text, clock(), logprobs, calls)
                if completion and not running.first_token:
                    running.first_token = True
                    span.add_event("first_token")
                if not out.finished:
                    if delta is not None:
                        yield delta
                else:
                    finished = True
                    _finished_span(span, out, seq.finish_reason, completion)
                    # The last tokens (a delta the batcher let out takes all it
                    # held) say the Finish follows at once, so the direct
                    # stream sends them in one message with it.
                    last = delta if delta is not None else batcher.flush(clock())
                    if last is not None:
                        yield replace(last, finishing=True)
                    reason = _finish_reason(seq.finish_reason)
                    if tools is not None and tools.called and reason == "stop":
                        reason = "tool_calls"
                    yield Finish(
                        reason=reason,
                        prompt_tokens=len(request.prompt_token_ids),
                        completion_tokens=completion,
                        cached_tokens=out.num_cached_tokens or 0,
                        replica_id=self.replica_id,
                    )
        except VLLMClientError as e:
            # vLLM refused the request for what it asks (its parameters), in
            # SamplingParams or when it validates it at the first step: the
            # client's error, which must not count against this replica.
            raise _rejected(e, request) from None
        finally:
            self._running.pop(rid, None)
            dead = getattr(self._engine, "errored", False)
            if not finished and not running.handed_off and not dead:
                # Consumer cancelled or closed the stream: free the engine slot
                # (a dead engine has none, and its abort would only wait; a
                # hand-off aborted it already).
                await self._engine.abort(rid)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def hand_off(self) -> list[str]:
        """Ends every running stream with ``HandOff`` (the replica is stopping):
        each request is aborted in the engine, and its stream ends at the next
        output (vLLM's abort delivers one). Returns their ids."""
        handed = list(self._running)
        for running in self._running.values():
            running.handed_off = True
        if handed:
            await self._engine.abort(handed)
        return handed

    def running_requests(self) -> int:
        """Streams open on this engine (a request between outputs included)."""
        return len(self._running)

    async def prefill(
        self,
        tokens: list[int] | None = None,
        text: str = "",
        tenant: str = "",
        trace_headers: dict[str, str] | None = None,
    ) -> int:
        """Runs a prompt for one token so its pages are loaded (or computed and
        saved); returns how many of its tokens came from cache."""
        from vllm import SamplingParams
        from vllm.inputs import TextPrompt, TokensPrompt

        prompt: Any = (
            TokensPrompt(prompt_token_ids=tokens) if tokens else TextPrompt(prompt=text)
        )
        if tenant:
            prompt["cache_salt"] = tenant
        self._started += 1
        cached = 0
        async for out in self._engine.generate(
            prompt,
            SamplingParams(max_tokens=1),
            f"warmup-{uuid.uuid4().hex}",
            priority=int(QoS.BACKGROUND),
            trace_headers=trace_headers or None,
        ):
            if out.finished:
                cached = out.num_cached_tokens or 0
        return cached

    async def warm(
        self, prompts: list[tuple[list[int] | None, str, str]], timeout_s: float
    ) -> None:
        """Prefills (token ids or text, tenant) prompts before the replica takes
        traffic; ``warmed`` records how many ran and the tokens they loaded."""
        if not prompts:
            return
        t = time.monotonic()
        # A trace of its own (the replica has no request yet): one span, each
        # prefill's vLLM span under it.
        with self._tracer.start_as_current_span(
            "engine.warmup",
            attributes=self.span_attributes
            | {"moe_cluster.warmup.prompts": len(prompts)},
        ) as span:
            headers = tracing.carrier(span) if self._trace_headers else None
            jobs = [
                self.prefill(ids, text, tenant, headers)
                for ids, text, tenant in prompts
            ]
            try:
                cached = await asyncio.wait_for(asyncio.gather(*jobs), timeout_s)
            except TimeoutError as e:
                tracing.fail(span, e, "timeout")
                logger.warning("warmup cut short after %.0f s", timeout_s)
                return
            span.set_attribute("moe_cluster.warmup.cached_tokens", sum(cached))
        self.warmed = (len(jobs), sum(cached))
        logger.info(
            "warmed %d prefixes (%d tokens from the page store) in %.2f s",
            len(jobs),
            sum(cached),
            time.monotonic() - t,
        )

    async def check_health(self) -> None:
        """Raises when the engine core is dead."""
        await self._engine.check_health()

    async def measure_expert_load(self, window_s: float) -> None:
        """Hooks the workers' MoE routers and keeps a rolling window of their
        counts (see ``expert_load``); returns once the hooks are in."""
        [(layers, experts), *_] = await self._engine.collective_rpc(
            "moe_expert_load_install"
        )
        if layers:
            self.expert_load = ExpertLoadWindow(tuple(layers), experts, window_s)

    async def poll_expert_load(self) -> None:
        """Adds the workers' counts since the last poll to the window."""
        if self.expert_load is None:
            return
        [counts, *_] = await self._engine.collective_rpc("moe_expert_load_take")
        self.expert_load.add(time.monotonic(), counts)

    def refresh_metrics(self) -> None:
        """Keeps vLLM's scheduler gauges on Ray's endpoint while the engine idles
        (``stat_logger``)."""
        from deployments.engine import stat_logger

        if (logger := stat_logger.of(self._engine)) is not None:
            logger.refresh(idle=self._engine.get_num_unfinished_requests() == 0)

    def has_work(self) -> bool:
        """Whether a request has run since the last call (or still runs)."""
        started, self._started = self._started, 0
        return started > 0 or self._engine.get_num_unfinished_requests() > 0

    def expert_load_snapshot(self) -> ExpertLoad | None:
        if self.expert_load is None:
            return None
        return self.expert_load.snapshot(time.monotonic())

    def stats(self, node_id: str = "", group: GroupRank | None = None) -> EngineStats:
        """What the engine holds and runs with, on ``node_id``, as ``group``'s rank."""
        p = self.platform
        return EngineStats(
            replica_id=self.replica_id,
            running=self._engine.get_num_unfinished_requests(),
            request_ids=tuple(sorted(self._running)),
            pid=os.getpid(),
            warmed_prefixes=self.warmed[0],
            warmed_cached_tokens=self.warmed[1],
            node_id=node_id,
            group=group.group_id if group else "",
            rank=group.rank if group else 0,
            group_size=group.size if group else 1,
            attention_backend=p.backend.value if p else "",
            dtype=p.dtype if p else "",
            block_size=p.block_size if p else 0,
            prefix_caching=p.prefix_caching if p else False,
        )

    def progress(self) -> tuple[RequestProgress, ...]:
        return tuple(
            RequestProgress(
                rid,
                len(r.request.prompt_token_ids),
                r.output_tokens,
                r.request.sampling.max_tokens,
                r.request.qos,
            )
            for rid, r in self._running.items()
        )

    def shutdown(self) -> None:
        self._engine.shutdown()
        if self.cores is not None:
            self.cores.release()


def _claim_cores(layout: cpu_layout.Layout | None) -> cpu_layout.Claim | None:
    """This node's engine core slot for the engine about to start, where the
    cluster was started with them (``engine.cpu_cores``) and one is free."""
    if layout is None:
        return None
    claim = cpu_layout.Claim.take(layout)
    if claim is None:
        logger.warning(
            "every engine core slot of this node is taken (%s): this engine "
            "runs on any of the node's cores",
            layout.describe(),
        )
    return claim


def _logprobs(seq: Any, k: int) -> tuple[TokenLogprob, ...]:
    """The step's tokens' log probabilities (vLLM gives the sampled token's and
    the top k of each position, the sampled one among them)."""
    out = []
    for token, position in zip(seq.token_ids, seq.logprobs or (), strict=False):
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank)
        chosen = position[token]
        out.append(
            TokenLogprob(
                int(token),
                chosen.decoded_token or "",
                float(chosen.logprob),
                int(chosen.rank),
                tuple(
                    (int(t), lp.decoded_token or "", float(lp.logprob))
                    for t, lp in ranked
                    if lp.rank <= k
                ),
            )
        )
    return tuple(out)


def _rejected(e: Exception, request: EngineRequest | None = None) -> RequestRejected:
    """The client's error. vLLM names no parameter when a constraint fails to
    compile (every other parameter the ingress checked already): it is the
    constraint's, named as the client spelled it."""
    parameter = getattr(e, "parameter", None)
    constraint = request.sampling.structured if request is not None else None
    if parameter is None and constraint is not None:
        parameter = constraint.field
    return RequestRejected(str(e), parameter)


def _finished_span(span: Any, out: Any, reason: str | None, completion: int) -> None:
    """The finished request's usage and where its engine time went (vLLM's
    request stats: queued in the scheduler, prefill, decode)."""
    A = tracing.Attr
    attributes: dict[str, Any] = {
        A.FINISH_REASONS: [_finish_reason(reason)],
        A.OUTPUT_TOKENS: completion,
        A.CACHED_TOKENS: out.num_cached_tokens or 0,
    }
    m = getattr(out, "metrics", None)
    if m is not None and m.scheduled_ts:
        attributes[A.ENGINE_QUEUED] = max(0.0, m.scheduled_ts - m.queued_ts)
        if m.first_token_ts:
            attributes[A.ENGINE_PREFILL] = max(0.0, m.first_token_ts - m.scheduled_ts)
            attributes[A.ENGINE_DECODE] = max(0.0, m.last_token_ts - m.first_token_ts)
            attributes[A.ENGINE_TTFT] = m.first_token_latency
    span.set_attributes(attributes)


def _finish_reason(reason: str | None) -> Any:
    # vLLM says "stop" for EOS/stop strings, "length" for max_tokens, "abort".
    return reason if reason in ("stop", "length", "abort") else "stop"
