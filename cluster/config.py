"""The one user-facing configuration: a YAML file validated by pydantic.

The same file drives ``moe-cluster serve`` and the KubeRay ``RayService`` in ``k8s/``.
Unknown keys are errors at every level, so a typo fails at load, not at 3 a.m.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from cluster import platform
from cluster.qos import QoS

DEFAULT_TINY_MODEL_DIR = ".models/tiny-deepseek-v2"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    path: str = Field(
        DEFAULT_TINY_MODEL_DIR,
        description="Hugging Face checkpoint directory (DeepSeek-V2/V3 architecture). "
        "Relative paths are resolved against the working directory at load.",
    )
    served_name: str = Field(
        "tiny-deepseek-v2",
        min_length=1,
        description="Model name clients pass in OpenAI requests and see in model info.",
    )
    build_tiny_if_missing: bool = Field(
        False,
        description="Write the built-in tiny DeepSeek-V2 checkpoint at `path` when the "
        "directory does not exist yet.",
    )


class EngineConfig(_Strict):
    attention_backend: str = Field(
        "auto",
        description="vLLM attention backend. auto: AMX_MLA on CPUs with AMX, the "
        "reference CPU_MLA on other CPUs, vLLM's own choice on GPUs. AMX_MLA or "
        "CPU_MLA force one on CPU (CPU_MLA runs on every CPU).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weight and activation dtype passed to vLLM. auto: bfloat16 "
        "on AMX_MLA, float32 on CPU_MLA, the checkpoint's on GPU.",
    )
    max_model_len: int = Field(
        2048, gt=0, description="Context length in tokens (prompt plus output)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        gt=0,
        description="KV cache size per engine in bytes; overrides "
        "gpu_memory_utilization. On CPU this is host memory.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of accelerator memory for the engine; on vLLM's CPU "
        "backend the fraction of host memory for the KV cache (keep it small there).",
    )
    max_num_seqs: int = Field(64, gt=0, description="Most sequences in one batch.")
    realtime_batch_mates: int | None = Field(
        None,
        ge=0,
        description="While a realtime request is in the engine, at most this many "
        "background requests decode in its batch and no new background prefill "
        "starts; the rest keep their KV and pause until no realtime request is "
        "left. Realtime decodes at close to its speed alone. None: off (vLLM "
        "batches every class together).",
    )
    background_cpu_yield: float = Field(
        0.0,
        ge=0,
        le=0.9,
        description="CPU nodes, whose engines share the cores: while another "
        "engine on the node holds a realtime request, an engine holding only "
        "background requests idles this fraction of its time, and the cores go "
        "to the realtime one. 0: off.",
    )
    background_prefill_tokens: int | None = Field(
        None,
        gt=0,
        description="While only background requests have prompt tokens to "
        "compute, an engine step computes at most this many of them (besides one "
        "token per running request), so a realtime request arriving mid-step "
        "waits for a short step, not for a burst of background prompts; the rest "
        "follow in the next steps. Where vLLM does not chunk prompts (MLA on a "
        "CPU without AMX) a step takes whole prompts up to this many tokens, and "
        "at least one. None: vLLM's max_num_batched_tokens.",
    )
    block_size: int | Literal["auto"] = Field(
        "auto",
        description="Tokens per KV block, and per page of the KV store. auto: 128 "
        "on AMX_MLA (any multiple of 32 runs), 16 on CPU_MLA (the only size it "
        "runs), 64 on GPU.",
    )
    tensor_parallel_size: int = Field(1, gt=0, description="Tensor-parallel ranks.")
    enforce_eager: bool = Field(
        False, description="Disable graph capture (faster start, slower decode on GPU)."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV blocks of shared prompt prefixes in the engine."
    )
    stream_interval_ms: float = Field(
        50.0,
        ge=0,
        description="Streamed tokens of a request are sent at most every this many "
        "milliseconds (the first at once): fewer messages through Ray at high "
        "concurrency. 0 sends every engine step.",
    )
    background_stream_interval_ms: float = Field(
        500.0,
        ge=0,
        description="stream_interval_ms for background requests: batch jobs want "
        "throughput, not smooth streaming, and every message they save is proxy "
        "and ingress time realtime streams get instead.",
    )
    cpu_omp_threads_bind: str = Field(
        "nobind",
        description="vLLM CPU backend: VLLM_CPU_OMP_THREADS_BIND for each engine "
        "('nobind', 'auto', or cores such as '0-1'). 'nobind' lets the OS spread "
        "replicas that share a node. vLLM binds where its mp executor starts "
        "workers: with executor uni (the CPU default) it reads none of this; "
        "see cpu_cores.",
    )
    omp_num_threads: int | None = Field(
        None, gt=0, description="OMP_NUM_THREADS for each engine process (CPU backend)."
    )
    cpu_cores: Literal["auto", "shared", "pinned", "reserved"] = Field(
        "auto",
        description="CPU backend, on a cluster `moe-cluster serve` starts. auto: "
        "reserved where the engines leave a core for the rest of the cluster, "
        "pinned where they have a slot each and none is left, shared otherwise "
        "(or where omp_num_threads is unset). shared: the OS places every "
        "process on every core. "
        "pinned: each engine computes on a slot of omp_num_threads cores (the "
        "node's last ones, one slot per engine) and never moves off it, and the "
        "rest of the cluster runs on every core, the slots' included (an error "
        "where the engines need more cores than the node has, or omp_num_threads "
        "is unset). reserved: each engine gets omp_num_threads cores of its own "
        "(the node's last ones) and Ray, Serve, the router and the page store run "
        "on the others, so none of them "
        "preempts an engine mid-step (an error where the node would keep no core "
        "for them, or omp_num_threads is unset). Counts the autoscaler's most "
        "replicas. With one replica on 2 cores, pinned and reserved each raised "
        "S1's throughput by ~7% over shared, and reserved raised one stream's "
        "over pinned; what each did to a realtime stream under a background "
        "flood is in the README.",
    )
    executor: Literal["auto", "uni", "mp"] = Field(
        "auto",
        description="Where vLLM runs the model of an engine of one rank. uni: in "
        "the engine-core process itself. mp: in a worker process of its own, "
        "which the engine core drives through shared memory; vLLM's default on "
        "CPU, where both processes spin while requests run. auto: uni on CPU "
        "(one spinning process less on the cores the engine shares with Ray, the "
        "proxy and the ingress), vLLM's own choice on GPU, for EP ranks and for "
        "tensor parallelism (which needs mp).",
    )
    measure_expert_load: bool | None = Field(
        None,
        description="Count the tokens each MoE layer routes to each expert (a hook "
        "on vLLM's router in every worker) and report a rolling window to the "
        "router and the metrics. The hook runs only in eager mode (compiled graphs "
        "and CUDA graphs do not replay it), so it needs enforce_eager. None: "
        "measure whenever enforce_eager is on.",
    )
    expert_load_window_s: float = Field(
        10.0, gt=0, description="Rolling window of the measured expert load."
    )
    json_whitespace: Literal["compact", "any"] = Field(
        "compact",
        description="Structured outputs (JSON schemas, JSON objects, tool calls "
        "forced by tool_choice): compact emits JSON without free whitespace (no "
        "model can pad it endlessly); any lets the model place whitespace.",
    )
    quantization: Literal["fp8", "awq", "gptq", "compressed-tensors"] | None = Field(
        None,
        description="Quantized weights, as vLLM names the method (the checkpoint "
        "must be quantized so; fp8 also quantizes an unquantized one when it "
        "loads). None: the checkpoint's own. CPU engines: fp8 on AMX_MLA only.",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="KV cache dtype; fp8 halves the cache and the page store's "
        "pages. auto: the model dtype. The CPU MLA backends (AMX_MLA, CPU_MLA) "
        "keep an unquantized cache only.",
    )

    @model_validator(mode="after")
    def _backend_takes_it(self) -> EngineConfig:
        if isinstance(self.block_size, int) and self.block_size <= 0:
            raise ValueError("engine.block_size must be > 0 or auto")
        explicit = self.attention_backend.upper()
        if explicit in (platform.Backend.AMX_MLA, platform.Backend.CPU_MLA):
            # What the backend refuses on any machine fails here, at load; what
            # depends on the machine fails in ClusterConfig.resolved.
            platform.resolve(
                explicit,
                self.dtype,
                self.block_size,
                self.enable_prefix_caching,
                gpu=False,
                amx=explicit == platform.Backend.AMX_MLA,
            )
            platform.check_quantization(
                platform.Backend(explicit), self.quantization, self.kv_cache_dtype
            )
        return self

    @property
    def kv_block_size(self) -> int:
        """The resolved block size (``ClusterConfig.resolved`` sets it)."""
        if not isinstance(self.block_size, int):
            raise RuntimeError(
                "engine.block_size is still auto: use ClusterConfig.resolved()"
            )
        return self.block_size

    @property
    def measures_expert_load(self) -> bool:
        if self.measure_expert_load is None:
            return self.enforce_eager
        return self.measure_expert_load


class AutoscalingSettings(_Strict):
    """QoS-aware autoscaling of the engine replicas (``router.autoscaling``): on
    the router's view of the load, not on request counts. Counts are engine
    replicas, or EP groups when ``expert_parallel.ranks`` > 1."""

    enabled: bool = Field(
        False, description="Scale the engines between min and max replicas."
    )
    min_replicas: int = Field(1, ge=1, description="Never fewer (EP groups).")
    max_replicas: int = Field(4, ge=1, description="Never more (EP groups).")
    realtime_slo_ttft_ms: float = Field(
        500.0,
        gt=0,
        description="Scale up when a waiting realtime request's wait plus the "
        "router's first-token estimate passes this.",
    )
    normal_slo_ttft_ms: float = Field(
        2000.0, gt=0, description="The same for normal requests."
    )
    background_max_age_s: float = Field(
        60.0,
        gt=0,
        description="Background traffic alone scales up only once its oldest "
        "waiting request is this old.",
    )
    target_utilization: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Scale up when more of the replicas' router slots "
        "(router.max_running_per_replica each) are taken.",
    )
    downscale_utilization: float = Field(
        0.4,
        gt=0,
        lt=1,
        description="Scale down (one replica or group at a time) when nothing "
        "waits and the requests in flight would take at most this share of one "
        "replica fewer.",
    )
    upscale_delay_s: float = Field(
        2.0, ge=0, description="Up pressure must last this long."
    )
    downscale_delay_s: float = Field(
        30.0, ge=0, description="An idle stretch must last this long, per step down."
    )
    metrics_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often each replica hands Serve the router's view.",
    )
    look_back_period_s: float = Field(
        3.0,
        gt=0,
        description="Serve averages each replica's values over this window.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError("deployment.autoscaling.max_replicas < min_replicas")
        if self.downscale_utilization >= self.target_utilization:
            raise ValueError(
                "deployment.autoscaling.downscale_utilization must be below "
                "target_utilization (hysteresis)"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                "deployment.autoscaling.look_back_period_s must exceed "
                "metrics_interval_s"
            )
        return self


class DeploymentConfig(_Strict):
    num_replicas: int = Field(
        2,
        ge=1,
        description="Engine replicas; with expert_parallel.ranks > 1, EP groups "
        "(each of `ranks` rank replicas).",
    )
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per replica.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs reserved per replica.")
    max_ongoing_requests: int = Field(
        64, gt=0, description="Requests one engine replica accepts at a time."
    )
    max_queued_requests: int = Field(
        256,
        ge=-1,
        description="Requests waiting for an engine replica beyond which new ones "
        "are refused with RESOURCE_EXHAUSTED / 429 (-1: unbounded).",
    )
    health_check_period_s: float = Field(
        5.0, gt=0, description="How often Serve checks that the engine is alive."
    )
    health_check_timeout_s: float = Field(
        30.0, gt=0, description="A health check slower than this fails."
    )
    autoscaling: AutoscalingSettings = Field(
        default_factory=AutoscalingSettings,
        description="QoS-aware autoscaling; num_replicas is then the initial count.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="When Serve stops an engine replica (scale-down, redeploy, "
        "shutdown), how long its streams may run to their end; those still running "
        "then are handed off and resumed on another replica (router.migration_limit "
        "> 0), their KV loaded from the page store.",
    )


class PerClass(_Strict):
    """One weight per QoS class."""

    realtime: float = Field(gt=0)
    normal: float = Field(gt=0)
    background: float = Field(gt=0)

    def of(self, qos: QoS) -> float:
        return float(getattr(self, qos.name.lower()))


class PerClassCount(_Strict):
    """One count per QoS class."""

    realtime: int = Field(ge=0)
    normal: int = Field(ge=0)
    background: int = Field(ge=0)

    def of(self, qos: QoS) -> int:
        return int(getattr(self, qos.name.lower()))


class TenantRateLimit(_Strict):
    """A tenant's token buckets: requests and tokens (prompt plus ``max_tokens``,
    charged at admission) per second. A request over either gets
    RESOURCE_EXHAUSTED / 429 with the time until it may be sent as its retry
    hint."""

    requests_per_s: float | None = Field(
        None, gt=0, description="Requests admitted per second (None: unlimited)."
    )
    request_burst: float | None = Field(
        None,
        gt=0,
        description="Requests admitted at once after a quiet spell (default: one "
        "second's worth, at least 1).",
    )
    tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="Prompt plus max_tokens admitted per second (None: unlimited). "
        "One request larger than the burst is admitted; the next wait out the debt.",
    )
    token_burst: float | None = Field(
        None, gt=0, description="Tokens admitted at once (default: one second's worth)."
    )

    @model_validator(mode="after")
    def _limits_something(self) -> TenantRateLimit:
        if self.requests_per_s is None and self.tokens_per_s is None:
            raise ValueError("set requests_per_s, tokens_per_s or both")
        return self

    def bursts(self) -> tuple[float, float]:
        """(request burst, token burst), the defaults filled in."""
        request = self.request_burst or max(1.0, self.requests_per_s or 1.0)
        token = self.token_burst or (self.tokens_per_s or 1.0)
        return request, token


class RouterConfig(_Strict):
    """The DeepSeekRouter: admission by QoS class, replica choice and breakers."""

    enabled: bool = Field(
        True,
        description="Admit and place every request through the router. Off: Serve's "
        "own handle queue (first come, first served) picks replicas.",
    )
    policy: Literal["least_loaded", "weighted_round_robin", "prefix", "expert"] = Field(
        "least_loaded",
        description="Replica choice: fewest tokens in flight; round robin weighted by "
        "measured tokens/s; longest cached prefix (balanced against load); or least "
        "predicted load on the experts the prompt hits.",
    )
    max_running_per_replica: int = Field(
        16,
        gt=0,
        description="Requests the router runs on one replica at a time; the rest wait "
        "in the router's class queues. Keep it at or below engine.max_num_seqs.",
    )
    realtime_reserved_slots: int = Field(
        4,
        ge=0,
        description="Extra requests per replica only realtime may use, so realtime "
        "never waits for a slot to free; the engine's priority scheduler runs it "
        "first.",
    )
    class_weights: PerClass = Field(
        default_factory=lambda: PerClass(realtime=16, normal=4, background=1),
        description="Weighted fair share of freed slots per class while all are "
        "waiting; every weight > 0, so background is never starved.",
    )
    max_queued: PerClassCount = Field(
        default_factory=lambda: PerClassCount(
            realtime=256, normal=512, background=1024
        ),
        description="Requests waiting per class beyond which new ones are refused "
        "with RESOURCE_EXHAUSTED / 429.",
    )
    max_wait_s: float = Field(
        60.0, gt=0, description="A request queued this long without a deadline is shed."
    )
    default_ttft_ms: float = Field(
        50.0,
        gt=0,
        description="Dispatch-to-first-token estimate until one is measured: a "
        "deadline shorter than the estimate is refused at once.",
    )
    breaker_failures: int = Field(
        3, ge=1, description="Consecutive failures or timeouts that open a replica."
    )
    breaker_open_s: float = Field(
        5.0, gt=0, description="How long an opened replica breaker waits to probe."
    )
    admission_socket: bool = Field(
        True,
        description="Ingresses send their batched admissions and releases to the "
        "router on a direct TCP connection to the router actor (a port on its "
        "node, in the node's ephemeral range) instead of as Ray actor calls: "
        "~0.2 ms a round trip instead of ~2 ms. Off: Ray calls only (for networks "
        "that allow only Ray's own ports between nodes).",
    )
    migration_limit: int = Field(
        2,
        ge=0,
        description="Times one stream may move to another replica when its engine "
        "fails mid-stream: it goes on from the tokens already sent, its KV loaded "
        "from the page store. 0: never (the client gets UNAVAILABLE).",
    )
    expert_capacity_tokens: float | None = Field(
        None,
        gt=0,
        description="Tokens in flight one routed expert may carry cluster-wide before "
        "its breaker defers background requests that hit it (normal ones above "
        "expert_normal_factor times this). None: no expert breaker.",
    )
    expert_normal_factor: float = Field(
        1.5,
        ge=1,
        description="Normal requests are deferred too above this many times an "
        "expert breaker's threshold (per-expert and per-group breakers).",
    )
    expert_max_imbalance: float | None = Field(
        None,
        gt=1,
        description="Group expert breaker: measured tokens of a group's busiest "
        "expert over the mean of its layer (any layer) beyond which the group "
        "defers background requests. None: imbalance does not open it.",
    )
    expert_max_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="Group expert breaker: measured tokens/s one expert of a group "
        "may route before the group defers background requests. None: no limit.",
    )
    expert_min_window_tokens: int = Field(
        256,
        ge=1,
        description="A layer that routed fewer tokens in the window is not judged "
        "for imbalance (too few to tell).",
    )
    expert_probe_s: float = Field(
        5.0,
        gt=0,
        description="A half-open group breaker closes after this long without "
        "overload (it lets one background request run at a time meanwhile).",
    )
    expert_close_ratio: float = Field(
        0.8,
        gt=0,
        le=1,
        description="An expert breaker closes (a group breaker half-opens) below "
        "this share of its threshold.",
    )
    prefix_balance_tokens: int = Field(
        4096,
        ge=0,
        description="Prefix policy: the longest-prefix replica is skipped when it has "
        "this many more tokens in flight than the least-loaded one.",
    )
    report_interval_s: float = Field(
        0.5, gt=0, description="How often replicas report load to the router."
    )
    replica_stale_s: float = Field(
        5.0, gt=0, description="A replica silent this long is dropped from routing."
    )
    tenant_rate_limits: dict[str, TenantRateLimit] = Field(
        default_factory=dict,
        description="Token buckets per tenant, global across ingress replicas (the "
        'router holds them). Keys are tenant names ("": the default tenant); "*" '
        "gives each tenant not named its own buckets at that rate. Tenants are "
        "bound to API keys (server.api_keys), so a client cannot spend another's "
        "budget. A stream resumed after an engine failure is not charged again.",
    )

    @field_validator("tenant_rate_limits")
    @classmethod
    def _rate_limited_tenants(
        cls, limits: dict[str, TenantRateLimit]
    ) -> dict[str, TenantRateLimit]:
        check_tenant_names(limits)
        return limits

    @model_validator(mode="after")
    def _limits_need_the_router(self) -> RouterConfig:
        if self.tenant_rate_limits and not self.enabled:
            raise ValueError(
                "tenant_rate_limits are kept by the router: they need "
                "router.enabled: true"
            )
        return self


# Request ids and tenant names: the same rule in the config and the ingress.
MAX_ID_CHARS = 128
ID_RE = re.compile(r"^[A-Za-z0-9._:\-]+$")


def is_id(value: str) -> bool:
    return 0 < len(value) <= MAX_ID_CHARS and ID_RE.match(value) is not None


def check_tenant_names(names: Iterable[str]) -> None:
    """Tenant names in the config: ids, or "" (the default) or "*" (any)."""
    for t in names:
        if t not in ("", "*") and not is_id(t):
            raise ValueError(
                f"tenant {t!r}: at most 128 letters, digits and '._:-', or '' or '*'"
            )


class ApiKey(_Strict):
    """An API key and the tenants its requests may name."""

    key: SecretStr
    tenants: list[str] = Field(
        default_factory=lambda: [""],
        min_length=1,
        description="Tenants this key's requests may name; the first is the one a "
        'request that names none gets ("": the default, unsalted tenant). "*" '
        "allows any (for a gateway that sets the tenant itself).",
    )

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: list[str]) -> list[str]:
        check_tenant_names(tenants)
        return tenants


class TLSConfig(_Strict):
    """HTTPS for the OpenAI HTTP proxy (Ray Serve's ``HTTPOptions.ssl_*``).

    NOTE: Ray Serve 2.60 passes no ``ssl_cert_reqs`` to uvicorn, so client
    certificates cannot be required (no mutual TLS) through it."""

    certfile: str = Field(description="PEM certificate (chain) the proxy presents.")
    keyfile: str = Field(description="PEM private key of the certificate.")
    keyfile_password: SecretStr | None = Field(
        None, description="Password of an encrypted key file."
    )

    @model_validator(mode="after")
    def _files_exist(self) -> TLSConfig:
        for name in ("certfile", "keyfile"):
            value = getattr(self, name)
            if value is not None and not Path(value).expanduser().is_file():
                raise ValueError(f"server.tls.{name}: no such file: {value}")
        return self

    def resolved(self) -> TLSConfig:
        def absolute(p: str) -> str:
            return str(Path(p).expanduser().resolve())

        return self.model_copy(
            update={
                "certfile": absolute(self.certfile),
                "keyfile": absolute(self.keyfile),
            }
        )


# Requests one ingress replica takes at a time (Serve's max_ongoing_requests):
# it only parses and relays, and a request waits in the router's class queues,
# not in front of the ingress.
INGRESS_MAX_ONGOING_REQUESTS = 4096


class ServerConfig(_Strict):
    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds.")
    http_port: int = Field(8000, gt=0, lt=65536, description="OpenAI HTTP port.")
    grpc_port: int = Field(9000, gt=0, lt=65536, description="gRPC port.")
    api_keys: list[ApiKey | SecretStr] = Field(
        default_factory=list,
        description="Accepted API keys ('Authorization: Bearer KEY' on HTTP and gRPC "
        "metadata), each a key or {key, tenants}: a request may name only a tenant "
        "its key allows (a bare key: the default tenant only), so tenants cannot "
        "reach each other's cached prefixes. Empty: no authentication, any tenant.",
    )

    def credentials(self) -> list[ApiKey]:
        """Every key with its tenants (a bare key: the default tenant only)."""
        return [k if isinstance(k, ApiKey) else ApiKey(key=k) for k in self.api_keys]

    max_prompt_bytes: int = Field(
        1 << 20,
        gt=0,
        description="Largest prompt text (or chat messages) accepted, in bytes.",
    )
    app_name: str = Field("moe-cluster", min_length=1, description="Serve app name.")
    tls: TLSConfig | None = Field(
        None,
        description="Serve OpenAI HTTP over TLS from this certificate and key. Ray "
        "Serve 2.60's gRPC proxy has no TLS setting: gRPC stays plaintext (terminate "
        "TLS for it in front of the proxy).",
    )
    ingress_on_main_loop: bool = Field(
        True,
        description="Run the ingress's request handlers on its replica's main event "
        "loop (Ray Serve's RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0, for the "
        "ingress replicas only) instead of a second thread. The two threads contend "
        "for the GIL on every request and every relayed chunk: under three times the "
        "capacity on 2 cores, realtime's TTFT at the client was p50 1.8-4.9 s with "
        "the thread, 0.6-0.8 s without (`make bench-overload`). Handlers must not "
        "block (they do not).",
    )
    engine_transport: Literal["direct", "grpc", "actor"] = Field(
        "direct",
        description="How the ingress streams from an engine replica. `direct`: "
        "straight to the replica the router placed the request on, over a gRPC "
        "server that replica runs on its engine's event loop, past Serve's handle "
        "(a replica's first requests, while the ingress asks for its address, go "
        "over `grpc`). `grpc`: Ray Serve's gRPC transport for handle calls (one "
        "gRPC stream per request to the replica's Serve server, through the "
        "handle's router and the replica's request bookkeeping). `actor`: a Ray "
        "actor call (each streamed chunk an object reported through Ray's core "
        "workers). On 2 cores under S1 (`python -m tests.perf.s1_profile`), "
        "`grpc` took the ingress's CPU per request from 31-34 ms to 19-20 ms at one "
        "stream against `actor`; `direct` took it from 22-23 ms to 17-18 ms and "
        "the engine replica's from 47-52 to 38-41 ms against `grpc`, and TTFT p50 "
        "from 40 to 36 ms.",
    )
    haproxy: bool = Field(
        False,
        description="Serve both ports through HAProxy instead of Serve's proxy "
        "actor (Ray Serve's RAY_SERVE_ENABLE_HA_PROXY): HAProxy forwards each "
        "request to an ingress replica's own HTTP and gRPC servers (Serve's direct "
        "ingress), so every streamed chunk crosses one Ray process less. Set in "
        "the environment of every Ray node before it starts: `moe-cluster serve` "
        "does so for the cluster it starts, the KubeRay manifests for their pods. "
        "Serve's proxy spans are then absent (the ingress's spans parent on the "
        "client's traceparent). Not with tls. HAProxy's HTTP/2 stream limit per "
        "connection (100 by default, on each side) is raised to what an ingress "
        "replica takes: at 100, a client's realtime request waited behind its "
        "own queued background streams, in HAProxy, where no QoS class applies.",
    )

    serve_control_loop_s: float = Field(
        0.5,
        gt=0,
        le=5,
        description="How often Ray Serve's controller reconciles the deployments "
        "(RAY_SERVE_CONTROL_LOOP_INTERVAL_S; Serve's default 0.1). Every pass costs "
        "the controller and Ray's GCS CPU whether or not anything changed: on an "
        "idle 2-core node, 91 and 66 ms of CPU a second at 0.1 s, 41 and 43 at 0.5 "
        "s, taken from the engines' cores. A replica that started, died or failed "
        "its health check is acted on up to this much later. Set in the "
        "environment of every Ray node before it starts, as haproxy.",
    )
    serve_metrics_export_ms: int = Field(
        1000,
        ge=100,
        le=10_000,
        description="How often each Serve replica and handle passes the request "
        "counts it keeps to Ray's metrics API (RAY_SERVE_METRICS_EXPORT_INTERVAL_MS;"
        " Serve's default 100). Ray exports them to Prometheus every 10 s, so more "
        "often only costs CPU in every replica. Set as serve_control_loop_s.",
    )

    @model_validator(mode="after")
    def _haproxy_without_tls(self) -> ServerConfig:
        if self.haproxy and self.tls is not None:
            raise ValueError(
                "server.haproxy serves plain HTTP; terminate TLS in front of it, or "
                "use Serve's proxy (haproxy: false) for server.tls"
            )
        return self

    def serve_env(self) -> dict[str, str]:
        """Ray Serve's environment for this app (every Ray node, before start)."""
        env = {
            "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": f"{self.serve_control_loop_s:g}",
            "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": str(self.serve_metrics_export_ms),
        }
        if not self.haproxy:
            return env
        # HTTP/2 streams HAProxy lets one client connection (fe), and one
        # connection to an ingress replica (be), hold open: as many as an
        # ingress replica takes, so requests wait only in the router's queues.
        streams = str(INGRESS_MAX_ONGOING_REQUESTS)
        return env | {
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_H2_FE_MAX_CONCURRENT_STREAMS": streams,
            "RAY_SERVE_HAPROXY_H2_BE_MAX_CONCURRENT_STREAMS": streams,
        }


class WarmupPrompt(_Strict):
    """A prompt a new replica runs before it takes traffic (e.g. a system prompt)."""

    text: str = Field(min_length=1, description="Prompt text (tokenized as sent).")
    tenant: str = Field("", description="Tenant whose pages these are ('' = none).")


class KVStoreConfig(_Strict):
    """The shared paged KV store: one page arena per node, shared by its engines."""

    enabled: bool = Field(
        True,
        description="Engines load prompt prefixes other replicas computed from the "
        "node's page store and save the full blocks they compute into it.",
    )
    capacity_bytes: int = Field(
        1 << 30,
        gt=0,
        description="Hard bound on the node's page arena (shared memory); least "
        "recently used pages are evicted beyond it.",
    )
    gpu_staging_mib: int = Field(
        32,
        ge=1,
        le=4096,
        description="GPU engines: each of the connector's six staging buffers on "
        "the device (two per direction for pages in flight, one per direction for "
        "the checksum's products). The engine's KV cache gives up eight times this "
        "(the buffers, a page of checksum weights, block ids and sums) to them, "
        "unless engine.kv_cache_memory_bytes sizes the cache by hand. A page (one "
        "block of every layer) must fit one buffer.",
    )
    fetch: bool = Field(
        True,
        description="On a miss, fetch the pages another node holds instead of "
        "recomputing them.",
    )
    fetch_timeout_s: float = Field(
        2.0, gt=0, description="A fetch from another node slower than this is dropped."
    )
    sync_interval_s: float = Field(
        0.5, gt=0, description="How often a node publishes its pages to the directory."
    )
    warmup_hot_prefixes: int = Field(
        8,
        ge=0,
        description="A starting replica first runs this many of the cluster's most "
        "reused prefixes (loading their pages) before it takes traffic.",
    )
    warmup_prompts: list[WarmupPrompt] = Field(
        default_factory=list,
        description="Prompts a starting replica runs before it takes traffic.",
    )
    warmup_timeout_s: float = Field(
        120.0, gt=0, description="Warmup longer than this is cut short (logged)."
    )


class ExpertParallelConfig(_Strict):
    """Expert-parallel groups: vLLM data-parallel attention with the routed experts
    split across ``ranks`` engine processes, placed, health-checked and restarted
    together."""

    ranks: int = Field(
        1,
        ge=1,
        description="Ranks per group (one engine process, and one accelerator, "
        "each). 1: plain engine replicas.",
    )
    placement: Literal["spread", "pack"] = Field(
        "spread",
        description="Where a group's ranks go: spread across nodes, or packed on as "
        "few as possible.",
    )
    accelerator: str | None = Field(
        None,
        min_length=1,
        description="Ray resource each rank takes one unit of: 'GPU' on GPU nodes "
        "(NCCL between ranks), or a custom resource that marks accelerator nodes. "
        "None: CPUs only (gloo between ranks).",
    )
    master_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long ranks wait for rank 0 to publish the group's address.",
    )
    all2all_backend: str | None = Field(
        None,
        description="GPU only: vLLM all2all backend for expert dispatch (e.g. "
        "'deepep_low_latency'). None: vLLM's default.",
    )
    eplb: bool = Field(
        False,
        description="GPU only: vLLM's expert-parallel load balancer, which moves and "
        "replicates hot experts between ranks.",
    )
    eplb_step_interval: int = Field(
        3000, gt=0, description="Engine steps between EPLB rebalances."
    )
    eplb_window_size: int = Field(
        1000, gt=0, description="Engine steps of expert load EPLB balances on."
    )
    num_redundant_experts: int = Field(
        0, ge=0, description="GPU only: extra expert replicas EPLB may place."
    )

    @property
    def enabled(self) -> bool:
        return self.ranks > 1

    @property
    def on_gpu(self) -> bool:
        return self.accelerator == "GPU"


