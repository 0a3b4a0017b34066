"""The workload model: config facts, image sizes, prompt layout, and split == monolithic bit for bit."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import DynamicCache

from epd_lab.models import (
    IMAGE_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    DecodeRunner,
    PrefillRunner,
    VisionEncoder,
    build_input_ids,
    build_tiny_model,
    configure_torch,
    ensure_tiny_model,
    image_grid,
    load_model,
    monolithic_generate,
    monolithic_prefill,
    num_image_tokens,
    num_parameters,
    preprocess,
    resized_size,
)
from epd_lab.models.processor import image_processor
from epd_lab.models.runners import prompt_positions
from epd_lab.noise import noise_images

pytestmark = pytest.mark.usefixtures("one_thread")  # every role runs under configure_torch(1)

IMAGE_SETS = {
    "one": [(224, 224)],
    "two-odd": [(100, 333), (500, 260)],
    "four-mixed": [(224, 224), (56, 56), (300, 200), (640, 480)],
}
PROMPT = "Describe the pictures."


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def model(request):
    return load_model(dtype=request.param)


def make_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    return noise_images(sizes, seed)


def prompt_for(images: list[Image.Image]) -> torch.Tensor:
    return build_input_ids(PROMPT, [image_grid(im.size) for im in images])


def test_config_facts():
    model = build_tiny_model()
    config = model.config
    assert config.text_config.hidden_size == 256
    assert config.text_config.num_hidden_layers == 2
    assert config.vision_config.depth == 2
    assert config.vision_config.patch_size == 14
    assert config.vision_config.spatial_merge_size == 2
    assert config.text_config.initializer_range == config.vision_config.initializer_range == 0.1
    assert model.generation_config.eos_token_id is None
    assert num_parameters(model) == pytest.approx(3.2e6, rel=0.02)
    # 0.1, not the default 0.02, actually reached the weights.
    assert model.model.language_model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.1, rel=0.05)


def test_build_is_deterministic():
    a, b = build_tiny_model(seed=0), build_tiny_model(seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    c = build_tiny_model(seed=1)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_224_square_is_64_tokens():
    assert image_grid((224, 224)) == (1, 16, 16)
    assert num_image_tokens((224, 224)) == 64


@pytest.mark.parametrize(("size", "resized"), [
    ((100, 333), (112, 336)),
    ((500, 260), (504, 252)),
    ((20, 20), (56, 56)),  # lifted to min_pixels
    ((4000, 3000), (1148, 840)),  # shrunk under max_pixels
])
def test_odd_sizes_round_to_multiples_of_28(size, resized):
    assert resized_size(size) == resized
    width, height = resized
    assert image_grid(size) == (1, height // 14, width // 14)
    assert num_image_tokens(size) == (height // 28) * (width // 28)


def test_size_arithmetic_matches_the_processor():
    images = make_images([(100, 333), (500, 260), (20, 20), (224, 224)])
    pixel_values, grid_thw = preprocess(images)
    assert [tuple(g) for g in grid_thw.tolist()] == [image_grid(im.size) for im in images]
    assert pixel_values.dtype == torch.float32
    assert pixel_values.shape == (int(grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14)


PROCESSOR_SIZES = [(448, 448), (224, 224), (100, 333), (500, 260), (20, 20), (1000, 37), (3000, 2000)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_preprocess_equals_hf_image_processor_bit_for_bit(device):
    """Resized or not (448² is already a multiple of 28: no resize), RGB or grey, on the host or the GPU: the
    torch pixels equal HF's PIL + numpy processor's."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False")
    images = make_images(PROCESSOR_SIZES, seed=3)
    images.append(images[0].convert("L"))
    expected = image_processor()(images=[im.convert("RGB") for im in images], return_tensors="pt")
    pixel_values, grid_thw = preprocess(images, device=device)
    assert pixel_values.device.type == device and grid_thw.device.type == "cpu"
    assert torch.equal(grid_thw, expected["image_grid_thw"])
    assert torch.equal(pixel_values.cpu(), expected["pixel_values"].to(torch.float32))


