"""``--model``/``--device``/``--dtype`` (`epd_lab.models.catalog`) and the runners on the model's device.

On every machine: the names resolve, refuse with messages that say what to do, `open_model` gives the bytes
`load_model` gives, the published shapes are built on the meta device (no memory), and a small registered
shape runs split == monolithic bit for bit on the CPU. Marked `cuda` (skipped here with the reason; run with
``pytest -m cuda`` on a GPU machine): the same on CUDA in bfloat16 for the tiny model and qwen2-vl-2b, and
`step_batch` against single steps.
"""
from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from epd_lab.models import (
    DTYPE_NAMES,
    MODEL_SHAPES,
    DecodeRunner,
    PrefillRunner,
    VisionEncoder,
    build_input_ids,
    build_tiny_model,
    load_model,
    model_device,
    monolithic_generate,
    monolithic_prefill,
    num_parameters,
    open_model,
    preprocess,
    resolve_device,
    resolve_dtype,
)
from epd_lab.models.shapes import SHAPES, Shape, count_parameters
from epd_lab.models.vision import PerImageVisionTower
from epd_lab.noise import noise_images

pytestmark = pytest.mark.usefixtures("one_thread")  # every role runs under configure_torch(1)

HAS_CUDA = torch.cuda.is_available()
N_TOKENS = 8
SMALL = Shape(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=2048, tie_word_embeddings=False, vision_depth=1,
              vision_embed_dim=32, vision_num_heads=2, mrope_section=(2, 3, 3))
# (text, image sizes): text only, and two images of odd sizes (the grids differ, the rope delta is negative)
PROMPTS = {"text": ("tell me a story", []), "2-images": ("compare these", [(224, 224), (100, 333)])}


def gpu(test):
    """Mark a test `cuda` and skip it, with the reason, where torch sees no CUDA device."""
    reason = "needs a CUDA GPU: torch.cuda.is_available() is False"
    return pytest.mark.cuda(pytest.mark.skipif(not HAS_CUDA, reason=reason)(test))


def _inputs(text: str, sizes: list[tuple[int, int]], seed: int = 0):
    """(input_ids, pixel_values, image_grid_thw) on the CPU, as the processor and the wire deliver them."""
    images = noise_images(sizes, seed)
    if not images:
        return build_input_ids(text, []), None, None
    pixel_values, grid = preprocess(images)
    return build_input_ids(text, grid.tolist()), pixel_values, grid


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _split_vs_monolithic(model, text: str, sizes: list[tuple[int, int]]) -> None:
    """The EPD split on one model, inputs on the CPU: encode → prefill from the embeddings → greedy decode on a
    copy of the cache (as decode receives it). Prefill logits equal `monolithic_prefill`'s bits, the tokens
    equal `monolithic_generate`'s; everything the runners return stays on the model's device."""
    device = model_device(model)
    input_ids, pixel_values, grid = _inputs(text, sizes)
    embeds = None
    if pixel_values is not None:
        embeds = VisionEncoder(model).encode(pixel_values, grid)
        assert embeds.device == device and embeds.dtype == model.dtype
    result = PrefillRunner(model).prefill(input_ids, embeds, grid)
    assert result.logits.device == device
    assert all(k.device == v.device == device for k, v in result.kv_tensors())
    want = monolithic_prefill(model, input_ids, pixel_values, grid)
    assert torch.equal(result.logits, want), f"split prefill != monolithic, max abs {_max_abs(result.logits, want)}"
    copied = DynamicCache([(k.clone(), v.clone()) for k, v in result.kv_tensors()], config=model.config)
    tokens = DecodeRunner(model).greedy(result.logits, copied, result.next_position, N_TOKENS)
    assert tokens == monolithic_generate(model, input_ids, pixel_values, grid, N_TOKENS)


# ---- names: dtype and device -------------------------------------------------------------------------

def test_resolve_dtype():
    assert DTYPE_NAMES == ("auto", "float32", "bfloat16")
    assert resolve_dtype("auto", "cpu") == resolve_dtype("auto", torch.device("cpu")) == "float32"
    for cuda in ("cuda", "cuda:1", torch.device("cuda", 0)):  # names only: no CUDA needed
        assert resolve_dtype("auto", cuda) == "bfloat16"
    for name in ("float32", "bfloat16"):
        assert resolve_dtype(name, "cpu") == resolve_dtype(name, "cuda") == name
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, got 'float16'"):
        resolve_dtype("float16", "cuda")


def test_resolve_device_cpu():
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:0:1", "cuda:x", "cpu:0", " cpu", ""])
def test_resolve_device_refuses_malformed_names(name):
    with pytest.raises(ValueError, match=r"expected cpu, cuda or cuda:N"):
        resolve_device(name)


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is visible: covered by the cuda tests")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_resolve_device_without_cuda_says_what_to_do(name):
    message = (f"--device {name}: no CUDA device is visible to this process (torch.cuda.is_available() is False); "
               "use --device cpu")
    with pytest.raises(ValueError) as info:
        resolve_device(name)
    assert str(info.value) == message
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        open_model(device=name)  # open_model checks its device the same way