class TracingConfig(_Strict):
    """Trace export is switched on by the standard OTEL_EXPORTER_OTLP_ENDPOINT (and
    OTEL_* protocol, headers, sampler); these override the sampler and service name."""

    sampling_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Share of traces started here that are recorded (a client's "
        "traceparent decides for its own); None: OTEL_TRACES_SAMPLER(_ARG), else 1.",
    )
    service_name: str | None = Field(
        None, min_length=1, description="service.name; None: OTEL_SERVICE_NAME."
    )
    log_encoding: Literal["TEXT", "JSON"] = Field(
        "TEXT",
        description="Ray's log encoding for every worker: JSON writes each record "
        "(with its request, trace and span ids) as one JSON object.",
    )


class WorkerGroup(_Strict):
    """A KubeRay worker group: pods of one shape the autoscaler adds and removes."""

    name: str = Field(min_length=1, description="groupName.")
    replicas: int = Field(1, ge=0, description="Pods (or pod sets) at start.")
    min_replicas: int = Field(0, ge=0, description="Fewest the autoscaler keeps.")
    max_replicas: int = Field(1, ge=1, description="Most the autoscaler adds.")
    num_of_hosts: int = Field(
        1, ge=1, description="Pods per replica (a multi-host group, e.g. wide EP)."
    )
    cpu: str = Field("4", description="CPU request and limit (a k8s quantity).")
    memory: str = Field("16Gi", description="Memory request and limit.")
    gpus: int = Field(0, ge=0, description="nvidia.com/gpu per pod.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Pod nodeSelector."
    )

    @model_validator(mode="after")
    def _bounds(self) -> WorkerGroup:
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"kubernetes.worker_groups[{self.name}]: need min_replicas <= "
                "replicas <= max_replicas"
            )
        return self


