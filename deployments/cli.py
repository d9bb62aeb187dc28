"""``moe-cluster``: serve, generate, info, bench, make-tiny-model."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cluster
from cluster import tracing
from cluster.config import DEFAULT_TINY_MODEL_DIR, ClusterConfig, load_config
from cluster.env import read_env

DEFAULT_CONFIG = Path(cluster.__file__).resolve().parent / "configs" / "tiny-cpu.yaml"


def _config(path: str | None) -> ClusterConfig:
    chosen = path or read_env().config or str(DEFAULT_CONFIG)
    return load_config(chosen)


def trace_settings(config: ClusterConfig) -> tracing.TraceSettings | None:
    """The trace export OTEL_* and the config ask for, made the environment every
    Ray worker inherits (call before ``ray.init``)."""
    t = config.tracing
    s = tracing.settings(sampling_ratio=t.sampling_ratio, service_name=t.service_name)
    tracing.apply_serve_env(s)
    return s


def _traces(s: tracing.TraceSettings | None) -> str:
    if s is None:
        return "off (set OTEL_EXPORTER_OTLP_ENDPOINT to export them)"
    return (
        f"OTLP/{s.protocol} to {s.endpoint}, service {s.service_name!r}, "
        f"sampling {s.sampling_ratio:g}"
    )


def _engines(config: ClusterConfig) -> str:
    n, ranks = config.deployment.num_replicas, config.expert_parallel.ranks
    if ranks > 1:
        return f"{n} EP group{'s' * (n > 1)} of {ranks} ranks"
    return f"{n} engine replica{'s' * (n > 1)}"


def cmd_serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from deployments.app import deploy, prepare_model
    from deployments.ray_connect import init_ray, logging_config
    from kvstore import actor as kv_actor
    from router import actor as router_actor

    config = prepare_model(_config(args.config))
    print(f"moe-cluster: engines get {config.engine_platform().describe()}", flush=True)
    if args.address in (None, "local"):
        # Before Ray starts: its processes inherit where this one may run.
        print(f"moe-cluster: {lay_out_cores(config)}", flush=True)
    started = time.monotonic()
    traces = trace_settings(config)
    os.environ.update(config.server.serve_env())  # the Ray processes inherit it
    init_ray(
        args.address,
        namespace="moe-cluster",
        logging_config=logging_config(config.tracing.log_encoding),
    )
    deploy(config)
    s = config.server
    print(
        f"moe-cluster is serving {config.model.served_name!r} "
        f"({_engines(config)}, "
        f"ready in {time.monotonic() - started:.0f} s)\n"
        f"  traces {_traces(traces)}\n"
        f"  gRPC   {s.host}:{s.grpc_port}  moecluster.v1.Inference, grpc.health.v1, "
        "reflection\n"
        f"  HTTP   http://{s.host}:{s.http_port}/v1  (OpenAI: /models, /completions, "
        "/chat/completions)\n\n"
        "Try:\n"
        '  .venv/bin/moe-cluster generate "hello"\n'
        f"  curl http://{s.host}:{s.http_port}/v1/completions -H 'Content-Type: "
        f'application/json\' -d \'{{"model": "{config.model.served_name}", '
        '"prompt": "hello", "max_tokens": 16}\'\n'
        "Ctrl-C stops the cluster.",
        flush=True,
    )
    if args.no_block:
        return 0
    wait_for_stop_signal()
    node_id = ray.get_runtime_context().get_node_id()
    finish_streams(config)
    # Then the app, with Serve's proxies still up to carry what is left of its
    # streams: its engine replicas drain (deployment.drain_timeout_s) and its
    # ingress replicas wait for their streams. Serve's shutdown alone would
    # close the proxies, and every client stream with them, at once.
    serve.delete(config.server.app_name)
    # Graceful: each engine replica shuts its vLLM engine down. Killing Ray's
    # workers instead would orphan vLLM's engine processes.
    serve.shutdown()
    if config.server.haproxy:
        ended = end_leftover_haproxy(node_id)
        if ended:
            print(f"moe-cluster: ended HAProxy left running: {ended}", flush=True)
    router_actor.kill(config.server.app_name)
    kv_actor.kill(config.server.app_name)  # the nodes' page arenas go with it
    ray.shutdown()
    return 0


def lay_out_cores(config: ClusterConfig) -> str:
    """Lays the node's cores out for the engines (``engine.cpu_cores``) before a
    new local cluster starts; says how."""
    from cluster import cpu_layout

    layout, why = cpu_layout.for_local_cluster(config)
    if layout is None:
        return f"engines share the cores with the rest of the cluster ({why})"
    cpu_layout.apply(layout)
    return layout.describe()


def end_leftover_haproxy(node_id: str) -> list[int]:
    """Ends, by their ids, the HAProxy processes Ray Serve started for this node
    (their config lives under a directory named by the node's id) that are still
    running after ``serve.shutdown()``: Serve stops the one it tracks, but a
    reload racing the shutdown can leave a newer one holding the ports, and the
    next start then fails to bind them. Returns their ids."""
    import psutil

    marker = f"/{node_id}/"
    left = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and Path(cmd[0]).name == "haproxy" and any(marker in a for a in cmd):
            left.append(p)
    return end_processes(left)


def end_processes(procs: list[Any], timeout_s: float = 10.0) -> list[int]:
    """Terminates ``procs`` (``psutil.Process``), kills those still running after
    ``timeout_s``; returns their ids."""
    import psutil

    for p in procs:
        p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        p.kill()
    return [p.pid for p in procs]


def finish_streams(config: ClusterConfig, poll_s: float = 0.2) -> None:
    """The first step of stopping: the router refuses new requests (UNAVAILABLE
    / 503 with a retry hint, while the app still answers) and the streams in
    flight run to their end, for up to ``deployment.drain_timeout_s``."""
    import ray

    from router import actor as router_actor

    timeout = config.deployment.drain_timeout_s
    if not config.router.enabled:
        print("moe-cluster: stopping", flush=True)
        return
    try:
        router = ray.get_actor(
            router_actor.actor_name(config.server.app_name),
            namespace=router_actor.NAMESPACE,
        )
        ray.get(router.close.remote(), timeout=30)
        running = ray.get(router.in_flight.remote(), timeout=30)
        print(
            f"moe-cluster: stopping; new requests are refused, {running} in "
            f"flight have up to {timeout:g} s to finish",
            flush=True,
        )
        give_up = time.monotonic() + timeout
        while running and time.monotonic() < give_up:
            time.sleep(poll_s)
            running = ray.get(router.in_flight.remote(), timeout=30)
    except Exception as e:  # the stop goes on: the app's own drain still applies
        print(f"moe-cluster: stopping; the router did not answer ({e!r})", flush=True)
        return
    if running:
        print(f"moe-cluster: {running} still running; stopping anyway", flush=True)


def wait_for_stop_signal() -> None:
    """Blocks until Ctrl-C or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from deployments.ingress.client import InferenceClient
    from deployments.proto import inference_pb2 as pb

    env = read_env()
    client = InferenceClient(args.target or env.target, args.api_key or env.api_key)
    sampling = pb.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature
    )
    request = pb.GenerateRequest(
        text=args.prompt,
        sampling=sampling,
        qos=pb.QoS.Value(args.qos.upper()),
        deadline_ms=args.deadline_ms,
        tenant=args.tenant,
    )
    try:
        for msg in client.generate(request):
            if msg.HasField("chunk"):
                sys.stdout.write(msg.chunk.text)
                sys.stdout.flush()
            else:
                f = msg.finished
                print(
                    f"\n[{f.finish_reason}: {f.prompt_tokens} prompt + "
                    f"{f.completion_tokens} completion tokens, {f.cached_tokens} "
                    f"cached, replica {f.replica_id}]",
                    file=sys.stderr,
                )
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToJson

    from deployments.ingress.client import InferenceClient

    env = read_env()
    client = InferenceClient(args.target or env.target, args.api_key or env.api_key)
    print(MessageToJson(client.model_info(), always_print_fields_with_no_presence=True))
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    import json

    import ray

    from deployments.ray_connect import init_ray
    from router import actor as router_actor

    init_ray(args.address, namespace="moe-cluster-cli", logging_level="ERROR")
    try:
        name = router_actor.actor_name(args.app)
        try:
            handle = ray.get_actor(name, namespace=router_actor.NAMESPACE)
        except ValueError:
            print(f"moe-cluster: no router {name!r} on this cluster", file=sys.stderr)
            return 1
        stats = ray.get(handle.snapshot.remote(), timeout=30)
        print(json.dumps(stats.as_json(), indent=1))
    finally:
        ray.shutdown()
    return 0