CUDA_INIT_CHILD = textwrap.dedent("""
    import torch
    from epd_lab.models import resolve_device

    print(resolve_device("cpu"), torch.cuda.is_initialized())
    if torch.cuda.is_available():
        print(resolve_device("cuda"), torch.cuda.is_initialized())
""")


def test_resolving_a_device_does_not_initialise_cuda():
    """A parent that resolves ``--device`` and then forks its roles must not have initialised CUDA."""
    out = subprocess.run([sys.executable, "-c", CUDA_INIT_CHILD], check=True, capture_output=True, text=True,
                         timeout=60).stdout.split("\n")
    assert out[0] == "cpu False"
    if HAS_CUDA:
        assert out[1] == "cuda:0 False"


# ---- open_model on the CPU ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_open_model_tiny_is_load_model(dtype):
    reference = load_model(dtype=dtype)
    for model in (open_model(dtype=dtype), open_model("tiny", dtype=dtype, device=torch.device("cpu"))):
        assert _same_weights(model, reference)
        assert model_device(model) == torch.device("cpu") and model.dtype == dtype and not model.training
        assert isinstance(model.model.visual, PerImageVisionTower)
        assert model.config._attn_implementation == "sdpa"


def test_open_model_from_a_directory_is_load_model(tmp_path: Path):
    build_tiny_model(seed=3).save_pretrained(tmp_path)
    assert _same_weights(open_model(str(tmp_path)), load_model(tmp_path))
    assert _same_weights(open_model(tmp_path, dtype=torch.bfloat16), load_model(tmp_path, dtype=torch.bfloat16))


def test_open_model_refuses_what_it_cannot_open(tmp_path: Path):
    assert MODEL_SHAPES == ("tiny", "qwen2-vl-2b", "qwen2-vl-7b")
    with pytest.raises(ValueError, match=r"--model 'qwen2-vl-3b': not a model shape \(tiny, qwen2-vl-2b, "
                                         r"qwen2-vl-7b\) and not a local directory"):
        open_model("qwen2-vl-3b")
    with pytest.raises(ValueError, match="the directory has no config.json"):
        open_model(str(tmp_path))
    with pytest.raises(ValueError, match="seed=1 only applies to a model shape"):
        open_model("tiny", seed=1)
    with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
        open_model(device="gpu")


@pytest.mark.parametrize("name", ["qwen2-vl-2b", "qwen2-vl-7b"])
def test_open_model_builds_a_published_shape_on_meta(name):
    """Built on the meta device (no memory): the model a GPU role gets, minus the numbers."""
    model = open_model(name, dtype=torch.bfloat16, device="meta")
    assert num_parameters(model) == count_parameters(name)
    assert model_device(model) == torch.device("meta")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert isinstance(model.model.visual, PerImageVisionTower)
    assert model.config._attn_implementation == "sdpa"
    assert model.config.text_config._attn_implementation == model.config.vision_config._attn_implementation == "sdpa"
    assert model.generation_config.eos_token_id is None and not model.training
    assert model.config.text_config.hidden_size == SHAPES[name].hidden_size


@pytest.fixture
def small_shape(monkeypatch):
    """A registered shape small enough for the CPU (open_model looks shapes up at call time)."""
    monkeypatch.setitem(SHAPES, "test-small", SMALL)
    return "test-small"


