"""The model work of each role: the encoder's ViT, the prefill from embeddings, and the monolithic reference.

`VisionEncoder.encode` followed by `PrefillRunner.prefill` computes exactly what one ordinary forward with
`pixel_values` computes, operation for operation, so the logits are bit-identical: the same
`get_image_features` call, the same `masked_scatter` into the text embeddings, the same 3-D mrope positions
from `get_rope_index`, and `logits_to_keep=1`. The vision tower runs image by image in both (`models.vision`),
so how the images are split over encoders cannot change a bit (docs/protocols.md, "What bit-identity rests
on", lists these preconditions).

Devices: every runner works where the model's parameters are (`catalog.model_device`): tensors it creates are
made there, inputs given elsewhere (on the CPU, as the processor and the wire deliver them) are moved there
(without blocking where the source is pinned: keep a pinned source unchanged until the GPU has used it), and
results (logits, embeddings, the KV cache) stay there. A KV cache handed to `DecodeRunner` must already be on
the model's device. On the CPU nothing is moved and the bits are those of before.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, Qwen2VLForConditionalGeneration
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VLAttention,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from epd_lab.models.catalog import model_device
from epd_lab.models.processor import preprocess
from epd_lab.models.sampling import sample


@dataclass(slots=True)
class PrefillResult:
    """What prefill hands to decode: last-position logits, the KV cache and the mrope offset.

    Decode position i (0-based, after the prompt) is `prompt_len + i + rope_delta` on all three mrope axes.
    """

    logits: torch.Tensor  # [1, vocab], last prompt position
    past_key_values: DynamicCache
    rope_delta: int  # mrope max position + 1 - prompt_len (≤ 0 with images: a grid spans fewer positions)
    prompt_len: int

    @property
    def next_position(self) -> int:
        """The mrope position of the first generated token."""
        return self.prompt_len + self.rope_delta

    def kv_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (key, value), each [1, kv_heads, prompt_len, head_dim]."""
        return [(layer.keys, layer.values) for layer in self.past_key_values.layers]


def prompt_positions(model: Qwen2VLForConditionalGeneration, input_ids: torch.Tensor, num_embeds: int,
                     image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The prompt's (ids [1, T] or [T]) 3-D mrope positions [3, 1, T] and rope delta, on the CPU: what HF's
    `get_rope_index` gives (a test holds them equal), in a few numpy operations per image rather than its Python
    walk (0.9 ms of host time before a 2B prefill's first kernel on the H200's host).

    Text token i after the previous item continues at (last position + 1) on all three axes; an image's
    (h/m)·(w/m) tokens take (t, row, column) offsets from the position its run starts at (m: the spatial merge).
    Raises ValueError when the prompt's image_pad count is not `num_embeds`, or its image_pad runs do not match
    `image_grid_thw`.
    """
    ids = _on_cpu(input_ids).reshape(-1).numpy()
    is_pad = ids == model.config.image_token_id
    n_pads = int(is_pad.sum())
    if n_pads != num_embeds:
        raise ValueError(f"prompt has {n_pads} image_pad tokens but {num_embeds} image embeddings were given")
    merge = model.config.vision_config.spatial_merge_size
    grids = [] if image_grid_thw is None else _on_cpu(image_grid_thw).tolist()
    edges = np.flatnonzero(np.diff(np.concatenate(([0], is_pad.astype(np.int8), [0]))))
    runs = list(zip(edges[::2], edges[1::2]))  # [start, end) of each image_pad run
    if len(runs) != len(grids) or any(end - start != t * h * w // merge**2
                                      for (start, end), (t, h, w) in zip(runs, grids)):
        raise ValueError(f"the prompt's image_pad runs {[int(e - s) for s, e in runs]} do not match the grids "
                         f"{grids} (merge {merge})")
    positions = np.empty((3, len(ids)), dtype=np.int64)
    cursor, next_pos = 0, 0
    for (start, end), (t, h, w) in zip(runs, grids):
        positions[:, cursor:start] = np.arange(next_pos, next_pos + start - cursor)
        base = next_pos + start - cursor
        gh, gw = h // merge, w // merge
        rows = np.arange(end - start)  # (t, row, column) of each token in order; a fifth of meshgrid's host time
        positions[0, start:end] = rows // (gh * gw) + base
        positions[1, start:end] = rows // gw % gh + base
        positions[2, start:end] = rows % gw + base
        cursor, next_pos = end, base + max(t, gh, gw)
    positions[:, cursor:] = np.arange(next_pos, next_pos + len(ids) - cursor)
    top = int(positions.max()) + 1 if len(ids) else 0
    return torch.from_numpy(positions)[:, None, :], top - len(ids)


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: itself if already there; a copy otherwise, queued without blocking when it comes
    from pinned host memory (the copy is ordered before the kernels that use it on the same stream)."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=tensor.device.type == "cpu" and tensor.is_pinned())


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    # Integer bookkeeping (image masks, mrope positions) is cheaper on the CPU than as many tiny GPU kernels and
    # syncs; a tensor given on a GPU is fetched once.
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


class VisionEncoder:
    """The encode role's model work: images → the merged vision embeddings the LLM consumes."""

    def __init__(self, model: Qwen2VLForConditionalGeneration) -> None:
        self.model = model

    @property
    def hidden_size(self) -> int:
        """Width of one embedding row (the LLM hidden size)."""
        return self.model.config.vision_config.hidden_size

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Embeddings [n_tokens, hidden] of all images, concatenated in order (the PatchMerger output), on the
        model's device. Both inputs are moved there: the tower's rotary positions come from `image_grid_thw`
        and must be on the device of its activations."""
        device = model_device(self.model)
        features = self.model.model.get_image_features(_to(pixel_values, device), _to(image_grid_thw, device),
                                                       return_dict=True)
        return torch.cat(features.pooler_output, dim=0)

    def encode_images(self, images: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """Preprocess and encode PIL images → (embeddings [n_tokens, hidden] on the model's device,
        image_grid_thw [n_images, 3] on the CPU, as the processor made it)."""
        pixel_values, image_grid_thw = preprocess(images, model_device(self.model))
        return self.encode(pixel_values, image_grid_thw), image_grid_thw


class PrefillRunner:
    """The prefill role's model work: prompt ids + received vision embeddings → logits, KV cache, rope delta."""

    def __init__(self, model: Qwen2VLForConditionalGeneration) -> None:
        self.model = model

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None,
                image_grid_thw: torch.Tensor | None) -> PrefillResult:
        """Run the LLM over the prompt with `image_embeds` in place of the image_pad tokens.

        Inputs may be on any device; the result's logits and cache are on the model's. Unlike `model.generate`,
        this leaves no per-request state on the model (`model.model.rope_deltas`).
        """
        device = model_device(self.model)
        position_ids, rope_delta = prompt_positions(self.model, input_ids,
                                                    0 if image_embeds is None else image_embeds.shape[0],
                                                    image_grid_thw)
        input_ids = _to(input_ids, device)
        inputs_embeds = self.model.get_input_embeddings()(input_ids)
        if image_embeds is not None:
            # The monolithic forward casts to the embedding dtype before scattering; so do we.
            image_embeds = _to(image_embeds, device).to(inputs_embeds.dtype)
            image_mask = input_ids == self.model.config.image_token_id  # made there: no host-to-device copy
            inputs_embeds = inputs_embeds.masked_scatter(image_mask.unsqueeze(-1), image_embeds)
        position_ids = _to(position_ids, device)
        out = self.model(
            inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=True, logits_to_keep=1,
        )
        return PrefillResult(
            logits=out.logits[:, -1, :],
            past_key_values=out.past_key_values,
            rope_delta=rope_delta,
            prompt_len=input_ids.shape[1],
        )