class KubernetesTls(_Strict):
    """Ray's TLS between the pods (``RAY_USE_TLS``, mutual certificates), which
    moe-cluster's own sockets between nodes follow (``cluster.tls``)."""

    issuer: Literal["kuberay", "ca_secret"] = Field(
        description="kuberay: the operator issues the certificates with "
        "cert-manager (KubeRay >= 1.7 with its RayClusterMTLS feature gate; the "
        "RayCluster's tlsOptions). ca_secret: each pod's init container issues "
        "its own from the CA in ca_secret (any KubeRay; `moe-cluster node-cert`)."
    )
    ca_secret: str | None = Field(
        None,
        min_length=1,
        description="Secret with the CA's ca.crt and ca.key (issuer ca_secret). "
        "Only the init containers mount ca.key.",
    )
    cluster_domain: str = Field(
        "cluster.local",
        min_length=1,
        description="The Kubernetes cluster's DNS domain. Each certificate "
        "(issuer ca_secret) names every service of the namespace under it "
        "(*.NAMESPACE.svc.DOMAIN): workers reach the head by its service's name.",
    )
    days: int = Field(
        365,
        ge=1,
        description="Validity of each pod's certificate (issuer ca_secret); Ray "
        "reads it once at start, so a pod must restart within it.",
    )

    @model_validator(mode="after")
    def _secret(self) -> KubernetesTls:
        if (self.issuer == "ca_secret") != (self.ca_secret is not None):
            raise ValueError(
                "kubernetes.tls.ca_secret is required with issuer ca_secret, and "
                "only then"
            )
        return self


