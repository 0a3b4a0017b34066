"""Model runtimes: the three calls a role makes of its model, over a paged KV cache that holds the KV from
prefill to the last decode step.

    runtime = open_runtime("fast", model, cache)               # or "hf": HF transformers, eager (the baseline)
    embeds = runtime.encode(pixel_values, image_grid_thw)      # encoder: images -> embeddings [tokens, hidden]
    out = runtime.prefill(input_ids, embeds, image_grid_thw, block_table)  # prefill: KV written into the blocks
    plan = runtime.plan_prefill(input_ids, image_grid_thw, block_table)    # its host inputs, before the embeddings
    out = runtime.prefill(input_ids, embeds, image_grid_thw, block_table, plan=plan)
    gate = runtime.prefill_gate(num_tokens, embeds)  # GPU: None, or queue the prefill before `embeds` hold values
    out = runtime.prefill(input_ids, embeds, image_grid_thw, block_table, plan=plan, gate=gate)
    gate.open(); out.wait()                                   # once they do; then read out.logits
    logits = runtime.decode(tokens, positions, block_tables, seq_lens)     # decode: attends over the blocks

Block ids come from the caller's `BlockManager`; a runtime keeps no per-request state. Names map to
``module:attribute`` and are imported when opened (as `epd_lab.transfer.registry`), so listing them imports
neither runtime and ``--runtime hf`` never compiles a Triton kernel.

Bits: within one runtime, the split (images encoded in parts, KV moved into another cache's blocks) equals the
monolithic use bit for bit at the same decode batch; across runtimes, answers agree to rounding (tests state
the bound).
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import Qwen2VLForConditionalGeneration

from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.models.runtime.gate import Gate
from epd_lab.models.runners import _on_cpu, prompt_positions
from epd_lab.models.sampling import sample

__all__ = ["RUNTIMES", "Gate", "ModelRuntime", "PrefillOutput", "PrefillPlan", "RuntimeBase", "continue_tokens",
           "generate", "open_runtime", "prompt_positions", "token_slot"]

RUNTIMES: dict[str, str] = {
    "hf": "epd_lab.models.runtime.hf:HFRuntime",
    "fast": "epd_lab.models.runtime.fast:FastRuntime",
}


@dataclass(slots=True)
class PrefillOutput:
    """What prefill hands to decode besides the KV in the blocks."""

    logits: torch.Tensor  # [vocab], the last prompt position, on the model's device
    rope_delta: int  # decode position i is prompt_len + rope_delta + i (mrope; it travels with the KV)
    prompt_len: int
    ready: Any = None  # a gated prefill's torch.cuda.Event: `wait` before reading the logits

    def wait(self) -> None:
        """Block until the logits are written (a gated prefill's; others are ready in the caller's stream
        order already)."""
        if self.ready is not None:
            self.ready.synchronize()

    @property
    def next_position(self) -> int:
        """The mrope position of the first generated token."""
        return self.prompt_len + self.rope_delta


@dataclass(slots=True, frozen=True)
class PrefillPlan:
    """A prompt's host-side prefill inputs, made from its ids, grids and blocks alone (`RuntimeBase.plan_prefill`):
    a prefill server makes them while the embeddings are on their way, so that the thread that wakes when they
    land goes straight to the forward."""

    ids: torch.Tensor  # [T] on the CPU
    positions: torch.Tensor  # mrope positions [3, T] on the CPU
    rope_delta: int
    slots: torch.Tensor  # each token's cache row [T] on the CPU
    num_image_tokens: int  # the prompt's image_pad tokens: the embeddings the forward must be given
    block_table: tuple[int, ...]


class ModelRuntime(Protocol):
    """What every runtime offers; see the module docstring."""

    name: str
    model: Qwen2VLForConditionalGeneration
    cache: PagedKVCache | None  # None: encode only

    def encode(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged vision embeddings [tokens, hidden] of every image, in order, on the model's device."""

    def plan_prefill(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                     block_table: Sequence[int]) -> PrefillPlan:
        """The prompt's host-side inputs, before its embeddings exist (`PrefillPlan`)."""

    def prefill_gate(self, num_tokens: int, image_embeds: torch.Tensor | None) -> Gate | None:
        """A `Gate` for a prefill of `num_tokens` tokens queued before its embeddings (`image_embeds`, where they
        will land) hold their values, or None where this runtime cannot wait on the GPU for it (then prefill
        once they landed)."""

    def prefill(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None,
                image_grid_thw: torch.Tensor | None, block_table: Sequence[int],
                plan: PrefillPlan | None = None, gate: Gate | None = None) -> PrefillOutput:
        """Run the prompt (ids [1, T] or [T]) with `image_embeds` in place of its image_pad tokens; its KV goes
        into the blocks `block_table` (enough for T tokens). `plan`: the same prompt's `plan_prefill`, made
        earlier (a runtime may compute them again instead). `gate` (from `prefill_gate`): the forward is
        queued and starts on the GPU when the gate opens, the embeddings read then; `PrefillOutput.wait`
        before reading the logits, and open the gate on every path."""

    def decode(self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
               seq_lens: Sequence[int]) -> torch.Tensor:
        """One step of B sequences: token b at mrope position `positions[b]`, stored as the `seq_lens[b]`-th token
        (1-based) of blocks `block_tables[b]`, attending over all of them. Returns logits [B, vocab]."""

    def close(self) -> None:
        """Release what the runtime holds besides the model and the cache (graphs, their memory pool)."""