class DecodeRunner:
    """The decode role's model work: steps after prefill, on a KV cache that came from elsewhere.

    Token i after the prompt is fed at mrope position `next_position + i` on all three axes, where
    `next_position` is `prompt_len + rope_delta` and the rope delta travels with the KV from prefill: without
    it, decode runs and silently produces other tokens.
    """

    def __init__(self, model: Qwen2VLForConditionalGeneration) -> None:
        self.model = model

    @torch.no_grad()
    def step(self, token: int, cache: DynamicCache, position: int) -> torch.Tensor:
        """Feed one token at `position`; returns the next logits [1, vocab] on the model's device (the cache,
        which must be there too, grows by one)."""
        device = model_device(self.model)
        # torch.full: a fill on the device, where torch.tensor([[token]], device=...) would copy from the host
        input_ids = torch.full((1, 1), token, dtype=torch.long, device=device)
        position_ids = torch.full((3, 1, 1), position, dtype=torch.long, device=device)
        out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1, :]

    @torch.no_grad()
    def step_batch(self, tokens: Sequence[int], caches: Sequence[DynamicCache],
                   positions: Sequence[int]) -> torch.Tensor:
        """One batched step for B requests: feed `tokens[i]` at `positions[i]` on `caches[i]`; logits [B, vocab].

        The caches may hold different lengths and stay separate: embeddings, norms, projections, MLPs and the LM
        head run once on all B rows, attention runs per row on that row's own cache with the very call `step`
        makes (no padding, no mask). Each cache grows by one position, exactly as `step` grows it.

        Bits: wherever the kernels give each row of a [B, k] @ [k, n] product the bits of a [1, k] product, the
        logits equal `step`'s bit for bit (bfloat16 on CPU here); float32 CPU GEMM sums in another order for B > 1,
        so its logits differ from `step`'s in the last bits (max abs ~1e-5 on the tiny model). Not left-padding
        into one cache with a mask: padding reorders attention's sums, and in bfloat16 that flipped a greedy
        token within 32 steps (measured); per-row attention keeps `step`'s bits. tests/test_batching.py pins
        this sequence against `step`, so a transformers release that changes the decoder layer shows there.
        """
        if not len(tokens) == len(caches) == len(positions) > 0:
            raise ValueError(f"step_batch needs as many tokens, caches and positions (>= 1), got "
                             f"{len(tokens)}, {len(caches)}, {len(positions)}")
        text = self.model.model.language_model
        if text.has_sliding_layers:
            raise NotImplementedError("step_batch does not do sliding-window attention")
        # The decoder layer's own sequence (Qwen2VLDecoderLayer.forward), with attention split per row.
        device = model_device(self.model)
        hidden = text.embed_tokens(torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1))  # [B, 1, h]
        position_ids = torch.tensor(positions, dtype=torch.long, device=device).view(1, -1, 1).expand(3, -1, -1)
        cos, sin = text.rotary_emb(hidden, position_ids)
        for layer in text.layers:
            hidden = hidden + _ragged_attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, caches)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(text.norm(hidden))[:, -1, :]

    def greedy(self, prefill_logits: torch.Tensor, cache: DynamicCache, next_position: int,
               max_new_tokens: int) -> list[int]:
        """`max_new_tokens` greedy tokens: the first from the prefill's logits, then one step each (each token
        is read back to the host: the next step needs it)."""
        tokens = [int(prefill_logits.argmax(-1))]
        for i in range(max_new_tokens - 1):
            tokens.append(int(self.step(tokens[-1], cache, next_position + i).argmax(-1)))
        return tokens