class KubernetesConfig(_Strict):
    """What `moe-cluster k8s` renders into a KubeRay RayService (the rest of the
    config becomes its serveConfigV2)."""

    name: str = Field("moe-cluster", min_length=1, description="RayService name.")
    namespace: str = Field("default", min_length=1)
    image: str = Field(
        "moe-cluster:0.1.0-cpu",
        description="Ray 2.60 image with this package and its pinned extras "
        "installed (k8s/Dockerfile builds it).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    model_path: str | None = Field(
        None,
        description="model.path inside the pods (None: model.path as given).",
    )
    model_volume_claim: str | None = Field(
        None,
        description="PersistentVolumeClaim mounted read-only at model_path's "
        "directory (the checkpoint); None: the image or build_tiny_if_missing "
        "provides it.",
    )
    head_cpu: str = Field("2", description="Head pod CPU (it runs no engine).")
    head_memory: str = Field("8Gi", description="Head pod memory.")
    worker_groups: list[WorkerGroup] = Field(
        default_factory=lambda: [
            WorkerGroup(name="cpu", replicas=1, min_replicas=1, max_replicas=2)
        ],
        min_length=1,
    )
    object_store_memory_bytes: int = Field(
        2 << 30,
        gt=0,
        description="Ray's object store per pod; /dev/shm holds it and the page "
        "store's arena (kvstore.capacity_bytes).",
    )
    api_keys_secret: str | None = Field(
        "moe-cluster-api-keys",
        description="Secret whose key 'api-keys' holds server.api_keys as JSON "
        "(MOE_CLUSTER_API_KEYS in every pod); None: the config's own keys.",
    )
    otel_exporter_otlp_endpoint: str | None = Field(
        None, description="OTEL_EXPORTER_OTLP_ENDPOINT of every pod (traces on)."
    )
    autoscaler_idle_timeout_s: int = Field(
        60, ge=0, description="A pod idle this long is removed."
    )
    autoscaler_upscaling_mode: Literal["Conservative", "Default", "Aggressive"] = (
        "Default"
    )
    tls: KubernetesTls | None = Field(
        None,
        description="Ray's TLS between the pods (None: plaintext, Ray's default).",
    )
    upgrade_strategy: Literal["NewCluster", "None"] = Field(
        "NewCluster",
        description="A changed cluster spec starts a new RayCluster and moves "
        "traffic once it serves (None: update in place).",
    )