class RuntimeBase:
    """What every runtime shares: `plan_prefill`, and it is a context manager whose exit calls `close`."""

    model: Qwen2VLForConditionalGeneration
    cache: PagedKVCache | None

    def plan_prefill(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                     block_table: Sequence[int]) -> PrefillPlan:
        """The prompt's ids, mrope positions and rope delta, and its tokens' cache rows in `block_table`, on the
        CPU. Raises ValueError when the prompt's image_pad runs do not match `image_grid_thw`, or the blocks
        cannot hold it."""
        if self.cache is None:
            raise ValueError("this runtime was opened without a KV cache: it only encodes")
        ids = _on_cpu(input_ids).reshape(-1)
        num_image_tokens = int((ids == self.model.config.image_token_id).sum())
        positions, rope_delta = prompt_positions(self.model, ids, num_image_tokens, image_grid_thw)
        return PrefillPlan(ids, positions[:, 0], rope_delta, self.cache.slots(block_table, len(ids), device="cpu"),
                           num_image_tokens, tuple(block_table))

    def checked_plan(self, plan: PrefillPlan | None, input_ids: torch.Tensor, image_embeds: torch.Tensor | None,
                     image_grid_thw: torch.Tensor | None, block_table: Sequence[int]) -> PrefillPlan:
        """`plan`, checked against the prefill it is used for (ValueError when its embeddings or blocks are not
        the planned ones), else the plan made now."""
        if plan is None:
            plan = self.plan_prefill(input_ids, image_grid_thw, block_table)
        num_embeds = 0 if image_embeds is None else len(image_embeds)
        if num_embeds != plan.num_image_tokens:
            raise ValueError(f"prompt has {plan.num_image_tokens} image_pad tokens but {num_embeds} image embeddings "
                             f"were given")
        if plan.block_table != tuple(block_table):
            raise ValueError("the prefill's block table is not the one its plan was made for")
        return plan

    def prefill_gate(self, num_tokens: int, image_embeds: torch.Tensor | None) -> Gate | None:
        """None: this runtime prefills once the embeddings landed (see `ModelRuntime.prefill_gate`)."""
        return None

    def close(self) -> None:
        """Release what the runtime holds besides the model and the cache (none here). Idempotent."""

    def __enter__(self) -> "RuntimeBase":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_runtime(name: str, model: Qwen2VLForConditionalGeneration, cache: PagedKVCache | None = None,
                 **options: Any) -> Any:
    """Open the runtime registered as `name` over `model` and `cache` (`options` go to its constructor). Without a
    cache the runtime only encodes (an encoder's).

    Raises:
        ValueError: an unknown name; the message lists the registered ones.
    """
    target = RUNTIMES.get(name)
    if target is None:
        raise ValueError(f"unknown runtime {name!r}; choose one of {', '.join(RUNTIMES)}")
    module_path, attr = target.split(":")
    return getattr(importlib.import_module(module_path), attr)(model, cache, **options)


def token_slot(block_table: Sequence[int], index: int, block_size: int) -> int:
    """The cache row of token `index` (0-based) of a sequence whose blocks are `block_table`."""
    return block_table[index // block_size] * block_size + index % block_size


def continue_tokens(runtime: Any, first_token: int, next_position: int, prompt_len: int,
                    block_table: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                    seed: int = 0) -> list[int]:
    """`max_new_tokens` tokens of one sequence whose prompt's KV (`prompt_len` tokens) is in `block_table`, as the
    decode role makes them: `first_token` (prefill's), then decode steps of batch one at mrope positions
    `next_position + i`, each storing its input's KV in the next slot of `block_table` (which must hold prompt +
    max_new_tokens - 1 tokens), token i + 1 drawn at `temperature` with the noise of (`seed`, i + 1)
    (`epd_lab.models.sampling`; greedy at 0)."""
    tokens = [first_token]
    for i in range(max_new_tokens - 1):
        logits = runtime.decode([tokens[-1]], [next_position + i], [block_table], [prompt_len + i + 1])
        tokens.append(int(sample(logits, [temperature], [seed], [i + 1])))
    return tokens


def generate(runtime: Any, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
             image_grid_thw: torch.Tensor | None, max_new_tokens: int, block_table: Sequence[int],
             temperature: float = 0.0, seed: int = 0) -> list[int]:
    """The monolithic use of one runtime: encode, prefill into `block_table`, token 0 drawn from its logits as
    prefill draws it, then `continue_tokens`; returns the `max_new_tokens` tokens. `block_table` must hold prompt +
    max_new_tokens - 1 tokens."""
    embeds = None if pixel_values is None else runtime.encode(pixel_values, image_grid_thw)
    out = runtime.prefill(input_ids, embeds, image_grid_thw, block_table)
    first = int(sample(out.logits.reshape(1, -1), [temperature], [seed], [0]))
    return continue_tokens(runtime, first, out.next_position, out.prompt_len, block_table, max_new_tokens,
                           temperature, seed)
