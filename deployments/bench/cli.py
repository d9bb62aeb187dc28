"""``moe-cluster bench``: drive an endpoint, print the summary, write JSON and plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deployments.bench.backends import Backend, GrpcBackend, OpenAIBackend
from deployments.bench.report import Slo, result_json, table
from deployments.bench.runner import Limits, run_closed_loop, run_open_loop
from deployments.bench.workload import ClassSpec, LengthRange, PrefixGroups, Workload


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "bench",
        help="load-test an endpoint (moe-cluster gRPC or any OpenAI HTTP server)",
        description="Closed loop (--concurrency) or open loop (--rate, Poisson); "
        "stops after --num-requests or --duration, whichever comes first.",
    )
    b.add_argument("--backend", choices=["grpc", "openai"], default="grpc")
    b.add_argument(
        "--target",
        default="127.0.0.1:9000",
        help="grpc: host:port; openai: base URL, e.g. http://127.0.0.1:8000",
    )
    b.add_argument(
        "--model", default=None, help="openai: model name (default: first listed)"
    )
    b.add_argument("--api-key", default="")
    b.add_argument(
        "--tokenizer",
        default=None,
        help="openai: send prompts as text, decoded with this tokenizer "
        "(a model directory); default: token ids",
    )
    b.add_argument(
        "--no-qos-field",
        action="store_true",
        help="openai: do not send the `qos` extension field",
    )
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    mode.add_argument("--rate", type=float, help="open loop: requests/s (Poisson)")
    b.add_argument("--num-requests", type=int, default=None)
    b.add_argument("--duration", type=float, default=None, help="seconds of sending")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--input-len", default="128", help="prompt tokens: N or LOW:HIGH")
    b.add_argument("--output-len", default="64", help="output tokens: N or LOW:HIGH")
    b.add_argument("--vocab", default="3:1000", help="token ids drawn from [LOW, HIGH)")
    b.add_argument(
        "--prefix-groups",
        type=int,
        default=0,
        help="shared-prefix workload: number of prefixes",
    )
    b.add_argument("--prefix-len", type=int, default=0, help="tokens per shared prefix")
    b.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        metavar="QOS[:share=S,rate=R,input=L:H,output=L:H,deadline=MS]",
        help="a QoS class of the mix (repeat); deadline: time-to-first-token "
        "deadline sent with its requests; default: all normal",
    )
    b.add_argument("--slo-ttft-ms", type=float, default=None)
    b.add_argument("--slo-tpot-ms", type=float, default=None)
    b.add_argument("--out", type=Path, default=None, help="write JSON results here")
    b.add_argument("--plots", type=Path, default=None, help="write PNG plots here")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=main)


def workload_from(args: argparse.Namespace) -> Workload:
    default = ClassSpec(
        input_len=LengthRange.parse(args.input_len),
        output_len=LengthRange.parse(args.output_len),
    )
    classes = tuple(ClassSpec.parse(c, default) for c in args.classes) or (default,)
    prefix = (
        PrefixGroups(args.prefix_groups, args.prefix_len)
        if args.prefix_groups or args.prefix_len
        else None
    )
    low, _, high = args.vocab.partition(":")
    return Workload(classes, prefix, (int(low), int(high)), args.seed)


def backend_from(args: argparse.Namespace) -> Backend:
    if args.backend == "grpc":
        return GrpcBackend(args.target, args.api_key)
    target = args.target if "://" in args.target else f"http://{args.target}"
    return OpenAIBackend(
        target,
        args.model,
        args.api_key,
        send_qos=not args.no_qos_field,
        detokenize=text_prompts(args.tokenizer) if args.tokenizer else None,
    )


def text_prompts(tokenizer_dir: str) -> Callable[[tuple[int, ...]], str]:
    """Token ids -> text with the model's tokenizer (the text re-tokenizes to
    about as many tokens; byte-level BPE may merge a few)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))


def text_prompt_ids(tokenizer_dir: str) -> Callable[[tuple[int, ...]], list[int]]:
    """Token ids -> the ids a server gets from ``text_prompts``' text: the text
    tokenized as an OpenAI completions server does (special tokens added), so a
    token-id API can be sent the same prompts as a text one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def ids(prompt: tuple[int, ...]) -> list[int]:
        text = tokenizer.decode(list(prompt), skip_special_tokens=True)
        return [int(t) for t in tokenizer(text, add_special_tokens=True).input_ids]

    return ids


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    workload = workload_from(args)
    limits = Limits(args.num_requests, args.duration)
    backend = backend_from(args)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.num_requests, unit="req", file=sys.stderr)

    def on_done(_: object) -> None:
        if progress is not None:
            progress.update(1)

    try:
        if args.rate is not None or any(c.rate for c in workload.classes):
            records, duration = await run_open_loop(
                backend, workload.requests(args.rate), limits, on_done
            )
        else:
            records, duration = await run_closed_loop(
                backend, workload.requests(), args.concurrency or 1, limits, on_done
            )
    finally:
        if progress is not None:
            progress.close()
        await backend.close()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.pop("func", None)
    config.pop("api_key", None)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    return result_json(config, records, duration, slo)


def check_extra(args: argparse.Namespace) -> None:
    """Fails before any load is sent when this run needs a module of the ``bench``
    extra that is not installed (a serving node has only the core packages)."""
    import importlib.util

    needed = {
        "httpx": args.backend == "openai",
        "tqdm": not args.no_progress,
        "matplotlib": args.plots is not None,
    }
    find = importlib.util.find_spec
    missing = [m for m, used in needed.items() if used and find(m) is None]
    if missing:
        raise ValueError(
            f"bench needs {', '.join(missing)}: pip install 'moe-cluster[bench]'"
        )


def main(args: argparse.Namespace) -> int:
    check_extra(args)
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    result = asyncio.run(run_bench(args))
    print(table(result["summary"]))
    print(f"duration {result['duration_s']:.1f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"results: {args.out}")
    if args.plots:
        from deployments.bench.plots import write_plots
        from deployments.bench.runner import RequestRecord

        records = [RequestRecord(**r) for r in result["records"]]
        for p in write_plots(records, args.plots):
            print(f"plot: {p}")
    return 0 if result["summary"]["all"]["completed"] else 1
