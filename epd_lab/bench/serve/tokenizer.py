"""The tokenizer `bench serve` counts prompt tokens with, and vLLM's random prompts of an exact token length.

An epd_lab model reads UTF-8 bytes: token ids 0-255 are bytes (`epd_lab.models.processor.build_input_ids`), so
`ByteTokenizer` is every epd_lab model's tokenizer, whatever its shapes. Another server's model is tokenized by its
Hugging Face tokenizer (`transformers.AutoTokenizer`, by name or local directory), as `vllm bench serve` does.

`random_prompt` is vLLM's ``RandomDataset`` prompt: a shared prefix of random tokens, then ``input_len`` tokens
cycling through the vocabulary from a random offset, decoded to text, re-encoded and cut or padded until the text
is that many tokens (`decode_to_length`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

BYTES = "bytes"  # --tokenizer's name for epd_lab's byte tokenizer
# Printable ASCII: a byte vocabulary's ids from 128 up are fragments of UTF-8 characters, which decode alone to
# U+FFFD (three bytes) and would make every prompt longer than asked.
_PRINTABLE = np.arange(32, 127)


class Tokenizer(Protocol):
    """What the bench needs of a tokenizer: its name, text ↔ ids, and the ids a random prompt may use."""

    name: str
    allowed_ids: np.ndarray

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """epd_lab's tokenizer: one token per UTF-8 byte (special ids, 256 up, never occur in a client's text)."""

    def __init__(self, name: str = BYTES) -> None:
        self.name = name
        self.allowed_ids = _PRINTABLE

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """`ids` as UTF-8 (invalid bytes replaced)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer, without special tokens on encode; random prompts avoid its added special ids
    (image placeholders among them), as vLLM's do."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name, self._tok = name, tokenizer
        special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        self.allowed_ids = np.array(sorted(set(range(tokenizer.vocab_size)) - special))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`."""
        return self._tok.decode(list(ids))


def is_epd_lab_model(model: str, owned_by: str | None = None) -> bool:
    """Whether `model` (a ``/v1/models`` id, and who owns it) is served by epd_lab, whose models read bytes (its
    servers list ``epd-lab-tiny-qwen2-vl`` unless told another id, and own it as ``epd_lab``)."""
    return owned_by == "epd_lab" or model.startswith("epd-lab")


def get_tokenizer(name: str, owned_by: str | None = None) -> Tokenizer:
    """The tokenizer called `name`: ``bytes`` or an epd_lab model's id → `ByteTokenizer`; else a Hugging Face
    tokenizer by hub name or local directory. `ValueError` in one line when it cannot be loaded."""
    if name == BYTES or is_epd_lab_model(name, owned_by):
        return ByteTokenizer(name)
    try:
        from transformers import AutoTokenizer

        return HFTokenizer(name, AutoTokenizer.from_pretrained(name))
    except Exception as exc:  # noqa: BLE001 - any loading failure is the user's tokenizer name: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"tokenizer {name!r} cannot be loaded ({first}); give --tokenizer a local tokenizer "
                         f"directory, or {BYTES} for epd_lab's byte tokenizer") from None


def decode_to_length(tokenizer: Tokenizer, ids: list[int], target: int, rng: np.random.Generator,
                     max_retry: int = 10) -> tuple[str, int]:
    """vLLM's ``gen_prompt_decode_to_target_len``: decode `ids`, re-encode, cut or pad with random allowed ids
    until the text is `target` tokens (at most `max_retry` rounds) → (text, its token count)."""
    for _ in range(max_retry + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text)
        if len(ids) == target:
            break
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + rng.choice(tokenizer.allowed_ids, size=target - len(ids)).tolist()
    return text, len(tokenizer.encode(text))


def random_prompt(tokenizer: Tokenizer, rng: np.random.Generator, input_len: int, offset: int, index: int,
                  prefix: Sequence[int] = ()) -> tuple[str, int]:
    """vLLM's random prompt of ``len(prefix) + input_len`` tokens (see the module docstring) → (text, tokens)."""
    allowed = tokenizer.allowed_ids
    inner = allowed[(offset + index + np.arange(input_len)) % len(allowed)].tolist()
    return decode_to_length(tokenizer, [*prefix, *inner], len(prefix) + input_len, rng)
