from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.config import ClusterConfig
from cluster.platform import Backend, EnginePlatform, cpu_flags, has_amx, resolve


def _resolve(amx: bool, gpu: bool = False, **engine: Any) -> EnginePlatform:
    e = {"attention_backend": "auto", "dtype": "auto", "block_size": "auto"} | engine
    return resolve(
        e["attention_backend"], e["dtype"], e["block_size"], True, gpu=gpu, amx=amx
    )


def test_auto_follows_the_machine() -> None:
    assert _resolve(amx=True) == EnginePlatform(Backend.AMX_MLA, "bfloat16", 128, True)
    assert _resolve(amx=False) == EnginePlatform(Backend.CPU_MLA, "float32", 16, False)
    assert _resolve(amx=True, gpu=True) == EnginePlatform(Backend.GPU, "auto", 64, True)


def test_forcing_a_backend() -> None:
    # The reference backend runs on an AMX CPU too (float32, 16-token blocks).
    ref = _resolve(amx=True, attention_backend="CPU_MLA")
    assert (ref.backend, ref.dtype, ref.block_size) == (Backend.CPU_MLA, "float32", 16)
    assert (
        _resolve(amx=True, attention_backend="amx_mla", block_size=64).block_size == 64
    )
    assert _resolve(amx=False, dtype="bfloat16").dtype == "bfloat16"  # any dtype


@pytest.mark.parametrize(
    ("amx", "engine", "fields"),
    [
        (True, {"dtype": "float32"}, "engine.dtype float32"),
        (True, {"block_size": 16}, "engine.block_size 16"),
        (False, {"block_size": 128}, "engine.block_size 128"),
        (True, {"attention_backend": "CPU_MLA", "block_size": 32}, "engine.block_size"),
        (False, {"attention_backend": "AMX_MLA"}, "needs a CPU with AMX"),
        (True, {"attention_backend": "FLASHMLA"}, "engine.attention_backend"),
    ],
)
def test_what_the_backend_refuses_names_the_fields(
    amx: bool, engine: dict[str, Any], fields: str
) -> None:
    with pytest.raises(ValueError, match=fields):
        _resolve(amx=amx, **engine)


def test_a_cpu_backend_on_gpu_engines_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU backend"):
        _resolve(amx=False, gpu=True, attention_backend="CPU_MLA")
    assert _resolve(amx=False, gpu=True, attention_backend="FLASHMLA").block_size == 64


def test_machine_independent_refusals_fail_at_load() -> None:
    for engine in (
        {"attention_backend": "AMX_MLA", "dtype": "float32"},
        {"attention_backend": "CPU_MLA", "block_size": 128},
    ):
        with pytest.raises(ValidationError, match="engine"):
            ClusterConfig.model_validate({"engine": engine})
    with pytest.raises(ValidationError, match="block_size"):
        ClusterConfig.model_validate({"engine": {"block_size": 0}})


def test_the_config_resolves_once_for_the_machine() -> None:
    auto = ClusterConfig()
    assert auto.engine.block_size == "auto"
    with pytest.raises(RuntimeError, match="auto"):
        _ = auto.engine.kv_block_size
    amx = auto.resolved(amx=True)
    assert (amx.engine.attention_backend, amx.engine.dtype) == ("AMX_MLA", "bfloat16")
    assert amx.engine.kv_block_size == 128 and amx.engine.enable_prefix_caching
    assert amx.resolved(amx=True) == amx
    ref = auto.resolved(amx=False)
    assert (ref.engine.attention_backend, ref.engine.kv_block_size) == ("CPU_MLA", 16)
    assert not ref.engine.enable_prefix_caching
    # float32 on auto is the reference backend's; on an AMX CPU it is refused.
    f32 = ClusterConfig.model_validate({"engine": {"dtype": "float32"}})
    assert f32.resolved(amx=False).engine.dtype == "float32"
    with pytest.raises(ValueError, match="CPU_MLA"):
        f32.resolved(amx=True)
    gpu = ClusterConfig.model_validate({"deployment": {"num_gpus": 1}}).resolved()
    assert (gpu.engine.attention_backend, gpu.engine.kv_block_size) == ("auto", 64)


def test_cpu_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile amx_int8\n\n"
        "processor\t: 1\nflags\t\t: fpu avx2 amx_bf16 amx_tile amx_int8\n"
    )
    assert has_amx(cpu_flags(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert not has_amx(cpu_flags(info))
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_this_machine_agrees_with_torch() -> None:
    """/proc/cpuinfo (read where the config loads) and vLLM's own test (run in the
    engine's process) tell the same on this machine."""
    torch = pytest.importorskip("torch")
    assert has_amx() == torch.cpu._is_amx_tile_supported()


def test_cpu_expert_parallel_groups_take_the_float32_reference_path() -> None:
    group = ClusterConfig.model_validate({"expert_parallel": {"ranks": 2}})
    for amx in (True, False):
        e = group.resolved(amx=amx).engine
        assert (e.attention_backend, e.dtype, e.kv_block_size) == (
            "CPU_MLA",
            "float32",
            16,
        )
    amx_group = ClusterConfig.model_validate(
        {"engine": {"attention_backend": "AMX_MLA"}, "expert_parallel": {"ranks": 2}}
    )
    with pytest.raises(ValueError, match="ranks > 1 on CPU"):
        amx_group.resolved(amx=True)
    gpu = ClusterConfig.model_validate(
        {"expert_parallel": {"ranks": 2, "accelerator": "GPU"}}
    ).resolved(amx=True)
    assert gpu.engine.kv_block_size == 64  # GPU groups are not affected
