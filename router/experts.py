"""Predicts which routed experts a prompt's tokens hit, from the checkpoint's gate.

A token's hidden state at the first MoE layer is approximated by its embedding
(attention's contribution ignored) passed through that layer's
``post_attention_layernorm``; the gate then selects experts exactly as DeepSeek does:
softmax (V2) or sigmoid plus correction bias (V3) scores, group-limited top-k. The
result is a per-token prediction, memoised per token id, so a prompt's histogram is
a table lookup and a count.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from cluster.checkpoint import Checkpoint

F32 = npt.NDArray[np.float32]


class SafetensorsReader:
    """Reads named tensors of a (possibly sharded) safetensors checkpoint as float32;
    no torch. ``safetensors`` reads F32 and F16; BF16, which numpy lacks, is read
    through a memory map as uint16 and widened (a bfloat16 is the top half of a
    float32)."""

    def __init__(self, directory: str | Path) -> None:
        self._dir = Path(directory)
        index = self._dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            weight_map = {}
        self._file_of = weight_map

    def get(self, name: str) -> F32:
        from safetensors import safe_open

        path = self._dir / self._file_of.get(name, "model.safetensors")
        with safe_open(str(path), framework="numpy") as f:
            if name not in f.keys():  # noqa: SIM118 (a safetensors handle)
                raise KeyError(f"{name} not in {path}")
            dtype = f.get_slice(name).get_dtype()
            if dtype == "BF16":
                return _bf16(path, name)
            if dtype not in ("F32", "F16"):
                raise ValueError(f"{name}: unsupported dtype {dtype}")
            return np.asarray(f.get_tensor(name), dtype=np.float32)


def _bf16(path: Path, name: str) -> F32:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))  # the header's length, then JSON
        meta = json.loads(f.read(n))[name]
    start, _ = meta["data_offsets"]
    raw = np.memmap(
        path,
        dtype=np.uint16,
        mode="r",
        offset=8 + n + start,
        shape=tuple(meta["shape"]),
    )
    return (raw.astype(np.uint32) << 16).view(np.float32)


class ExpertPredictor:
    """Token ids -> predicted routed-expert hits of the first MoE layer."""

    def __init__(
        self,
        embed: F32,  # [vocab, hidden]
        norm_weight: F32,  # [hidden]
        gate: F32,  # [n_experts, hidden]
        *,
        top_k: int,
        n_group: int,
        topk_group: int,
        scoring: str = "softmax",
        bias: F32 | None = None,  # [n_experts], V3's e_score_correction_bias
        eps: float = 1e-6,
    ) -> None:
        n_experts = gate.shape[0]
        if n_experts % n_group or not 0 < topk_group <= n_group or top_k <= 0:
            raise ValueError("inconsistent expert grouping")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown scoring function {scoring!r}")
        self._embed, self._norm, self._gate = embed, norm_weight, gate
        self._bias, self._eps, self._scoring = bias, eps, scoring
        self.num_experts, self.top_k = n_experts, top_k
        self._n_group, self._topk_group = n_group, topk_group
        self._table = np.full((embed.shape[0], top_k), -1, dtype=np.int32)

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> ExpertPredictor:
        ckpt = Checkpoint.read(directory)
        if not ckpt.num_routed_experts:
            raise ValueError(f"{directory}: not a mixture-of-experts checkpoint")
        r = SafetensorsReader(directory)
        prefix = f"model.layers.{ckpt.first_dense_layers}"  # the first MoE layer
        bias = None
        if ckpt.gate_bias:
            bias = r.get(f"{prefix}.mlp.gate.e_score_correction_bias")
        return cls(
            r.get("model.embed_tokens.weight"),
            r.get(f"{prefix}.post_attention_layernorm.weight"),
            r.get(f"{prefix}.mlp.gate.weight"),
            top_k=ckpt.experts_per_token,
            n_group=ckpt.num_expert_groups,
            topk_group=ckpt.topk_groups,
            scoring=ckpt.scoring,
            bias=bias,
            eps=ckpt.rms_norm_eps,
        )

    def experts_of(self, token_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """[n] token ids -> [n, top_k] expert ids, as the gate selects them."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self._table.shape[0]):
            raise ValueError("token id out of the vocabulary")
        missing = np.unique(ids[self._table[ids, 0] < 0])
        if missing.size:
            self._table[missing] = self._select(missing)
        return self._table[ids]

    def histogram(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Predicted token->expert hits of a prompt, one count per routed expert."""
        if not token_ids:
            return tuple([0] * self.num_experts)
        picks = self.experts_of(np.asarray(token_ids, dtype=np.int64))
        counts = np.bincount(picks.ravel(), minlength=self.num_experts)
        return tuple(int(c) for c in counts)

    def _select(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        h = self._embed[ids].astype(np.float32)  # [n, hidden]
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + self._eps)
        logits = (h * self._norm) @ self._gate.T  # [n, n_experts]
        if self._scoring == "softmax":
            e = np.exp(logits - logits.max(axis=-1, keepdims=True))
            scores = e / e.sum(axis=-1, keepdims=True)
        else:
            scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores if self._bias is None else scores + self._bias
        n = ids.shape[0]
        grouped = choice.reshape(n, self._n_group, -1)  # [n, groups, per_group]
        if self._bias is None:  # V2 group_limited_greedy: a group's best expert
            group_score = grouped.max(axis=-1)
        else:  # V3 noaux_tc: sum of a group's two best
            group_score = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        # Stable sorts: ties resolve to the lower index, as torch.topk does here.
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, : self._topk_group]
        mask = np.zeros_like(group_score, dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        masked = np.where(mask[..., None], grouped, -np.inf).reshape(n, -1)
        top = np.argsort(-masked, axis=-1, kind="stable")[:, : self.top_k]
        return top.astype(np.int32)
