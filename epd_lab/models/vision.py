"""Qwen2-VL's vision tower made invariant to how images are grouped: it runs once per image, in every path.

Why: the encoders split a request's images into parts and the monolithic model encodes them all in one call.
Qwen2-VL's vision tower is per-image in its mathematics (attention is block-diagonal over images, rotary
positions restart at each image, the merger acts on groups of 4 patches), but its matrix products are not per
image in floating point: a CPU GEMM may pick its blocking and kernel by the number of rows in the call, so a
row's bits can depend on how many other images share the call. Measured: bit-equal on an AMD EPYC, off by up to
4.1e-6 (float32) and 0.047 (bfloat16) in the logits on an Intel Xeon with AVX-512 (66c337e, 2026-11-30).

The fix is batch invariance at image granularity: every call of the tower, from `VisionEncoder.encode` on an
encoder and from `model(...)`/`model.generate(...)` in the monolithic model, runs the unchanged tower on one
image at a time, on a fresh (allocator-aligned) copy of that image's patches, and concatenates the outputs.
Each image then meets exactly the same kernels with exactly the same shapes, whichever part it travels in.
The monolithic model stays HF's `Qwen2VLForConditionalGeneration`; only its tower's batching changes, which
leaves the function it computes unchanged in exact arithmetic.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VisionTransformerPretrainedModel,
    Qwen2VLForConditionalGeneration,
)


class PerImageVisionTower(Qwen2VisionTransformerPretrainedModel):
    """The Qwen2-VL vision tower, called once per image (or video) of its input.

    Same parameters and state dict as `Qwen2VisionTransformerPretrainedModel`; `make_image_invariant` turns a
    loaded tower into one of these in place.
    """

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor,
                **kwargs: Any) -> BaseModelOutputWithPooling:
        """`last_hidden_state` [patches, embed_dim] and `pooler_output` [tokens, hidden] of every image in
        order, each computed by a call of the tower on that image alone."""
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            # Per-layer outputs of separate calls do not concatenate into one call's; refuse rather than guess.
            raise NotImplementedError("the per-image vision tower does not return hidden states or attentions")
        patches = grid_thw.prod(-1).tolist()
        if sum(patches) != hidden_states.shape[0]:
            raise ValueError(f"grid_thw names {sum(patches)} patches, pixel_values has {hidden_states.shape[0]}")
        outputs = [
            # clone: a view into a larger batch could start at another alignment than a lone image's tensor
            super(PerImageVisionTower, self).forward(image.clone(), grid_thw[i:i + 1], **kwargs)
            for i, image in enumerate(hidden_states.split(patches))
        ]
        if len(outputs) == 1:
            return outputs[0]
        return BaseModelOutputWithPooling(
            last_hidden_state=torch.cat([out.last_hidden_state for out in outputs]),
            pooler_output=torch.cat([out.pooler_output for out in outputs]),
        )


def make_image_invariant(model: Qwen2VLForConditionalGeneration) -> Qwen2VLForConditionalGeneration:
    """Make `model`'s vision tower run image by image (in place; parameters untouched); returns `model`."""
    tower = model.model.visual
    if type(tower) is Qwen2VisionTransformerPretrainedModel:
        tower.__class__ = PerImageVisionTower
    elif not isinstance(tower, PerImageVisionTower):
        raise TypeError(f"expected Qwen2-VL's vision tower, got {type(tower).__name__}")
    return model
