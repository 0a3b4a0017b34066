"""A campaign leg's prompts: distinct chat prompts deterministic in a seed, with each one's answer sent alone
(`solo`) and the monolithic model's (`reference`), against which the leg's answers are judged."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from epd_lab.campaign.client import Outcome, chat, client_session
from epd_lab.noise import image_uri
from epd_lab.servers.openai_api import MODEL_ID


@dataclass(slots=True)
class Prompts:
    """`count` distinct chat prompts (an image of `image_size`² and a text each, `images` images in each),
    deterministic in `seed`; `solo` holds each one's answer sent alone, `reference` the monolithic model's."""

    seed: int
    count: int = 8
    image_size: int = 224
    images: int = 1
    max_tokens: int = 8
    messages: list[list[dict[str, Any]]] = field(default_factory=list)
    solo: list[str | None] = field(default_factory=list)
    reference: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        texts = ("what is in this picture?", "describe the image", "name three colours you see", "count the shapes")
        for i in range(self.count):
            content = [{"type": "image_url", "image_url": {"url": image_uri(self.seed * 7919 + i * 31 + j,
                                                                           self.image_size)}}
                       for j in range(self.images)]
            content.append({"type": "text", "text": rng.choice(texts)})
            self.messages.append([{"role": "user", "content": content}])

    def body(self, i: int, stream: bool = True) -> dict[str, Any]:
        """The request body of prompt `i` (greedy)."""
        return {"model": MODEL_ID, "messages": self.messages[i], "max_tokens": self.max_tokens, "temperature": 0,
                "stream": stream}

    def compute_reference(self) -> None:
        """The monolithic model's answer to every prompt, in this process (`servers.reference`)."""
        from epd_lab.models import configure_torch, load_model
        from epd_lab.servers.reference import monolithic_chat

        configure_torch()
        model = load_model()
        self.reference = [monolithic_chat(model, m, self.max_tokens) for m in self.messages]

    async def compute_solo(self, proxy_url: str, timeout: float) -> list[Outcome]:
        """Each prompt sent alone, one after another, through the proxy; `solo` keeps the answers."""
        outcomes = []
        async with client_session(1) as session:
            for i in range(self.count):
                outcomes.append(await chat(session, proxy_url, self.body(i), timeout, index=i, prompt=i))
        self.solo = [o.text if o.kind == "ok" else None for o in outcomes]
        return outcomes
