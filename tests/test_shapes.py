"""Model shapes at Qwen2-VL's published sizes (`epd_lab.models.shapes`), built without downloading weights.

Counted on the meta device (no memory), so they run on every machine; the GPU build itself and a 4k-token
prefill of each shape run in `epd-lab bench transfer --device cuda` (data/bench/transfer-cuda-h200.json).
"""
from __future__ import annotations

import pytest
import torch

from epd_lab.models.shapes import SHAPES, Shape, build_shape_model, count_parameters, shape_config


@pytest.mark.parametrize("name, params", [("qwen2-vl-2b", 2.209e9), ("qwen2-vl-7b", 8.291e9)])
def test_published_shapes_have_the_published_parameter_counts(name, params):
    assert count_parameters(name) == pytest.approx(params, rel=1e-3)


def test_kv_and_embedding_sizes_follow_the_config():
    seven = SHAPES["qwen2-vl-7b"]
    assert (seven.head_dim, seven.kv_bytes_per_token()) == (128, 28 * 2 * 4 * 128 * 2)
    cfg = shape_config("qwen2-vl-7b")
    assert cfg.vision_config.hidden_size == 3584  # the merger writes embeddings of the LLM's width
    assert cfg.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
    with pytest.raises(ValueError, match="qwen2-vl-2b"):
        shape_config("qwen2-vl-3b")


def test_a_shape_is_built_seeded_on_the_device_and_dtype_asked(monkeypatch):
    small = Shape(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=2048, tie_word_embeddings=False, vision_depth=1,
                  vision_embed_dim=32, vision_num_heads=2, mrope_section=(2, 3, 3))
    monkeypatch.setitem(SHAPES, "test-small", small)
    a = build_shape_model("test-small", "cpu", dtype=torch.bfloat16, seed=3)
    b = build_shape_model("test-small", "cpu", dtype=torch.bfloat16, seed=3)
    c = build_shape_model("test-small", "cpu", dtype=torch.bfloat16, seed=4)
    assert torch.get_default_dtype() == torch.float32  # restored
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in pa.values())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert any(not torch.equal(pa[k], pc[k]) for k in pa)
    q = next(v for k, v in pa.items() if k.endswith("layers.0.self_attn.q_proj.weight"))
    assert float(q.detach().float().std()) == pytest.approx(0.02, rel=0.2)  # the published initializer_range