@pytest.mark.parametrize("grids", [[], [(1, 32, 32)], [(1, 16, 16), (1, 24, 8), (1, 4, 60)], [(1, 2, 2)]],
                         ids=["text", "one", "three-odd", "smallest"])
def test_prompt_positions_equal_hf_get_rope_index(model, grids):
    def check(ids: torch.Tensor, grids: list) -> None:
        thw = torch.tensor(grids) if grids else None
        mask = ids.reshape(1, -1) == model.config.image_token_id
        want, deltas = model.model.get_rope_index(ids.reshape(1, -1), mm_token_type_ids=mask.int(), image_grid_thw=thw)
        got, delta = prompt_positions(model, ids, int(mask.sum()), thw)
        assert torch.equal(got, want) and delta == int(deltas[0, 0])

    check(build_input_ids(PROMPT * 3, grids), grids)
    if grids:  # images between text runs, not only first
        pads = [[IMAGE_PAD_ID] * (t * h * w // 4) for t, h, w in grids]
        check(torch.tensor([[65, 66, *sum(([VISION_START_ID, *p, VISION_END_ID, 67] for p in pads), [])]]), grids)
        with pytest.raises(ValueError, match="do not match the grids"):
            prompt_positions(model, build_input_ids("x", grids), sum(map(len, pads)),
                             torch.tensor([[1, 2, 4]] * len(grids)))
    with pytest.raises(ValueError, match="image_pad tokens but 9999 image embeddings"):
        prompt_positions(model, build_input_ids("x", grids), 9999, None)


def test_build_input_ids_layout():
    ids = build_input_ids("hi", [(1, 4, 4), (1, 2, 4)])[0].tolist()
    assert ids == [VISION_START_ID, *[IMAGE_PAD_ID] * 4, VISION_END_ID,
                   VISION_START_ID, *[IMAGE_PAD_ID] * 2, VISION_END_ID, ord("h"), ord("i")]
    assert build_input_ids("é", [])[0].tolist() == list("é".encode())


@pytest.mark.parametrize("sizes", IMAGE_SETS.values(), ids=IMAGE_SETS.keys())
def test_split_prefill_equals_monolithic(model, sizes):
    images = make_images(sizes)
    input_ids = prompt_for(images)
    embeddings, grid_thw = VisionEncoder(model).encode_images(images)
    assert embeddings.shape == (sum(num_image_tokens(s) for s in sizes), VisionEncoder(model).hidden_size)

    result = PrefillRunner(model).prefill(input_ids, embeddings, grid_thw)
    pixel_values, _ = preprocess(images)
    assert torch.equal(result.logits, monolithic_prefill(model, input_ids, pixel_values, grid_thw))

    seq = input_ids.shape[1]
    assert result.prompt_len == seq
    assert result.rope_delta < 0  # an image's h×w tokens span only max(h, w) positions
    for key, value in result.kv_tensors():
        assert key.shape == value.shape == (1, 2, seq, 64)


def test_text_only_prefill_equals_monolithic(model):
    input_ids = build_input_ids(PROMPT, [])
    result = PrefillRunner(model).prefill(input_ids, None, None)
    assert result.rope_delta == 0
    assert torch.equal(result.logits, monolithic_prefill(model, input_ids, None, None))


def test_prefill_rejects_wrong_embedding_count(model):
    images = make_images([(224, 224)])
    embeddings, grid_thw = VisionEncoder(model).encode_images(images)
    with pytest.raises(ValueError, match="64 image_pad tokens but 63"):
        PrefillRunner(model).prefill(prompt_for(images), embeddings[:63], grid_thw)


def test_first_generated_token_is_prefill_argmax():
    model = load_model()
    images = make_images(IMAGE_SETS["two-odd"])
    input_ids = prompt_for(images)
    pixel_values, grid_thw = preprocess(images)
    tokens = monolithic_generate(model, input_ids, pixel_values, grid_thw, max_new_tokens=4)
    assert len(tokens) == 4  # EOS is off: generation runs to max_new_tokens
    assert len(set(tokens)) > 1  # initializer_range 0.1: a random model does not repeat one token
    embeddings = VisionEncoder(model).encode(pixel_values, grid_thw)
    result = PrefillRunner(model).prefill(input_ids, embeddings, grid_thw)
    assert tokens[0] == int(result.logits.argmax())


ENCODER_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch
    from PIL import Image

    from epd_lab.models import VisionEncoder, configure_torch, load_model

    configure_torch(1)
    folder = Path(sys.argv[1])
    images = [Image.open(p) for p in sorted(folder.glob("*.png"))]
    for name in ("float32", "bfloat16"):
        embeddings, _ = VisionEncoder(load_model(dtype=getattr(torch, name))).encode_images(images)
        (folder / f"{name}.bin").write_bytes(embeddings.contiguous().view(torch.uint8).numpy().tobytes())
""")


def test_encoder_in_another_process_is_bit_identical(tmp_path: Path):
    images = make_images(IMAGE_SETS["four-mixed"], seed=1)
    for i, image in enumerate(images):
        image.save(tmp_path / f"{i}.png")
    ensure_tiny_model()  # build once here so that the child only loads
    subprocess.run([sys.executable, "-c", ENCODER_CHILD, str(tmp_path)], check=True, timeout=60)

    input_ids = prompt_for(images)
    pixel_values, grid_thw = preprocess(images)
    for name in ("float32", "bfloat16"):
        model = load_model(dtype=getattr(torch, name))
        raw = bytearray((tmp_path / f"{name}.bin").read_bytes())
        received = torch.frombuffer(raw, dtype=torch.uint8).view(model.dtype).reshape(-1, 256)
        assert torch.equal(received, VisionEncoder(model).encode(pixel_values, grid_thw))
        result = PrefillRunner(model).prefill(input_ids, received, grid_thw)
        assert torch.equal(result.logits, monolithic_prefill(model, input_ids, pixel_values, grid_thw))


def test_load_model_from_saved_directory(tmp_path: Path):
    built = build_tiny_model(seed=3)
    built.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    images = make_images([(224, 224)])
    input_ids = prompt_for(images)
    pixel_values, grid_thw = preprocess(images)
    assert torch.equal(monolithic_prefill(loaded, input_ids, pixel_values, grid_thw),
                       monolithic_prefill(built, input_ids, pixel_values, grid_thw))


def test_ensure_tiny_model_keeps_an_existing_directory(tmp_path: Path):
    target = ensure_tiny_model(tmp_path / "tiny")
    before = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(target) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temp directory left behind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("sizes", [[], [(224, 224), (100, 333)]], ids=["text", "2-images"])
def test_decode_from_a_copied_kv_cache_matches_generate(dtype, sizes):
    """Prefill, copy the KV tensors into a fresh cache (as the KV transfer does), decode greedily at
    `next_position + i`: the 16 tokens equal `model.generate`'s."""
    configure_torch()
    model = load_model(dtype=dtype)
    images = noise_images(sizes, 9)
    if images:
        pixel_values, grid = preprocess(images)
        embeds = VisionEncoder(model).encode(pixel_values, grid)
        input_ids = build_input_ids("tell me", grid.tolist())
    else:
        pixel_values = grid = embeds = None
        input_ids = build_input_ids("tell me", [])
    result = PrefillRunner(model).prefill(input_ids, embeds, grid)
    copied = DynamicCache([(k.clone(), v.clone()) for k, v in result.kv_tensors()], config=model.config)
    tokens = DecodeRunner(model).greedy(result.logits, copied, result.next_position, 16)
    assert tokens == monolithic_generate(model, input_ids, pixel_values, grid, 16)
