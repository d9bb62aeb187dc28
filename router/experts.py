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
from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

_DTYPES: dict[str, Any] = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class SafetensorsReader:
    """Reads named tensors of a (possibly sharded) safetensors checkpoint as float32
    through memory maps; no torch."""

    def __init__(self, directory: str | Path) -> None:
        self._dir = Path(directory)
        index = self._dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            weight_map = {}
        self._file_of = weight_map
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}

    def _header(self, filename: str) -> tuple[int, dict[str, Any]]:
        if filename not in self._headers:
            with open(self._dir / filename, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._headers[filename] = (8 + n, json.loads(f.read(n)))
        return self._headers[filename]

    def get(self, name: str) -> F32:
        filename = self._file_of.get(name, "model.safetensors")
        offset, header = self._header(filename)
        if name not in header:
            raise KeyError(f"{name} not in {self._dir / filename}")
        meta = header[name]
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{name}: unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        raw = np.memmap(
            self._dir / filename,
            dtype=dtype,
            mode="r",
            offset=offset + start,
            shape=tuple(meta["shape"]),
        )
        if meta["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        assert end - start == raw.nbytes
        return np.asarray(raw, dtype=np.float32)


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
        cfg = json.loads((Path(directory) / "config.json").read_text())
        if not cfg.get("n_routed_experts"):
            raise ValueError(f"{directory}: not a mixture-of-experts checkpoint")
        layer = int(cfg.get("first_k_dense_replace", 0))
        r = SafetensorsReader(directory)
        prefix = f"model.layers.{layer}"
        bias = None
        if cfg.get("topk_method") == "noaux_tc":
            bias = r.get(f"{prefix}.mlp.gate.e_score_correction_bias")
        return cls(
            r.get("model.embed_tokens.weight"),
            r.get(f"{prefix}.post_attention_layernorm.weight"),
            r.get(f"{prefix}.mlp.gate.weight"),
            top_k=int(cfg["num_experts_per_tok"]),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            scoring=str(cfg.get("scoring_func", "softmax")),
            bias=bias,
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
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
