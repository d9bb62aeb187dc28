"""vLLM's Prometheus metrics, recorded through Ray in the engine replica.

``EngineStatLogger`` is vLLM's own ``RayPrometheusStatLogger`` (the one Ray Serve
LLM records with, so its Grafana dashboard joins on the same series), with two
changes: its gauges stay on Ray's endpoint while the engine idles, and an engine
step costs a few Ray metric calls instead of a dozen.

vLLM sets its scheduler gauges (``vllm:num_requests_running``,
``num_requests_waiting``, ``kv_cache_usage_perc``...) only when an engine step
reports stats, and an idle engine takes no steps. Ray 2.60 drops a gauge that
has not been set for two export intervals
(``ray/_private/telemetry/open_telemetry_metric_recorder.py``), so an idle
engine's gauges vanished from Prometheus instead of reading 0: dashboards showed
"no data" and a ``num_requests_waiting`` alert could not tell idle from gone.
``refresh()``, called every second by the replica, sets them all again, to an
idle engine's values when the engine holds no request.

On every step vLLM also sets each of those gauges (eight with the page store's
connector) and builds a labelled child of one counter afresh (``labels()``: a
copy of the metric and its tags, and a lookup of Serve's replica context), each
through Ray's metrics API in the replica's event loop, which also relays the
step's tokens. Under one stream that was 92 of the engine replica's ~270 busy
py-spy samples (``tests/perf/s1_profile.py --pyspy``; wall-clock samples, so
waits for the GIL and the core count too). Here a gauge is passed on
to Ray only when its value changes (``refresh()`` keeps the unchanged ones
alive), and a labelled child is built once per label set: about 12 Ray calls a
step became 4, and a step's record 50 us of CPU in a Ray worker became 20.
Counters and histograms record as vLLM records them.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

REFRESH_S = 1.0  # below Ray's gauge lifetime: 2 export intervals of at least 1 s


class ChangedOnly:
    """A gauge that passes a value on only when it differs from the last one."""

    __slots__ = ("gauge", "value")

    def __init__(self, gauge: Any) -> None:
        self.gauge = gauge
        self.value: float | None = None

    def set(self, value: float) -> None:
        if value != self.value:
            self.value = value
            self.gauge.set(value)

    def keep(self, idle: bool) -> None:
        """Sets the gauge again (to 0 for an idle engine), changed or not."""
        if idle:
            self.value = 0
        if self.value is not None:
            self.gauge.set(self.value)


class LabelledOnce:
    """A labelled metric whose children (``labels(...)``) are built once each."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self.children: dict[tuple[Any, ...], Any] = {}

    def labels(self, *values: Any) -> Any:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self.metric.labels(*values)
        return child


class EngineStatLogger(RayPrometheusStatLogger):
    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None):
        super().__init__(vllm_config, engine_indexes)
        # The gauges record() sets on every step, each per engine index.
        self.gauges: list[ChangedOnly] = []
        self.gauge_scheduler_running = self._changed_only(self.gauge_scheduler_running)
        self.gauge_scheduler_waiting = self._changed_only(self.gauge_scheduler_waiting)
        self.gauge_kv_cache_usage = self._changed_only(self.gauge_kv_cache_usage)
        for by in (self.gauge_waiting_by_reason, self.gauge_kv_fetch_by_stage):
            for key, per_engine in by.items():
                by[key] = self._changed_only(per_engine)
        self.counter_prompt_tokens_cached_by_source = LabelledOnce(  # type: ignore[assignment]
            self.counter_prompt_tokens_cached_by_source
        )

    def _changed_only(self, per_engine: dict[int, Any]) -> dict[int, Any]:
        wrapped = {idx: ChangedOnly(gauge) for idx, gauge in per_engine.items()}
        self.gauges += wrapped.values()
        return wrapped

    def refresh(self, idle: bool) -> None:
        """Sets the scheduler gauges again: to their last values, or (``idle``:
        the engine holds no request) to nothing running, waiting or held."""
        for gauge in self.gauges:
            gauge.keep(idle)


def of(engine: Any) -> EngineStatLogger | None:
    """The ``EngineStatLogger`` an ``AsyncLLM`` records with (None without stats)."""
    manager = getattr(engine, "logger_manager", None)
    for logger in getattr(manager, "stat_loggers", ()):
        if isinstance(logger, EngineStatLogger):
            return logger
    return None
