"""Prompt and "tokenizer" glue for the OpenAI-compatible proxy, offline: no tokenizer is downloaded.

Token ids 0-255 are UTF-8 bytes (`epd_lab.models.processor.build_input_ids` maps byte b → id b); every other
id is a special token (vision markers, or anything a real model's vocabulary adds) and is rendered
``<|id|>``.

Chat template (ChatML's layout, as Qwen uses it, written here as plain UTF-8 text: the byte vocabulary has
no special tokens for it)::

    <|im_start|>{role}\\n{text}<|im_end|>\\n      one per message
    <|im_start|>assistant\\n                      the generation prompt

A message's text parts are joined with ``\\n``. Its ``image_url`` parts become media items, in message order;
they do not appear in the text, because the prompt layout of `build_input_ids` puts every image first.
Media items pass through as given: ``data:`` URIs, file paths and http(s) URLs (the encoders load them).
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Any

ROLES = ("system", "developer", "user", "assistant")
IMAGE_ROLES = ("user",)  # as in OpenAI's API: images only in user messages


class PromptError(ValueError):
    """Messages or a prompt that this proxy cannot render (the proxy answers 400 with the message)."""


class Detokenizer:
    """Incremental detokenizer: each `feed` returns the text that is complete so far.

    A UTF-8 character split over several byte tokens comes out whole, once its last byte arrives, so streamed
    deltas never hold half a character; bytes that cannot be UTF-8 become U+FFFD, as in `detokenize`.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        """The text that `token` completes (empty while a multi-byte character is still partial)."""
        if 0 <= token < 256:
            return self._utf8.decode(bytes((token,)))
        # a special token ends any partial character first, as decoding the whole sequence would
        return self._utf8.decode(b"", final=True) + f"<|{token}|>"

    def flush(self) -> str:
        """The end of the sequence: a trailing partial character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


def prompt_tokens(text: str) -> int:
    """The number of tokens `text` is (its UTF-8 bytes), without encoding it when it is ASCII: a 50 MB prompt is
    measured in O(1) (CPython knows a str is ASCII), where building its ids would hold a process for seconds."""
    return len(text) if text.isascii() else len(text.encode("utf-8", errors="surrogatepass"))


def detokenize(ids: Iterable[int]) -> str:
    """Text of token ids: bytes < 256 as UTF-8 (errors replaced), other ids as ``<|id|>``."""
    detok = Detokenizer()
    return "".join(detok.feed(i) for i in ids) + detok.flush()


def _part_text(part: Any, where: str, role: str, images: list[str]) -> str | None:
    """The text of one content part, or None for an image part (its URL is appended to `images`)."""
    if not isinstance(part, dict):
        raise PromptError(f"{where} must be an object with a 'type'")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise PromptError(f"{where}.text must be a string")
        return text
    if kind == "image_url":
        if role not in IMAGE_ROLES:
            raise PromptError(f"{where}: image_url parts are only allowed in user messages, not {role!r}")
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else None
        if not isinstance(url, str) or not url:
            raise PromptError(f"{where}.image_url.url must be a non-empty string")
        images.append(url)
        return None
    raise PromptError(f"{where}.type {kind!r} is not supported (only 'text' and 'image_url')")


def messages_to_prompt(messages: Any) -> tuple[str, list[str]]:
    """Render OpenAI chat `messages` with the module's template → (prompt text, media items in order).

    Raises `PromptError` for anything else: no messages, an unknown role, missing content, tool calls, an
    unknown part type, an image outside a user message.
    """
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list")
    out: list[str] = []
    images: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise PromptError(f"{where} must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise PromptError(f"{where}.role {role!r} is not supported (one of {', '.join(ROLES)})")
        if message.get("tool_calls"):
            raise PromptError(f"{where}: tool calls are not supported")
        content = message.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            texts = [_part_text(part, f"{where}.content[{j}]", role, images) for j, part in enumerate(content)]
            text = "\n".join(t for t in texts if t is not None)
        else:
            raise PromptError(f"{where}.content must be a string or a list of parts")
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out), images


def completion_prompt(prompt: Any) -> str:
    """The text of a /v1/completions `prompt`: a string, or a list holding exactly one string."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise PromptError("prompt must be a string (or a list of one string; token-id prompts are not supported)")
    return prompt
