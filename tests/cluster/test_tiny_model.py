from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cluster.tiny_model import (
    EOS,
    TinyModelSpec,
    checkpoint_digest,
    cycle_order,
    greedy_chain,
    greedy_successors,
    write_tiny_model,
)
from cluster.tiny_tokenizer import BOS, NUM_RESERVED


def test_the_checkpoint_is_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    again = write_tiny_model(tmp_path / "again")
    assert checkpoint_digest(again) == checkpoint_digest(tiny_model)


def test_config_has_the_deepseek_v2_moe_shape(tiny_model: Path) -> None:
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576  # CPU MLA needs it
    assert cfg["n_routed_experts"] >= 8 and cfg["num_experts_per_tok"] == 2
    assert (
        cfg["topk_method"] == "group_limited_greedy"
        and cfg["topk_group"] < cfg["n_group"]
    )
    assert cfg["n_shared_experts"] == 1
    assert cfg["num_hidden_layers"] - cfg["first_k_dense_replace"] >= 2


def test_tokenizer_round_trips_and_has_a_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "Hello, experts! 42 tokens: café"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok) == 1024 and tok.eos_token_id == EOS.id
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("User: hi\n\nAssistant:")


def test_encoded_text_starts_with_one_bos_as_deepseeks_does(tiny_model: Path) -> None:
    """DeepSeek's tokenizers add BOS to text (vLLM's completions encode with
    special tokens); the chat template writes its own, encoded without."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    plain = tok.encode("hello world", add_special_tokens=False)
    assert tok("hello world").input_ids == [BOS.id, *plain]
    assert BOS.id not in plain
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert chat[0] == BOS.id and chat.count(BOS.id) == 1


def test_greedy_successor_is_a_single_cycle(tiny_model: Path) -> None:
    successor = greedy_successors(tiny_model)
    order = cycle_order(TinyModelSpec(), num_special=NUM_RESERVED)
    assert [int(successor[t]) for t in order] == [int(t) for t in np.roll(order, -1)]
    # Every token but BOS, PAD and the tool-call tokens: greedy text holds none.
    assert len(set(order.tolist())) == 1024 - NUM_RESERVED + 1
    assert set(order.tolist()).isdisjoint(range(2, NUM_RESERVED))


def test_transformers_greedy_follows_the_cycle_with_wide_margins(
    tiny_model: Path,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompt = [410, 465, 14, 318, 496]
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=24,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert out.sequences[0, 5:].tolist() == greedy_chain(
        greedy_successors(tiny_model), prompt[-1], 24
    )
    margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    # Float reordering moves logits by ~1e-5; the argmax margin is ~9 nats.
    assert min(margins) > 5.0


def test_spec_rejects_shapes_vllm_cannot_route() -> None:
    with pytest.raises(ValueError, match="multiple of n_group"):
        TinyModelSpec(n_routed_experts=10, n_group=4)
    with pytest.raises(ValueError, match="MoE layer"):
        TinyModelSpec(num_layers=1, first_k_dense_replace=1)


def test_the_fp8_checkpoint_is_vllms_format(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from cluster.tiny_model import (
        FP8_BLOCK,
        FP8_QUANTIZATION_CONFIG,
        WEIGHT_FILE,
        fp8_block_scales,
        fp8_spec,
        is_fp8_weight,
        make_weights,
        write_tiny_model,
    )

    path = write_tiny_model(tmp_path / "fp8", fp8=True)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == FP8_QUANTIZATION_CONFIG
    got = load_file(str(path / WEIGHT_FILE))
    ref = make_weights(fp8_spec(), NUM_RESERVED)
    fp8_bytes = f32_bytes = 0
    for name, w in ref.items():
        if not is_fp8_weight(name):
            assert got[name].dtype == torch.float32
            assert np.array_equal(got[name].numpy(), w)
            continue
        q, blocks = got[name], got[name.removesuffix("weight") + "weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and blocks.dtype == torch.float32
        assert blocks.shape == tuple(-(-n // FP8_BLOCK) for n in w.shape)
        # e4m3 keeps 3 mantissa bits: within 1/16 of each value, or of the
        # smallest normal step (of its block's scale) for values near zero.
        scale = fp8_block_scales(blocks, w.shape)
        deq = q.float() * scale
        err = (deq - torch.from_numpy(w)).abs()
        bound = torch.from_numpy(np.abs(w)) / 16 + scale * 2**-6
        assert bool((err <= bound).all()), name
        # Each block's largest value is e4m3's largest: the scale fits the block.
        assert float(q.float().abs().max()) == 448.0, name
        fp8_bytes += q.numel()
        f32_bytes += w.nbytes
    assert fp8_bytes * 4 == f32_bytes > 0
    # vLLM reads it as a serialized FP8 checkpoint with dynamic activations.
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    fp8 = Fp8Config.from_config(config["quantization_config"])
    assert fp8.is_checkpoint_fp8_serialized and fp8.activation_scheme == "dynamic"
    assert fp8.weight_block_size == [FP8_BLOCK, FP8_BLOCK]


def test_an_older_tiny_model_is_rewritten_by_the_cli(tmp_path: Path) -> None:
    from cluster.tiny_model import SPEC_FILE, is_current
    from deployments.cli import main

    out = tmp_path / "tiny"
    assert main(["make-tiny-model", "--out", str(out)]) == 0 and is_current(out)
    spec = json.loads((out / SPEC_FILE).read_text())
    (out / SPEC_FILE).write_text(json.dumps(spec | {"format": 1}))
    assert not is_current(out)
    assert main(["make-tiny-model", "--out", str(out)]) == 0 and is_current(out)
    (out / SPEC_FILE).unlink()  # someone else's checkpoint: left alone
    assert main(["make-tiny-model", "--out", str(out)]) == 1
