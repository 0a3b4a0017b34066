"""The vision tower gives each image the same bits whichever images share its call.

Encoders split a request's images into parts; the monolithic model encodes them all at once. On CPUs whose
matrix kernels choose their blocking by the number of rows (Intel Xeons with AVX-512: the batched tower
differed by up to 4.1e-6 in float32), that split alone changed the logits. These tests cut a list of images
of different sizes into every run of consecutive parts and require the same bytes for every image, and the
same prefill logits, whatever the cut; they use only the public encode/prefill API, so they also run against
an older tower to show it fails on such a CPU.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from PIL import Image

from epd_lab.models import (
    PrefillRunner,
    VisionEncoder,
    build_input_ids,
    load_model,
    monolithic_prefill,
    num_image_tokens,
    preprocess,
)
from epd_lab.noise import noise_images

# (w, h): 64, 48, 162 and 8 tokens. On an Intel Xeon (AVX-512, torch 2.13 CPU) the batched tower gave these
# other bits than each image alone in float32 and bfloat16; the sizes of another set (224², 336×224, 168×280,
# 448²) differed in bfloat16 only: the row counts decide which kernels run.
SIZES = ((224, 224), (100, 333), (500, 260), (56, 112))
DTYPES = (torch.float32, torch.bfloat16)


def _images() -> list[Image.Image]:
    return noise_images(SIZES, 9)


def _groupings(n: int) -> list[list[tuple[int, int]]]:
    """Every way to cut range(n) into consecutive non-empty parts, as (start, stop) pairs: 2**(n-1) ways."""
    out = []
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0, *[i + 1 for i, cut in enumerate(cuts) if cut], n]
        out.append(list(itertools.pairwise(bounds)))
    return out


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def model(request, one_thread):
    return load_model(dtype=request.param)


def test_groupings_cover_every_cut():
    assert _groupings(1) == [[(0, 1)]]
    assert sorted(_groupings(3)) == sorted([[(0, 3)], [(0, 1), (1, 3)], [(0, 2), (2, 3)],
                                            [(0, 1), (1, 2), (2, 3)]])
    assert len(_groupings(len(SIZES))) == 8


def test_every_grouping_encodes_each_image_to_the_same_bytes(model):
    vision = VisionEncoder(model)
    images = _images()
    alone = [vision.encode_images([img])[0] for img in images]
    assert [a.shape[0] for a in alone] == [num_image_tokens(img.size) for img in images]
    for grouping in _groupings(len(images)):
        for start, stop in grouping:
            got = vision.encode_images(images[start:stop])[0].split([a.shape[0] for a in alone[start:stop]])
            for idx, (piece, ref) in enumerate(zip(got, alone[start:stop]), start):
                diff = (piece.float() - ref.float()).abs().max()
                assert torch.equal(piece, ref), (f"image {idx} encoded in part {(start, stop)} differs from "
                                                 f"encoding it alone (max |diff| {diff:.3g})")


def test_split_prefill_equals_the_monolithic_model_for_every_grouping(model):
    vision, runner = VisionEncoder(model), PrefillRunner(model)
    images = _images()
    pixel_values, grid = preprocess(images)
    input_ids = build_input_ids("which is the largest?", grid.tolist())
    reference = monolithic_prefill(model, input_ids, pixel_values, grid)
    for grouping in _groupings(len(images)):
        embeds = torch.cat([vision.encode_images(images[start:stop])[0] for start, stop in grouping])
        logits = runner.prefill(input_ids, embeds, grid).logits
        diff = (logits.float() - reference.float()).abs().max()
        assert torch.equal(logits, reference), f"parts {grouping}: max |diff| {diff:.3g} against monolithic"


def test_the_tower_runs_image_by_image_with_the_same_parameters():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    from epd_lab.models import build_tiny_model
    from epd_lab.models.vision import PerImageVisionTower, make_image_invariant

    model = build_tiny_model()
    tower = model.model.visual
    assert type(tower) is PerImageVisionTower
    assert make_image_invariant(model) is model and type(model.model.visual) is PerImageVisionTower
    # a plain tower with the same weights computes the same function; its state dict has the same names
    plain = build_tiny_model()
    plain.model.visual.__class__ = Qwen2VisionTransformerPretrainedModel
    assert plain.model.visual.state_dict().keys() == tower.state_dict().keys()
    pixel_values, grid = preprocess(_images()[:2])
    with torch.no_grad():
        ours = tower(pixel_values, grid_thw=grid).pooler_output
        theirs = plain.model.visual(pixel_values, grid_thw=grid).pooler_output
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs)  # equal up to rounding: same mathematics, other batching
    with pytest.raises(ValueError, match="grid_thw names"):
        tower(pixel_values[:-4], grid_thw=grid)
    with pytest.raises(NotImplementedError, match="hidden states"):
        tower(pixel_values, grid_thw=grid, output_hidden_states=True)
    model.model.visual = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="vision tower"):
        make_image_invariant(model)