def _ragged_attention(attn: Qwen2VLAttention, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      caches: Sequence[DynamicCache]) -> torch.Tensor:
    """`Qwen2VLAttention.forward` for B one-token rows whose caches differ in length: projections batched,
    each row's cache update and attention on its own, as a batch of one makes them."""
    batch = hidden.shape[0]
    query = attn.q_proj(hidden).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
    key = attn.k_proj(hidden).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
    value = attn.v_proj(hidden).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    rows = []
    for row, cache in enumerate(caches):
        keys, values = cache.update(key[row:row + 1], value[row:row + 1], attn.layer_idx)
        # mask None: a single query token attends to its whole cache, as in `step` (create_causal_mask gives None)
        out, _ = attention(attn, query[row:row + 1], keys, values, None, dropout=0.0, scaling=attn.scaling,
                           sliding_window=attn.sliding_window, position_ids=None)
        rows.append(out)
    return attn.o_proj(torch.cat(rows).reshape(batch, 1, -1).contiguous())


def _vision_kwargs(model: Qwen2VLForConditionalGeneration, input_ids: torch.Tensor,
                   pixel_values: torch.Tensor | None,
                   image_grid_thw: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    # transformers 5 refuses image inputs without mm_token_type_ids (it no longer infers them from input_ids),
    # and generate() chokes on an explicit pixel_values=None, so a text-only prompt passes nothing.
    # `input_ids` is already on the model's device; the rest is moved there (the ViT needs its grid there).
    if pixel_values is None:
        return {}
    device = input_ids.device
    mm_token_type_ids = (input_ids == model.config.image_token_id).int()
    return {"pixel_values": _to(pixel_values, device), "image_grid_thw": _to(image_grid_thw, device),
            "mm_token_type_ids": mm_token_type_ids}


@torch.no_grad()
def monolithic_prefill(model: Qwen2VLForConditionalGeneration, input_ids: torch.Tensor,
                       pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """Reference: last-position logits [1, vocab] of one ordinary forward that runs the ViT itself (inputs moved
    to the model's device, logits left there)."""
    input_ids = _to(input_ids, model_device(model))
    out = model(input_ids=input_ids, logits_to_keep=1, **_vision_kwargs(model, input_ids, pixel_values, image_grid_thw))
    return out.logits[:, -1, :]


class _SeededDraw(LogitsProcessor):
    """Makes `model.generate`'s greedy pick the token `epd_lab.models.sampling` draws: the servers' sampler, with
    HF's forward (its scores are the logits in float32, which hold bfloat16 ones exactly)."""

    def __init__(self, prompt_len: int, temperature: float, seed: int) -> None:
        self.prompt_len, self.temperature, self.seed = prompt_len, temperature, seed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_len
        token = sample(scores, [self.temperature] * len(scores), [self.seed] * len(scores), [step] * len(scores))
        return torch.full_like(scores, -torch.inf).scatter_(1, token[:, None], 0.0)


@torch.no_grad()
def monolithic_generate(model: Qwen2VLForConditionalGeneration, input_ids: torch.Tensor,
                        pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                        max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """Reference: the `max_new_tokens` tokens of `model.generate` (EOS is off, so exactly that many), greedy, or
    above temperature 0 drawn as the servers draw (`epd_lab.models.sampling`, token i with the noise of (`seed`,
    i)); inputs are moved to the model's device."""
    input_ids = _to(input_ids, model_device(model))
    draw = [_SeededDraw(input_ids.shape[1], temperature, seed)] if temperature > 0 else []
    sequences = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList(draw),
        **_vision_kwargs(model, input_ids, pixel_values, image_grid_thw),
    )
    return sequences[0, input_ids.shape[1]:].tolist()
