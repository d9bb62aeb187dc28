"""infra/ parses: the dashboard, the alert rules, Prometheus's and the
Collector's configs (that their metrics exist is tests/integration/test_infra)."""

from __future__ import annotations

import promql_parser
import yaml

from tests.infra import files


def test_every_dashboard_query_is_valid_promql() -> None:
    board = files.dashboard()
    assert board["uid"] == "moe-cluster"
    queries = files.dashboard_queries()
    assert len(queries) >= 25
    for where, expr in queries.items():
        assert files.metric_names(expr), where  # queries something
    titles = " ".join(p["title"] for p in board["panels"] if p["type"] == "row")
    for section in ("QoS classes", "Router", "Breakers", "Experts", "KV store", "EP"):
        assert section in titles
    kinds = {p["type"] for p in board["panels"]}
    assert "heatmap" in kinds  # the experts
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_the_alert_rules_parse_and_say_what_to_do() -> None:
    rules = files.alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        promql_parser.parse(rule["expr"])
        if "for" in rule:
            promql_parser.parse_duration(rule["for"])
        assert rule["labels"]["severity"] in ("page", "warn", "info")
        assert rule["annotations"]["summary"]
    for expected in (
        "MoeClusterRealtimeTTFTOverSLO",
        "MoeClusterReplicaBreakerOpen",
        "MoeClusterShedding",
        "MoeClusterKVHitRateCollapse",
        "MoeClusterEngineRestarting",
    ):
        assert expected in names


def test_prometheus_loads_the_rules_and_ray_service_discovery() -> None:
    config = yaml.safe_load(files.PROMETHEUS.read_text())
    assert config["rule_files"] == ["alerts.yaml"]
    [ray] = [j for j in config["scrape_configs"] if j["job_name"] == "ray"]
    assert ray["file_sd_configs"][0]["files"] == [
        "/tmp/ray/prom_metrics_service_discovery.json"
    ]


def test_the_collector_pipelines_use_only_what_they_define() -> None:
    config = yaml.safe_load(files.COLLECTOR.read_text())
    assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    defined = {
        kind: set(config.get(kind, {}))
        for kind in ("receivers", "processors", "exporters", "connectors")
    }
    for name, pipeline in config["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in defined[kind] | defined["connectors"], (
                    name,
                    component,
                )
    traces = config["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    assert {"otlp/tempo", "otlp/jaeger"} <= set(traces["exporters"])