def cmd_k8s(args: argparse.Namespace) -> int:
    from deployments import k8s

    config = load_config(args.config)
    text = k8s.render(config, args.config)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from cluster.tiny_model import (
        SPEC_FILE,
        checkpoint_digest,
        is_current,
        write_tiny_model,
    )

    out = Path(args.out)
    if (out / "config.json").exists() and not args.force:
        if is_current(out, args.fp8):
            print(f"{out} already holds the model (use --force to rewrite)")
            return 0
        if not (out / SPEC_FILE).exists():
            print(f"{out} holds another model; not overwritten (use --force)")
            return 1
        print(f"{out} holds an older tiny model: rewriting it")
    write_tiny_model(out, fp8=args.fp8)
    digest = checkpoint_digest(out)[:16]
    kind = "FP8 (e4m3, 128x128 block scales) " if args.fp8 else ""
    print(f"wrote the tiny DeepSeek-V2 {kind}checkpoint to {out} (sha256 {digest})")
    return 0


def cmd_node_cert(args: argparse.Namespace) -> int:
    from cluster import tls

    if args.days < 1:
        print("--days must be at least 1", file=sys.stderr)
        return 2
    try:
        chain, key, ca = tls.issue_node_files(
            Path(args.ca_dir), Path(args.out_dir), args.ip, args.dns, args.days
        )
    except (OSError, ValueError, TypeError) as e:  # TypeError: an encrypted key
        print(f"node-cert: {e}", file=sys.stderr)
        return 1
    names = ", ".join([*args.ip, *args.dns])
    print(f"wrote {chain}, {key} and {ca} (for {names}, {args.days} days)")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-cluster", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a local Ray cluster serving the config")
    s.add_argument("--config", help=f"YAML config (default: {DEFAULT_CONFIG.name})")
    s.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (host:port, or auto: RAY_ADDRESS or the last "
        "`ray start`); default: start a new local one",
    )
    s.add_argument("--no-block", action="store_true", help="return once serving")
    s.set_defaults(func=cmd_serve)

    for name, func, help_ in (
        ("generate", cmd_generate, "stream a completion over gRPC to stdout"),
        ("info", cmd_info, "print the served model's info"),
    ):
        g = sub.add_parser(name, help=help_)
        g.add_argument(
            "--target", default="", help="gRPC host:port (default 127.0.0.1:9000)"
        )
        g.add_argument("--api-key", default="")
        g.set_defaults(func=func)
        if name == "generate":
            g.add_argument("prompt")
            g.add_argument("--max-tokens", type=int, default=64)
            g.add_argument("--temperature", type=float, default=0.0)
            g.add_argument(
                "--qos", choices=["realtime", "normal", "background"], default="normal"
            )
            g.add_argument("--deadline-ms", type=int, default=0)
            g.add_argument("--tenant", default="")

    r = sub.add_parser(
        "router",
        help="print the DeepSeekRouter's state: replicas, load, breakers, queues",
    )
    r.add_argument("--address", default="auto", help="Ray cluster (default: auto)")
    r.add_argument("--app", default="moe-cluster", help="application name")
    r.set_defaults(func=cmd_router)

    from deployments.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)

    k = sub.add_parser(
        "k8s", help="render the KubeRay RayService of a config (to stdout or --out)"
    )
    k.add_argument("--config", default=str(DEFAULT_CONFIG))
    k.add_argument("--out", help="write the manifest here")
    k.set_defaults(func=cmd_k8s)

    c = sub.add_parser(
        "node-cert",
        help="issue this node's TLS certificate from the cluster's CA (what a "
        "pod's init container runs under kubernetes.tls.issuer: ca_secret)",
    )
    c.add_argument(
        "--ca-dir", required=True, help="folder with the CA's ca.crt and ca.key"
    )
    c.add_argument(
        "--out-dir",
        required=True,
        help="where tls.crt, tls.key and ca.crt are written (RAY_TLS_*)",
    )
    c.add_argument("--ip", action="append", default=[], help="an IP SAN (repeat)")
    c.add_argument("--dns", action="append", default=[], help="a DNS SAN (repeat)")
    c.add_argument("--days", type=int, default=365, help="validity in days")
    c.set_defaults(func=cmd_node_cert)

    m = sub.add_parser("make-tiny-model", help="write the built-in tiny checkpoint")
    m.add_argument("--out", default=DEFAULT_TINY_MODEL_DIR)
    m.add_argument("--force", action="store_true")
    m.add_argument(
        "--fp8",
        action="store_true",
        help="projections in float8_e4m3fn with 128x128 block scales, "
        "DeepSeek-V3's format (serve with engine.quantization: fp8)",
    )
    m.set_defaults(func=cmd_make_tiny_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"moe-cluster: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
