"""Measured expert load: tokens routed to each expert of each MoE layer.

``ExpertLoadExtension`` is mixed into vLLM's workers (``worker_extension_cls``).
``moe_expert_load_install`` (called once through ``collective_rpc``) hooks every
MoE layer's router: vLLM calls the hook with the logical expert ids it chose for
the batch (after grouped top-k and score-correction bias, before any EPLB
remapping), and the hook adds this rank's tokens to a per-layer count. Dummy and
profiling steps (no attention metadata) are not counted, and under data
parallelism only this DP rank's own tokens are. ``moe_expert_load_take`` returns
the counts since the last call and zeroes them.

``ExpertLoadWindow`` keeps the engine replica's rolling window of those counts,
which the replica reports to the router. This module imports no vLLM or torch at
load: the window is plain Python.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from router.types import ExpertLoad

_LAYER = re.compile(r"layers\.(\d+)\.")


class ExpertLoadWindow:
    """Counts per (layer, expert) over the last ``window_s`` seconds, with a
    running total: a snapshot costs one copy, not a sum over the samples."""

    def __init__(self, layers: tuple[int, ...], num_experts: int, window_s: float):
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.layers, self.num_experts, self.window_s = layers, num_experts, window_s
        self._samples: deque[tuple[float, list[list[int]]]] = deque()
        self._total = [[0] * num_experts for _ in layers]
        self._started: float | None = None

    def add(self, now: float, counts: list[list[int]]) -> None:
        if len(counts) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layers, got {len(counts)}")
        if self._started is None:
            self._started = now
        if any(any(row) for row in counts):
            self._samples.append((now, counts))
            self._accumulate(counts, 1)
        self._expire(now)

    def snapshot(self, now: float) -> ExpertLoad:
        self._expire(now)
        covered = 0.0 if self._started is None else now - self._started
        return ExpertLoad(
            self.layers,
            tuple(tuple(row) for row in self._total),
            min(covered, self.window_s),
        )

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] <= now - self.window_s:
            self._accumulate(self._samples.popleft()[1], -1)

    def _accumulate(self, counts: list[list[int]], sign: int) -> None:
        for row, add in zip(self._total, counts, strict=True):
            for e, n in enumerate(add):
                row[e] += sign * n


class ExpertLoadExtension:
    """vLLM worker mixin (``worker_extension_cls``); methods run in the worker."""

    model_runner: Any
    vllm_config: Any

    def moe_expert_load_install(self) -> tuple[tuple[int, ...], int]:
        """Hooks every MoE layer's router; returns (layer indices, routed experts)."""
        import torch

        found: list[tuple[int, Any]] = []
        for module in self.model_runner.get_model().modules():
            router = getattr(module, "router", None)
            match = _LAYER.search(getattr(module, "layer_name", "") or "")
            if match and hasattr(router, "set_capture_fn"):
                found.append((int(match.group(1)), router))
        found.sort(key=lambda x: x[0])
        if not found:
            return (), 0
        experts = int(found[0][1].global_num_experts)
        device = next(self.model_runner.get_model().parameters()).device
        self._moe_counts = torch.zeros(
            (len(found), experts), dtype=torch.int64, device=device
        )
        self._moe_dp_rank = self.vllm_config.parallel_config.data_parallel_rank
        for i, (_, router) in enumerate(found):
            router.set_capture_fn(self._moe_hook(i, router.capture_fn))
        return tuple(layer for layer, _ in found), experts

    def _moe_hook(self, i: int, chained: Any) -> Any:
        import torch
        from vllm.forward_context import get_forward_context

        counts = self._moe_counts
        row = counts[i]  # a view, made once: the hook runs every MoE layer's step
        # Ones to add, sliced to each step's token count (a view, not a new
        # tensor), grown when a step has more: the hook is on the forward pass's
        # path, so it costs one index_add_ (int32 ids index as they are).
        ones = torch.ones(256, dtype=counts.dtype, device=counts.device)

        def capture(topk_ids: Any) -> None:
            nonlocal ones
            if chained is not None:  # vLLM's own routed-experts capture, if on
                chained(topk_ids)
            ctx = get_forward_context()
            if ctx.attn_metadata is None:
                return  # a dummy (idle DP rank) or profiling step: no real tokens
            ids = topk_ids
            if ctx.dp_metadata is not None:
                across = ctx.dp_metadata.num_tokens_across_dp_cpu
                mine = int(across[self._moe_dp_rank])
                if ids.shape[0] == int(across.sum()):  # every rank's tokens
                    end = int(across[: self._moe_dp_rank + 1].sum())
                    ids = ids[end - mine : end]
                else:
                    ids = ids[:mine]
            flat = ids.reshape(-1)
            n = flat.shape[0]
            if n > ones.shape[0]:
                ones = torch.ones(n, dtype=counts.dtype, device=counts.device)
            row.index_add_(0, flat, ones[:n])

        return capture

    def moe_expert_load_take(self) -> list[list[int]]:
        """Tokens per (layer, expert) since the last call; zeroes the counts."""
        counts = getattr(self, "_moe_counts", None)
        if counts is None:
            return []
        out: list[list[int]] = counts.cpu().tolist()
        counts.zero_()
        return out
