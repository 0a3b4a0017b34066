"""`Qwen2LM`: Qwen2-VL's language model written from the architecture, over a `PagedKVCache` it attends in place.

It takes its weights from a loaded `Qwen2VLForConditionalGeneration` (tiny, a published shape, or a
directory: the same state dict) and fuses them as serving engines do: Q, K and V into one projection with one
bias, gate and up into one. The KV never leaves the cache's blocks: prefill writes each token's K and V into
its slot as the rotary kernel produces them, decode appends one slot per step and attends over the sequence's
blocks where they lie (`ops.decode_attention`). No `DynamicCache`, no copy.

Positions: prefill takes the prompt's 3-D mrope positions (``[3, T]``, from `get_rope_index`); decode takes one
position per token, the same on all three axes (``prompt_len + rope_delta + i``), which makes mrope the plain
1-D rotary. Cache indices are separate: token t of a sequence lives in slot
``block_table[t // block_size] * block_size + t % block_size``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers import Qwen2VLForConditionalGeneration

from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.models.catalog import model_device
from epd_lab.models.runtime.kernels import open_ops
from epd_lab.models.runtime.tp import TPGroup, check_model, input_columns, output_rows


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: list[tuple[torch.Tensor, torch.Tensor | None]]  # fused: [(W [(H + 2 Hkv) D, hidden], b)]; else q, k, v
    o_weight: torch.Tensor
    post_norm: torch.Tensor
    gate_up: list[tuple[torch.Tensor, None]]  # fused: [(W [2 I, hidden], None)]; else gate, up
    down_weight: torch.Tensor


def _project(h: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """One fused projection, or HF's separate ones side by side (the same values, op for op)."""
    if len(parts) == 1:
        return F.linear(h, *parts[0])
    return torch.cat([F.linear(h, w, b) for w, b in parts], dim=-1)


class _State(NamedTuple):
    """What flows between stages: the hidden states, the residual stream (None before the first layer) and the
    rotary cos/sin of the tokens' positions."""

    x: torch.Tensor
    residual: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor


def layer_bounds(num_layers: int, growth: int = 2) -> list[int]:
    """Where a forward's runs of layers end: 1, 3, 7, 15, ... (each run `growth` times the one before), then
    `num_layers`. A run's launch then takes less host time than the run before it takes on the GPU (on the H200,
    2B decode: ~23 us launched against ~55 us run per layer), so the GPU waits only for the first run's launch."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    bounds, size = [], 1
    while not bounds or bounds[-1] < num_layers:
        bounds.append(min(num_layers, (bounds[-1] if bounds else 0) + size))
        size *= growth
    return bounds


@dataclass(frozen=True)
class Stages:
    """One forward as a chain: `parts(bounds)` are callables, the first taking the forward's input, each next
    one its predecessor's output, the last returning the logits. `run(input)` is the whole forward."""

    lm: "Qwen2LM"
    begin: Callable[[torch.Tensor], _State]
    slots: torch.Tensor
    attend: Callable[..., torch.Tensor]
    end: Callable[[_State], torch.Tensor]

    def parts(self, bounds: Sequence[int]) -> list[Callable[[Any], Any]]:
        """The forward cut after each layer count in `bounds` (`layer_bounds`; the last is the number of
        layers): the input's stage and the first run of layers are one part, the last run and the head one."""
        starts = [0, *bounds[:-1]]

        def part(i: int) -> Callable[[Any], Any]:
            start, stop = starts[i], bounds[i]

            def run(value: Any) -> Any:
                state = self.begin(value) if i == 0 else value
                state = self.lm.layers_forward(state, self.slots, self.attend, start, stop)
                return self.end(state) if i == len(bounds) - 1 else state
            return run
        return [part(i) for i in range(len(bounds))]

    def run(self, value: torch.Tensor) -> torch.Tensor:
        """The whole forward on `value`."""
        return self.parts([len(self.lm.layers)])[0](value)


