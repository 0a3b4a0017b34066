"""The workload model: a tiny random-weight Qwen2-VL, built once and loaded the same way real weights are.

Every role (encoder, prefill, decode) calls `configure_torch()` and then `load_model()`, so every process
holds identical weights and runs identical kernels; that is what makes the EPD split bit-identical to one
monolithic forward (the other preconditions: docs/protocols.md, "What bit-identity rests on"). Both loaders
return the model with its vision tower made image-invariant (`models.vision.make_image_invariant`): without it,
CPUs whose GEMMs pick kernels by row count break that.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.utils import logging as hf_logging

from epd_lab.models.vision import make_image_invariant

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "data" / "models" / "tiny-qwen2-vl"

# Token ids. Prompt text is UTF-8 bytes (ids 0..255, see processor.build_input_ids); 256..1023 are further text
# ids the model may generate; the special ids follow, in Qwen2-VL's order.
TEXT_VOCAB_SIZE = 1024
VISION_START_ID = 1024
VISION_END_ID = 1025
IMAGE_PAD_ID = 1026
VIDEO_PAD_ID = 1027
VOCAB_SIZE = 1028

# sdpa and eager both give bit-identical split vs monolithic here; sdpa is the default and faster.
ATTN_IMPLEMENTATION = "sdpa"
# 0.02 (the default) makes a random model repeat one token, which hides errors.
INITIALIZER_RANGE = 0.1


def configure_torch(threads: int = 1) -> None:
    """Fix torch's CPU thread count; every role calls this before running the model.

    CPU kernels split their reductions by thread count, so the count changes the bits: measured here,
    float32 vision embeddings under 3 threads differ from 1 thread by up to 2.4e-6 (and so do the logits).
    Processes that must agree bit for bit (encoder and prefill, prefill and decode) must use the same count.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def tiny_config(seed: int = 0) -> Qwen2VLConfig:
    """The tiny Qwen2-VL config: hidden 256, 2 text layers, vision depth 2, patch 14, merge 2, EOS off.

    `seed` is unused by the config itself; it is accepted so that config and weights are named by one seed.
    """
    del seed  # the architecture does not depend on the seed; only the weights do
    text_config = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        # mrope splits head_dim/2 = 32 rotary frequencies into temporal/height/width sections.
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
        "initializer_range": INITIALIZER_RANGE,
        # No BOS/EOS/PAD: generation never stops early, so every run produces max_new_tokens tokens.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    vision_config = {
        "depth": 2,
        "embed_dim": 128,
        "hidden_size": 256,  # merger output = text hidden size
        "num_heads": 4,
        "mlp_ratio": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": INITIALIZER_RANGE,
    }
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=True,  # as Qwen2-VL-2B does
    )
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config


def build_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen2VLForConditionalGeneration:
    """Build the tiny model with random weights drawn from `seed` (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(tiny_config(seed))
    _disable_eos(model)
    return make_image_invariant(model.to(dtype).eval())


def load_model(path: str | os.PathLike[str] | None = None,
               dtype: torch.dtype = torch.float32) -> Qwen2VLForConditionalGeneration:
    """Load a Qwen2-VL from a local directory, offline; `None` means the tiny model in DEFAULT_MODEL_DIR.

    The tiny model is built and saved on first use, so that every process loads the same saved bytes.
    Real weights load through the same call: `load_model("/path/to/Qwen2-VL-2B-Instruct")`.
    """
    if path is None:
        ensure_tiny_model(DEFAULT_MODEL_DIR)
        path = DEFAULT_MODEL_DIR
    with _quiet_progress():
        model = Qwen2VLForConditionalGeneration.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, attn_implementation=ATTN_IMPLEMENTATION,
        )
    return make_image_invariant(model.eval())


def ensure_tiny_model(directory: str | os.PathLike[str] = DEFAULT_MODEL_DIR, seed: int = 0) -> Path:
    """Save the tiny model to `directory` unless it is already there; safe when several processes race."""
    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target, then rename: a reader sees either nothing or a complete directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        with _quiet_progress():
            build_tiny_model(seed).save_pretrained(tmp)
        # mkdtemp makes the directory private; the model is for every user of the checkout.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            tmp.rename(directory)
        except OSError:
            if not (directory / "config.json").exists():
                raise
            # Another process won the race with the same deterministic weights.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def num_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


@contextmanager
def _quiet_progress() -> Iterator[None]:
    # Per-shard progress bars from every role's process would clutter notebook output.
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _disable_eos(model: Qwen2VLForConditionalGeneration) -> None:
    # generate() reads its stopping ids from generation_config, which from_config filled from the text config.
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
