"""vLLM's Prometheus metrics, recorded through Ray in the engine replica.

``EngineStatLogger`` is vLLM's own ``RayPrometheusStatLogger`` (the one Ray Serve
LLM records with, so its Grafana dashboard joins on the same series), with one
addition: its gauges stay on Ray's endpoint while the engine idles.

vLLM sets its scheduler gauges (``vllm:num_requests_running``,
``num_requests_waiting``, ``kv_cache_usage_perc``...) only when an engine step
reports stats, and an idle engine takes no steps. Ray 2.60 drops a gauge that
has not been set for two export intervals
(``ray/_private/telemetry/open_telemetry_metric_recorder.py``), so an idle
engine's gauges vanished from Prometheus instead of reading 0: dashboards showed
"no data" and a ``num_requests_waiting`` alert could not tell idle from gone.
``refresh()``, called every second by the replica, sets them again from the last
stats, or to an idle engine's values when the engine holds no request.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import WAITING_REASON_CAPACITY, WAITING_REASON_DEFERRED
from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats

REFRESH_S = 1.0  # below Ray's gauge lifetime: 2 export intervals of at least 1 s


class EngineStatLogger(RayPrometheusStatLogger):
    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None):
        super().__init__(vllm_config, engine_indexes)
        self._last: dict[int, SchedulerStats] = {}

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        super().record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
        if scheduler_stats is not None:
            self._last[engine_idx] = scheduler_stats

    def refresh(self, idle: bool) -> None:
        """Sets the scheduler gauges again: from the last stats, or (``idle``:
        the engine holds no request) to nothing running, waiting or held."""
        for idx in self.engine_indexes:
            last = self._last.get(idx)
            if last is None:
                continue
            running = 0 if idle else last.num_running_reqs
            waiting = 0 if idle else last.num_waiting_reqs
            deferred = 0 if idle else last.num_skipped_waiting_reqs
            _set(self.gauge_scheduler_running[idx], running)
            _set(self.gauge_scheduler_waiting[idx], waiting + deferred)
            by_reason = self.gauge_waiting_by_reason
            _set(by_reason[WAITING_REASON_CAPACITY][idx], waiting)
            _set(by_reason[WAITING_REASON_DEFERRED][idx], deferred)
            for stage, gauges in self.gauge_kv_fetch_by_stage.items():
                fetching = last.num_kv_fetch_reqs_by_stage.get(stage, 0)
                _set(gauges[idx], 0 if idle else fetching)
            _set(self.gauge_kv_cache_usage[idx], 0.0 if idle else last.kv_cache_usage)


def _set(gauge: Any, value: float) -> None:
    gauge.set(value)  # vLLM types its metrics as one union of the three kinds


def of(engine: Any) -> EngineStatLogger | None:
    """The ``EngineStatLogger`` an ``AsyncLLM`` records with (None without stats)."""
    manager = getattr(engine, "logger_manager", None)
    for logger in getattr(manager, "stat_loggers", ()):
        if isinstance(logger, EngineStatLogger):
            return logger
    return None