class Qwen2LM:
    """The language model's forward over a paged KV cache; see the module docstring.

    Args:
        model: a loaded Qwen2-VL. Fusing moves its Q/K/V and gate/up weights into one tensor each and leaves
            HF's modules views into it: the same values, so HF's forward is unchanged, and no second copy of
            the weights (15 GB for 7B).
        cache: the paged KV cache to write and attend (its geometry and dtype must be the model's).
        fuse: fuse the projections (default: on a GPU; on the CPU HF's separate ones keep HF's bits).
        tp: this rank's place in a tensor-parallel group (`runtime.tp`): it keeps its heads' and its MLP share's
            weights and all-reduces after o_proj and down; `cache` holds its KV heads only. None: the whole model.
    """

    def __init__(self, model: Qwen2VLForConditionalGeneration, cache: PagedKVCache,
                 fuse: bool | None = None, tp: TPGroup | None = None) -> None:
        text = model.model.language_model
        config = text.config
        self.device = model_device(model)
        self.dtype = text.embed_tokens.weight.dtype
        self.tp = tp = tp or TPGroup(0, 1)
        check_model(model.config, tp.size)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q_heads, kv_heads = tp.head_range(config.num_attention_heads), tp.kv_head_range(config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = q_heads[1] - q_heads[0], kv_heads[1] - kv_heads[0]
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype) != (
                config.num_hidden_layers, self.num_kv_heads, self.head_dim, self.dtype):
            raise ValueError(f"{cache!r} does not fit the model ({config.num_hidden_layers} layers, "
                             f"{self.num_kv_heads} KV heads of {self.head_dim}, {self.dtype})")
        if getattr(text, "has_sliding_layers", False):
            raise NotImplementedError("Qwen2LM does not do sliding-window attention")
        self.cache = cache
        self.ops = open_ops(self.device)
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.embed = text.embed_tokens.weight
        self.norm = text.norm.weight
        self.lm_head = model.lm_head.weight
        self.inv_freq = text.rotary_emb.inv_freq.to(self.device, torch.float32)
        self.mrope_section = list(text.rotary_emb.mrope_section)
        self.max_position = config.max_position_embeddings
        # cos and sin [max_position, D] of 1-D positions; decode positions must stay below max_position
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        fuse = self.device.type == "cuda" if fuse is None else fuse

        d, inter = self.head_dim, config.intermediate_size // tp.size
        # each projection's output rows this rank keeps: q, k, v by heads; gate, up by its MLP share
        qkv_rows = [(q_heads[0] * d, q_heads[1] * d), (kv_heads[0] * d, kv_heads[1] * d),
                    (kv_heads[0] * d, kv_heads[1] * d)]
        mlp_rows = [(tp.rank * inter, (tp.rank + 1) * inter)] * 2

        def parts(linears: tuple[torch.nn.Linear, ...], shares: list[tuple[int, int]],
                  ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
            if tp.size > 1:  # a share of each, fused into a copy where asked (HF's parameters stay whole)
                sliced = [output_rows(m.weight, m.bias, *share) for m, share in zip(linears, shares)]
                if not fuse:
                    return sliced
                bias = None if sliced[0][1] is None else torch.cat([b for _, b in sliced])
                return [(torch.cat([w for w, _ in sliced]), bias)]
            if not fuse:
                return [(m.weight, m.bias) for m in linears]
            weight = torch.cat([m.weight for m in linears])
            bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
            start = 0
            for m in linears:  # HF's parameters become views of the fused tensors: one copy of the weights
                rows = m.weight.shape[0]
                m.weight.data = weight[start:start + rows]
                if bias is not None:
                    m.bias.data = bias[start:start + rows]
                start += rows
            return [(weight, bias)]

        with torch.no_grad():
            self.layers = [_Layer(
                input_norm=layer.input_layernorm.weight,
                qkv=parts((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), qkv_rows),
                o_weight=self._row_parallel(layer.self_attn.o_proj.weight, *qkv_rows[0]),
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=parts((layer.mlp.gate_proj, layer.mlp.up_proj), mlp_rows),
                down_weight=self._row_parallel(layer.mlp.down_proj.weight, *mlp_rows[0]),
            ) for layer in text.layers]
        self.vocab_size = self.lm_head.shape[0]

    def _row_parallel(self, weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """A row-parallel layer's weight: its input columns ``[start, stop)`` under TP, else the weight itself."""
        return weight if self.tp.size == 1 else input_columns(weight, start, stop)

    # ---- rotary ----
    def _cos_sin(self, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def mrope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of 3-D mrope positions [3, T] (HF's recomposition: frequency section i takes axis
        i % 3)."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, D/2]
        freqs = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(self.mrope_section, dim=-1))], dim=-1)
        return self._cos_sin(freqs)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, D] of 1-D positions [B] (mrope with three equal axes): rows of a table made once with the
        same operations, so the same values as `mrope`'s, in one lookup instead of seven kernels."""
        if self._rope_table is None:
            self._rope_table = self._cos_sin(torch.arange(self.max_position, device=self.device)[:, None].float()
                                             * self.inv_freq)
        return F.embedding(positions, self._rope_table[0]), F.embedding(positions, self._rope_table[1])

    # ---- forward ----
    # A forward is a chain of stages (`Stages`): the inputs' first part, then runs of layers, then the head. Whole,
    # it is `prefill`/`decode`; a decode cut at `layer_bounds` is one CUDA graph a part (`runtime.graph`), so that
    # the GPU runs a part while the host launches the next. The same kernels on the same tensors: the same bits.
    def prefill_stages(self, positions: torch.Tensor, slots: torch.Tensor,
                       last: torch.Tensor | None = None) -> "Stages":
        """`prefill`'s stages, their first taking the prompt's input embeddings [T, hidden]."""

        def begin(embeds: torch.Tensor) -> _State:
            return _State(embeds, None, *self.mrope(positions))

        def attend(q, k, v, k_cache, v_cache):
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], is_causal=True, scale=self.scale,
                                                 enable_gqa=True)
            return out[0].transpose(0, 1)

        def end(state: _State) -> torch.Tensor:
            x, residual = state.x, state.residual
            if last is None:
                x, residual = x[-1:], residual[-1:]
            else:
                x, residual = x.index_select(0, last), residual.index_select(0, last)
            return self._head(x, residual)[0]

        return Stages(self, begin, slots, attend, end)

    def decode_stages(self, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor) -> "Stages":
        """`decode`'s stages, their first taking the B tokens [B]."""

        def begin(tokens: torch.Tensor) -> _State:
            return _State(F.embedding(tokens, self.embed), None, *self.rope(positions))

        def attend(q, k, v, k_cache, v_cache):
            return self.ops.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, self.scale)

        return Stages(self, begin, slots, attend, lambda state: self._head(state.x, state.residual))

    def _head(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.ops.add_rms_norm(x, residual, self.norm, self.eps)
        return F.linear(h, self.lm_head)

    def layers_forward(self, state: "_State", slots: torch.Tensor, attend, start: int, stop: int) -> "_State":
        """Layers [start, stop) on `state`: each token's K/V stored in its row `slots[t]`, `attend` the attention
        over them (the prompt itself, or the cache's blocks)."""
        ops, x, residual = self.ops, state.x, state.residual
        for i in range(start, stop):
            layer = self.layers[i]
            k_cache, v_cache = self.cache.layer(i)
            h, residual = ops.add_rms_norm(x, residual, layer.input_norm, self.eps)
            qkv = _project(h, layer.qkv)
            q, k, v = ops.rope_store(qkv, state.cos, state.sin, slots, k_cache, v_cache, self.num_heads,
                                     self.num_kv_heads)
            x = self.tp.all_reduce(F.linear(attend(q, k, v, k_cache, v_cache).reshape(x.shape[0], -1),
                                            layer.o_weight))
            h, residual = ops.add_rms_norm(x, residual, layer.post_norm, self.eps)
            x = self.tp.all_reduce(F.linear(ops.silu_mul(_project(h, layer.gate_up)), layer.down_weight))
        return _State(x, residual, state.cos, state.sin)

    @torch.no_grad()
    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """Run the prompt's input embeddings [T, hidden] at mrope `positions` [3, T], writing token t's K/V into
        cache row `slots[t]` (< 0: not written). Causal attention over the prompt itself. Returns the logits
        [vocab] of row `last` (a [1] index tensor; default the last row), which alone goes through the final norm
        and the LM head (HF's ``logits_to_keep=1``). Rows after `last` may be padding: nothing before them
        attends to them. No host sync (graph-capturable)."""
        return self.prefill_stages(positions, slots, last).run(embeds)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One step of B sequences: token b [B] at rope position `positions[b]`, its K/V stored in row `slots[b]`,
        then attending over the first `seq_lens[b]` tokens (the new one included) of blocks `block_tables[b]`.
        Returns logits [B, vocab]. No host sync on a GPU (graph-capturable)."""
        return self.decode_stages(positions, slots, block_tables, seq_lens).run(tokens)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] of ids [T]."""
        return F.embedding(input_ids, self.embed)
