import argparse
import importlib.util
import itertools
from pathlib import Path

import pytest

from cluster.tiny_tokenizer import BOS
from deployments.bench.cli import check_extra
from deployments.bench.workload import ClassSpec, LengthRange, Workload
from deployments.cli import parser


def bench_args(*argv: str) -> argparse.Namespace:
    return parser().parse_args(["bench", *argv])


def test_a_missing_bench_extra_is_named_before_any_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    check_extra(bench_args("--no-progress"))  # grpc, no plots: nothing extra needed
    with pytest.raises(ValueError, match=r"matplotlib.*moe-cluster\[bench\]"):
        check_extra(bench_args("--plots", "/tmp/plots"))


def test_the_installed_extra_covers_every_option() -> None:
    check_extra(bench_args("--backend", "openai", "--plots", "/tmp/plots"))


def test_text_prompt_ids_are_what_a_server_tokenizing_the_text_gets(
    tiny_model: Path,
) -> None:
    from transformers import AutoTokenizer

    from deployments.bench.cli import text_prompt_ids, text_prompts

    workload = Workload((ClassSpec("normal", input_len=LengthRange(64, 64)),), seed=3)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    text, ids = text_prompts(str(tiny_model)), text_prompt_ids(str(tiny_model))
    for spec in itertools.islice(workload.requests(), 5):
        # As vLLM's completions and moe-cluster's ingress encode text: BOS first.
        as_vllm = tokenizer(text(spec.prompt), add_special_tokens=True).input_ids
        assert ids(spec.prompt) == as_vllm and as_vllm[0] == BOS.id
        assert len(ids(spec.prompt)) > len(spec.prompt)  # random ids re-tokenize longer
