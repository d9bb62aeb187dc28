"""What a DeepSeek checkpoint's ``config.json`` says, read in one place.

The ingress (what clients may ask about the model), the router (how many experts
it balances) and the expert predictor (how the gate chooses) all read this one
``Checkpoint``, in DeepSeek-V2/V3's own keys.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Checkpoint:
    architecture: str
    max_positions: int
    vocab_size: int
    num_layers: int
    first_dense_layers: int  # the first layers have a dense MLP, not experts
    num_routed_experts: int  # 0: not a mixture of experts
    num_shared_experts: int
    experts_per_token: int
    num_expert_groups: int
    topk_groups: int
    scoring: str  # the gate's "softmax" (V2) or "sigmoid" (V3)
    gate_bias: bool  # V3's e_score_correction_bias (``topk_method: noaux_tc``)
    rms_norm_eps: float
    # quantization_config's weight_block_size ([rows, cols]) of a block-quantized
    # checkpoint (DeepSeek-V3's FP8); () when its weights are not in blocks.
    weight_block_size: tuple[int, ...] = ()

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    @staticmethod
    @functools.cache
    def read(path: str | Path) -> Checkpoint:
        """The checkpoint at ``path`` (read once per process and path)."""
        cfg: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
        layers = int(cfg["num_hidden_layers"])
        routed = int(cfg.get("n_routed_experts") or 0)
        return Checkpoint(
            architecture=(cfg.get("architectures") or ["unknown"])[0],
            max_positions=int(cfg["max_position_embeddings"]),
            vocab_size=int(cfg["vocab_size"]),
            num_layers=layers,
            first_dense_layers=(
                int(cfg.get("first_k_dense_replace", 0)) if routed else layers
            ),
            num_routed_experts=routed,
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
            num_expert_groups=int(cfg.get("n_group") or 1),
            topk_groups=int(cfg.get("topk_group") or 1),
            scoring=str(cfg.get("scoring_func", "softmax")),
            gate_bias=cfg.get("topk_method") == "noaux_tc",
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            weight_block_size=tuple(
                int(n)
                for n in (cfg.get("quantization_config") or {}).get("weight_block_size")
                or ()
            ),
        )
