"""Qwen2-VL at its published sizes, with seeded random weights built straight on the device (no download).

`SHAPES` holds the architecture of Qwen2-VL-2B-Instruct and Qwen2-VL-7B-Instruct as their published
``config.json`` files give it: the vision tower (depth 32, width 1280, 16 heads, MLP ratio 4, patch 14,
merge 2) and the language model (hidden size, layers, heads, KV heads, intermediate size, vocabulary,
mrope sections [16, 24, 24] of the 64 rotary frequencies, rope theta 1e6). Compute, memory traffic,
embedding and KV sizes are then those of the real model; only the tokens mean nothing. The special token
ids are the tiny model's (`epd_lab.models.tiny`), so the processor and runners work unchanged;
``--model PATH`` still loads real weights through `load_model`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from epd_lab.models.tiny import (
    IMAGE_PAD_ID,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    _disable_eos,
)


INITIALIZER_RANGE = 0.02  # the published configs'; the tiny model's 0.1 would blow activations up at 28 layers


@dataclass(frozen=True)
class Shape:
    """One published Qwen2-VL architecture (the fields of its config.json that set sizes)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    vision_depth: int = 32
    vision_embed_dim: int = 1280
    vision_num_heads: int = 16
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    rope_theta: float = 1_000_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype.itemsize


SHAPES: dict[str, Shape] = {
    # Qwen/Qwen2-VL-2B-Instruct: the language model is Qwen2-1.5B's
    "qwen2-vl-2b": Shape(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    # Qwen/Qwen2-VL-7B-Instruct: the language model is Qwen2-7B's
    "qwen2-vl-7b": Shape(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}


def shape_config(name: str) -> Qwen2VLConfig:
    """The Qwen2VLConfig of a named shape (`SHAPES`); raises ValueError naming the choices."""
    try:
        s = SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPES)} (or 'tiny')") from None
    text_config = {
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta,
                            "mrope_section": list(s.mrope_section)},
        "tie_word_embeddings": s.tie_word_embeddings,
        "initializer_range": INITIALIZER_RANGE,  # the published configs' value
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    vision_config = {
        "depth": s.vision_depth,
        "embed_dim": s.vision_embed_dim,
        "hidden_size": s.hidden_size,  # merger output = text hidden size
        "num_heads": s.vision_num_heads,
        "mlp_ratio": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": INITIALIZER_RANGE,
    }
    return Qwen2VLConfig(text_config=text_config, vision_config=vision_config, image_token_id=IMAGE_PAD_ID,
                         video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID,
                         vision_end_token_id=VISION_END_ID, tie_word_embeddings=s.tie_word_embeddings)


def count_parameters(name: str) -> int:
    """Parameters of a named shape, counted on the meta device (no memory, any machine)."""
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(shape_config(name))
    return sum(p.numel() for p in model.parameters())


def build_shape_model(name: str, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """Build a named shape with random weights drawn from `seed`, every tensor allocated on `device` in
    `dtype` from the start (no CPU copy of the weights). The global RNGs are left untouched."""
    config = shape_config(name)
    device = torch.device(device)
    devices = [device] if device.type == "cuda" else []
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            with device:
                model = Qwen2VLForConditionalGeneration(config)
        finally:
            torch.set_default_dtype(previous)
    _disable_eos(model)
    return model.eval()
