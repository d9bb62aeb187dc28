"""The CPU expert-parallel fixes: gloo all_gatherv / reduce_scatterv between two
real processes, and the local routing of global expert ids."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

import torch

from deployments.ep import cpu_compat as cpu_ep_compat


def _rank(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    sizes = [3, 1]  # rank 0 holds 3 tokens, rank 1 holds 1
    mine = torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 10 * rank
    ids = torch.full((sizes[rank], 2), rank, dtype=torch.int64)
    gathered = cpu_ep_compat.all_gatherv(None, 2, [mine, ids], 0, sizes)
    equal = cpu_ep_compat.all_gatherv(None, 2, ids[:1], 0, None)
    # Every rank holds a partial sum for all 4 tokens; each gets its own rows.
    partial = torch.ones(4, 2) * (rank + 1)
    reduced = cpu_ep_compat.reduce_scatterv(None, rank, 2, partial, 0, sizes)
    out.put(
        (
            rank,
            gathered[0].tolist(),
            gathered[1].tolist(),
            equal.tolist(),
            reduced.tolist(),
        )
    )
    dist.destroy_process_group()


def test_gatherv_and_reduce_scatterv_over_gloo() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict((r[0], r[1:]) for r in (out.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank in (0, 1):
        hidden, ids, equal, reduced = results[rank]
        # Rank 0's 3 rows then rank 1's single row, no padding in between.
        assert hidden == [[0, 1], [2, 3], [4, 5], [10, 11]]
        assert ids == [[0, 0], [0, 0], [0, 0], [1, 1]]
        assert equal == [[0, 0], [1, 1]]
        assert reduced == [[3.0, 3.0]] * (3 if rank == 0 else 1)


def test_local_routing_keeps_this_ranks_experts_and_zeroes_the_rest() -> None:
    # 4 experts; this rank holds global experts 2 and 3 as local 0 and 1.
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    ids = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    w, local = cpu_ep_compat.local_routing(weights, ids, expert_map)
    assert local.tolist() == [[0, 0], [0, 1]] and local.dtype == torch.int32
    assert torch.equal(w, torch.tensor([[0.6, 0.0], [0.0, 0.3]]))


def test_applies_to_this_vllm_on_cpu_only() -> None:
    import vllm
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
    )

    assert vllm.__version__ == cpu_ep_compat.VLLM_VERSION and cpu_ep_compat.applies()
    cpu_ep_compat.register()
    # The CPU communicator has its own all_gatherv now; the base one still raises.
    assert CpuCommunicator.all_gatherv is not DeviceCommunicatorBase.all_gatherv
    assert DeviceCommunicatorBase.reduce_scatterv.__qualname__.startswith(
        "DeviceCommunicatorBase"
    )