def test_a_shape_is_seeded(small_shape):
    a, b = open_model(small_shape, seed=5), open_model(small_shape, seed=5)
    assert _same_weights(a, b)
    assert not _same_weights(a, open_model(small_shape, seed=6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_shape_model_split_equals_monolithic_on_cpu(small_shape, dtype, prompt):
    """The runners take a shape model as they take the tiny one: split == monolithic, bit for bit."""
    _split_vs_monolithic(open_model(small_shape, dtype=dtype, seed=1), *prompt)


# ---- on a GPU (marked cuda) --------------------------------------------------------------------------

@gpu
def test_resolve_device_on_cuda():
    count = torch.cuda.device_count()
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    assert resolve_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
    with pytest.raises(ValueError, match=rf"--device cuda:{count}: this process sees {count} CUDA device\(s\)"):
        resolve_device(f"cuda:{count}")
    assert resolve_dtype("auto", resolve_device("cuda")) == "bfloat16"


@gpu
def test_open_model_tiny_on_cuda_is_load_model():
    model = open_model(dtype=torch.bfloat16, device="cuda")
    assert model_device(model) == resolve_device("cuda")
    assert {p.device for p in model.parameters()} == {model_device(model)}
    assert _same_weights(model, load_model(dtype=torch.bfloat16))


@pytest.fixture(scope="module", params=["tiny", "qwen2-vl-2b"])
def gpu_model(request):
    """The role's model as a GPU role opens it: bfloat16 (``--dtype auto`` on CUDA), on the current device."""
    model = open_model(request.param, dtype=torch.bfloat16, device="cuda")
    yield model
    del model
    torch.cuda.empty_cache()


@gpu
@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_split_equals_monolithic_on_cuda(gpu_model, prompt):
    """Encode, prefill from the embeddings, decode 8 greedy tokens on a copied cache, on the GPU in bfloat16:
    the prefill logits are `monolithic_prefill`'s bits and the tokens `monolithic_generate`'s. Both paths run
    the same kernels on the same shapes (the ViT image by image, the LLM on the same embeddings and positions),
    so nothing but a changed kernel choice could change a bit."""
    assert model_device(gpu_model).type == "cuda" and gpu_model.dtype == torch.bfloat16
    _split_vs_monolithic(gpu_model, *prompt)


@gpu
def test_pinned_inputs_give_the_same_embeddings_and_prefill(gpu_model):
    """Inputs from pinned host memory take the non-blocking copy; the results are those of pageable inputs."""
    input_ids, pixel_values, grid = _inputs(*PROMPTS["2-images"])
    encoder, prefill = VisionEncoder(gpu_model), PrefillRunner(gpu_model)
    embeds = encoder.encode(pixel_values, grid)
    assert torch.equal(encoder.encode(pixel_values.pin_memory(), grid.pin_memory()), embeds)
    host = embeds.cpu().pin_memory()  # as received into a pinned buffer from an encoder
    got = prefill.prefill(input_ids.pin_memory(), host, grid.pin_memory())
    want = prefill.prefill(input_ids, embeds, grid)
    assert torch.equal(got.logits, want.logits)
    assert (got.rope_delta, got.prompt_len) == (want.rope_delta, want.prompt_len)


# B=3 batched vs single steps on CUDA in bfloat16. On the CPU they are bit-equal (tests/test_batching.py): each
# row of a [3, k] @ [k, n] product gets a [1, k] product's bits there. cuBLAS chooses its GEMM kernel (tile shape,
# split-K) by the problem's M, so a batch of 3 may sum each row's products in another order than a batch of 1,
# and bfloat16 rounds the difference to whole ulps; bit equality cannot be promised, so this measures it and
# bounds it. Measured on the H200 (torch 2.11, cu130): qwen2-vl-2b bit-equal, tiny (hidden 256) 4.1e-5 of the
# largest logit. The bound is 25x that, still far below a real fault (a wrong cache row, position or rope delta
# moves the logits by the order of the logits).
STEP_BATCH_REL_BOUND = 1e-3


@gpu
def test_step_batch_against_single_steps_on_cuda(gpu_model):
    """Three requests of different lengths (text, longer text, two images), 8 steps, the same tokens fed both
    ways: batched logits equal the single steps' within `STEP_BATCH_REL_BOUND` of their largest magnitude (a
    warning says how far they were when not bit-equal), and the caches grow alike."""
    runner, prefill = DecodeRunner(gpu_model), PrefillRunner(gpu_model)
    prompts = [("hi", []), ("a longer text prompt " * 5, []), PROMPTS["2-images"]]
    prefills = []
    for text, sizes in prompts:
        input_ids, pixel_values, grid = _inputs(text, sizes)
        embeds = None if pixel_values is None else VisionEncoder(gpu_model).encode(pixel_values, grid)
        prefills.append(prefill.prefill(input_ids, embeds, grid))
    single = [copy.deepcopy(p.past_key_values) for p in prefills]
    batched = [copy.deepcopy(p.past_key_values) for p in prefills]
    tokens = [int(p.logits.argmax(-1)) for p in prefills]
    worst, bits_equal = 0.0, True
    for i in range(N_TOKENS):
        positions = [p.next_position + i for p in prefills]
        got = runner.step_batch(tokens, batched, positions)
        want = torch.cat([runner.step(t, c, pos) for t, c, pos in zip(tokens, single, positions)])
        assert got.shape == want.shape == (3, gpu_model.config.text_config.vocab_size)
        assert got.device == want.device == model_device(gpu_model)
        diff, scale = _max_abs(got, want), float(want.abs().max())
        bits_equal &= torch.equal(got, want)
        worst = max(worst, diff / scale)
        assert diff <= STEP_BATCH_REL_BOUND * scale, f"step {i}: max abs {diff} over max |logit| {scale}"
        tokens = [int(t) for t in want.argmax(-1)]  # the single steps' tokens, fed to both
    for s, b in zip(single, batched):
        assert s.get_seq_length() == b.get_seq_length()
    if not bits_equal:
        hidden = gpu_model.config.text_config.hidden_size
        warnings.warn(f"step_batch B=3 on {model_device(gpu_model)} in bfloat16 (hidden {hidden}): not bit-equal to "
                      f"single steps; max abs diff {worst:.3g} x max |logit|", stacklevel=1)
