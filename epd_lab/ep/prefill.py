"""Prefill on embeddings that came from the encoders: the receiver plus the model's prefill runner."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from PIL import Image

from epd_lab.ep.receiver import EmbeddingReceiver, EPDError, Landing, ReceivedEmbeddings
from epd_lab.models import PrefillResult, PrefillRunner, build_input_ids, monolithic_prefill, preprocess
from epd_lab.serving.placement import synchronize
from epd_lab.trace import Span


@dataclass
class ReceivedPrompt:
    """A request's prompt once its images' embeddings arrived: what a prefill forward takes."""

    input_ids: torch.Tensor  # [1, T]: the images' pads, then the text
    image_embeds: torch.Tensor | None  # [image tokens, hidden], None for a text-only prompt
    image_grid_thw: torch.Tensor | None  # [images, 3]
    received: ReceivedEmbeddings


@dataclass
class EPDResult:
    """What one request's E→P prefill produced, with every span of it (encoders' included)."""

    rid: str
    prefill: PrefillResult
    received: ReceivedEmbeddings
    spans: list[Span]


class EPDPrefill:
    """The prefill role of E→P: collect a request's image embeddings, then run prefill on them."""

    def __init__(self, receiver: EmbeddingReceiver, model: torch.nn.Module) -> None:
        self.receiver = receiver
        self.runner = PrefillRunner(model)

    def prefill(self, text: str, mm_items: list[str], rid: str | None = None,
                before_forward: Callable[[torch.Tensor], None] | None = None) -> EPDResult:
        """Encode `mm_items` on the encoders and prefill the prompt (images first, then `text`); `before_forward`
        is called with the prompt's ids once they are known, before the LLM runs (the prefill server announces
        the KV's size there)."""
        rid = rid or uuid.uuid4().hex
        prompt = self.receive(text, mm_items, rid)
        if before_forward is not None:
            before_forward(prompt.input_ids)
        with self.receiver.recorder.span("prefill", rid):
            result = self.runner.prefill(prompt.input_ids, prompt.image_embeds, prompt.image_grid_thw)
            synchronize(result.logits.device)  # GPU kernels run asynchronously: the span ends when they did
        return EPDResult(rid, result, prompt.received, self.receiver.recorder.spans(rid))

    def receive(self, text: str, mm_items: list[str], rid: str,
                on_prompt: Callable[[torch.Tensor, torch.Tensor, Landing | None], None] | None = None
                ) -> ReceivedPrompt:
        """The E→P part alone: encode `mm_items` on the encoders, collect the embeddings, build the prompt (the
        images, then `text`). A prefill server runs its own runtime's forward on the result. The prompt's ids and
        grids are built from the encoders' /encode answers, while the embeddings are on their way, and handed to
        `on_prompt(input_ids, image_grid_thw, landing)` then, with the receiver's `Landing` (mooncake; None
        otherwise): the prefill server checks the prompt's length, holds its KV and plans its forward there, and
        on a GPU queues the forward itself, gated until the embeddings land."""
        announced: dict[str, Any] = {}  # from the /encode answers: "grids" (and as a tensor), the prompt's "ids"

        def on_sizes(grids: dict[str, list[list[int]]], landing: Landing | None) -> None:
            announced["grids"], announced["ids"] = grids["image"], build_input_ids(text, grids["image"])
            announced["grid_thw"] = torch.tensor(grids["image"])
            if on_prompt is not None:
                on_prompt(announced["ids"], announced["grid_thw"], landing)

        got = self.receiver.receive(mm_items, rid, on_sizes=on_sizes)
        grids = got.grid_thw["image"]
        if grids != announced["grids"]:  # the notifies must describe what the /encode answers announced
            raise EPDError(f"request {rid}: the embeddings' grids {grids} are not the /encode answers' "
                           f"{announced['grids']}")
        return ReceivedPrompt(announced["ids"], got.embeddings["image"], announced["grid_thw"], got)


def reference_prefill(model: torch.nn.Module, text: str, images: Sequence[Image.Image]) -> torch.Tensor:
    """The monolithic model's prefill logits for the prompt `EPDPrefill.prefill` builds (the images, then
    `text`), with the ViT in this process: what a split prefill's logits must equal bit for bit."""
    pixel_values, grid = preprocess(list(images))
    return monolithic_prefill(model, build_input_ids(text, grid.tolist()), pixel_values, grid)
