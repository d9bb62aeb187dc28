"""The files in infra/, read as Grafana, Prometheus and the Collector read them,
and the metric names their queries use (from the parsed PromQL)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra"
DASHBOARD = INFRA / "grafana" / "moe-cluster.json"
ALERTS = INFRA / "prometheus" / "alerts.yaml"
PROMETHEUS = INFRA / "prometheus" / "prometheus.yml"
COLLECTOR = INFRA / "otel" / "collector.yaml"

# What Grafana substitutes before a query reaches Prometheus.
_GRAFANA_VARS = re.compile(r"\$(__rate_interval|__interval|__range)|\$\{?(\w+)\}?")


def _substitute(expr: str) -> str:
    return _GRAFANA_VARS.sub(lambda m: "5m" if m.group(1) else ".*", expr)


def dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def dashboard_queries() -> dict[str, str]:
    """Panel title (and ref id) -> its PromQL, Grafana variables substituted."""
    out = {}
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out[f"{panel['title']} [{target['refId']}]"] = _substitute(target["expr"])
    return out


def alert_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        rules += group["rules"]
    return rules


def metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            return
        for attr in ("lhs", "rhs", "expr", "vector_selector", "param"):
            child = getattr(node, attr, None)
            if child is not None:
                walk(child)
        for child in getattr(node, "args", None) or []:
            walk(child)

    walk(promql_parser.parse(expr))
    return names


def queried_metrics() -> dict[str, set[str]]:
    """Metric name -> where it is queried (panel or alert)."""
    used: dict[str, set[str]] = {}
    for where, expr in dashboard_queries().items():
        for name in metric_names(expr):
            used.setdefault(name, set()).add(f"panel {where}")
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(f"alert {rule['alert']}")
    return used
