from pathlib import Path

import numpy as np
import pytest
import torch

from router.experts import ExpertPredictor, SafetensorsReader


def _vllm_grouped_topk() -> object:
    from vllm.model_executor.layers.fused_moe.router import grouped_topk_router as g

    return getattr(g.grouped_topk, "_torchdynamo_orig_callable", g.grouped_topk)


@pytest.mark.parametrize("v3", [False, True])
def test_selection_matches_vllm_grouped_topk(v3: bool) -> None:
    rng = np.random.default_rng(7)
    vocab, hidden, experts = 64, 32, 16
    embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    gate = rng.standard_normal((experts, hidden)).astype(np.float32)
    bias = rng.standard_normal(experts).astype(np.float32) * 0.1 if v3 else None
    scoring = "sigmoid" if v3 else "softmax"
    p = ExpertPredictor(
        embed, norm, gate, top_k=2, n_group=4, topk_group=2, scoring=scoring, bias=bias
    )
    ids = np.arange(vocab)
    x = embed / np.sqrt((embed**2).mean(-1, keepdims=True) + 1e-6) * norm
    logits = torch.from_numpy(x @ gate.T)
    _, want = _vllm_grouped_topk()(  # type: ignore[operator]
        torch.from_numpy(x),
        logits,
        topk=2,
        renormalize=False,
        num_expert_group=4,
        topk_group=2,
        scoring_func=scoring,
        e_score_correction_bias=None if bias is None else torch.from_numpy(bias),
    )
    got = p.experts_of(ids)
    assert np.array_equal(np.sort(got, -1), np.sort(want.numpy(), -1))


def test_histogram_counts_top_k_per_token(tiny_model: Path) -> None:
    p = ExpertPredictor.from_checkpoint(tiny_model)
    assert p.num_experts == 16 and p.top_k == 2
    hist = p.histogram([5, 5, 9])
    assert sum(hist) == 6 and len(hist) == 16
    e5 = set(p.experts_of(np.array([5]))[0].tolist())
    assert all(hist[e] >= 2 for e in e5)
    with pytest.raises(ValueError, match="vocabulary"):
        p.histogram([5000])


def test_reader_matches_safetensors(tiny_model: Path) -> None:
    from safetensors.numpy import load_file

    want = load_file(str(tiny_model / "model.safetensors"))
    r = SafetensorsReader(tiny_model)
    name = "model.layers.1.mlp.gate.weight"
    assert np.array_equal(r.get(name), want[name])


def test_reader_widens_bf16_exactly(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    w = torch.randn(5, 7).to(torch.bfloat16)
    save_file(
        {"g": w, "f16": torch.randn(3).half()}, str(tmp_path / "model.safetensors")
    )
    r = SafetensorsReader(tmp_path)
    assert np.array_equal(r.get("g"), w.float().numpy())
    assert r.get("f16").dtype == np.float32
    with pytest.raises(KeyError, match="nope"):
        r.get("nope")