class ClusterConfig(_Strict):
    """Everything `moe-cluster serve` needs."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    kvstore: KVStoreConfig = Field(default_factory=KVStoreConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)

    @model_validator(mode="after")
    def _expert_parallel(self) -> ClusterConfig:
        ep, engine = self.expert_parallel, self.engine
        gpu_only = {
            "expert_parallel.eplb": ep.eplb,
            "expert_parallel.all2all_backend": ep.all2all_backend is not None,
            "expert_parallel.num_redundant_experts": ep.num_redundant_experts > 0,
        }
        for key, used in gpu_only.items():
            if used and not ep.on_gpu:
                raise ValueError(
                    f"{key} needs GPU ranks (expert_parallel.accelerator: GPU)"
                )
            if used and not ep.enabled:
                raise ValueError(f"{key} needs an EP group (expert_parallel.ranks > 1)")
        if ep.num_redundant_experts and not ep.eplb:
            raise ValueError("expert_parallel.num_redundant_experts needs eplb: true")
        if ep.enabled and engine.tensor_parallel_size != 1:
            raise ValueError(
                "an EP group has one rank per accelerator: engine.tensor_parallel_size "
                "must be 1 with expert_parallel.ranks > 1"
            )
        if ep.on_gpu and self.deployment.num_gpus not in (0, 1):
            raise ValueError(
                "with expert_parallel.accelerator: GPU each rank takes one GPU; leave "
                "deployment.num_gpus at 0 or 1"
            )
        if engine.executor == "uni" and engine.tensor_parallel_size > 1:
            raise ValueError(
                "engine.executor uni runs one rank: tensor parallelism "
                "(engine.tensor_parallel_size > 1) needs mp or auto"
            )
        if engine.measure_expert_load and not engine.enforce_eager:
            raise ValueError(
                "engine.measure_expert_load counts in a hook that compiled and CUDA "
                "graphs do not replay: set engine.enforce_eager: true as well"
            )
        return self

    @model_validator(mode="after")
    def _ports_differ(self) -> ClusterConfig:
        if self.server.http_port == self.server.grpc_port:
            raise ValueError("server.http_port and server.grpc_port must differ")
        r = self.router
        if r.enabled:
            need = r.max_running_per_replica + r.realtime_reserved_slots
            if self.deployment.max_ongoing_requests < need:
                raise ValueError(
                    f"deployment.max_ongoing_requests must be >= {need} (router."
                    "max_running_per_replica + router.realtime_reserved_slots) so that "
                    "requests wait in the router's class queues, not in Serve's"
                )
        return self

    @property
    def engines_on_gpu(self) -> bool:
        return self.deployment.num_gpus > 0 or self.expert_parallel.on_gpu

    def engine_platform(self, amx: bool | None = None) -> platform.EnginePlatform:
        """The backend, dtype and block size the engines get on a machine like
        this one (``amx``: override what this CPU has). Raises ValueError naming
        the fields the backend refuses."""
        e = self.engine
        resolved = platform.resolve(
            e.attention_backend,
            e.dtype,
            e.block_size,
            e.enable_prefix_caching,
            gpu=self.engines_on_gpu,
            amx=platform.has_amx() if amx is None else amx,
            expert_parallel=self.expert_parallel.enabled,
        )
        platform.check_quantization(resolved.backend, e.quantization, e.kv_cache_dtype)
        return resolved

    def _executor(self, backend: platform.Backend) -> str:
        e = self.engine
        if e.executor != "auto":
            return e.executor
        one_rank = e.tensor_parallel_size == 1 and not self.expert_parallel.enabled
        if backend is platform.Backend.GPU or not one_rank:
            return "auto"  # vLLM's own choice (an EP rank's is set with its rank)
        return "uni"

    def resolved(self, amx: bool | None = None) -> ClusterConfig:
        """A copy with the model path absolute (replicas run in other directories)
        and the engine's ``auto`` settings made concrete for this machine (see
        ``engine_platform``); resolving a resolved config changes nothing."""
        path = str(Path(self.model.path).expanduser().resolve())
        p, e = self.engine_platform(amx), self.engine
        engine = e.model_copy(
            update={
                # On GPU an explicit vLLM backend name is passed on as given.
                "attention_backend": e.attention_backend
                if p.backend is platform.Backend.GPU
                else p.backend.value,
                "dtype": p.dtype,
                "block_size": p.block_size,
                "enable_prefix_caching": p.prefix_caching,
                "executor": self._executor(p.backend),
            }
        )
        server = self.server
        if server.tls is not None:
            server = server.model_copy(update={"tls": server.tls.resolved()})
        return self.model_copy(
            update={
                "model": self.model.model_copy(update={"path": path}),
                "server": server,
                "engine": engine,
            }
        )


def load_config(path: str | Path) -> ClusterConfig:
    """Reads and validates a YAML config; raises ValueError naming the bad key."""
    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return ClusterConfig.model_validate(data)
