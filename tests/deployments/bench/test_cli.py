import argparse
import importlib.util

import pytest

from deployments.bench.cli import check_extra
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
