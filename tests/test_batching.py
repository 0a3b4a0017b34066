"""Batched decode steps: `DecodeRunner.step_batch` against single-request steps and `model.generate`, and the
decode server's scheduler batching its active requests (in process, no HTTP).

Measured here (CPU with AVX-512 BF16, one thread): bfloat16 batched logits equal single-request logits bit for
bit; float32 ones differ in the last bits (CPU GEMM sums a batch of rows in another order than one row), max
abs ~1.4e-5 over 32 steps, so float32 asserts `allclose` within `F32_ATOL` and equal tokens.
"""
from __future__ import annotations

import copy
import queue
import time

import pytest
import torch
from PIL import Image

from epd_lab.ep.messages import DTYPES
from epd_lab.models import (
    DecodeRunner,
    PrefillResult,
    PrefillRunner,
    VisionEncoder,
    build_input_ids,
    load_model,
    monolithic_generate,
    preprocess,
)
from epd_lab.kv import blocks_needed
from epd_lab.models.sampling import sample
from epd_lab.noise import noise_images
from epd_lab.servers.decode import DecodeServer, DecodeSettings
from epd_lab.servers.scheduler import DONE
from epd_lab.servers.messages import DecodeRequest, KVTransferParams
from helpers import wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

N_TOKENS = 32
F32_ATOL = 1e-4  # float32 batched vs single logits (|logits| < 10); measured max 1.4e-5
# Prompt lengths 2, 105, 74 (one image), 129 (two images): the caches in one batch all differ in length.
CASES = [("hi", []), ("a longer text prompt " * 5, []), ("describe", [(224, 224)]),
         ("compare these", [(224, 224), (100, 333)])]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    return load_model(dtype=DTYPES[request.param])


def _inputs(prompt: str, sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, list[Image.Image]]:
    images = noise_images(sizes, len(prompt))
    grids = preprocess(images)[1].tolist() if images else []
    return build_input_ids(prompt, grids), images


def _prefill(model, prompt: str, sizes: list[tuple[int, int]]) -> PrefillResult:
    input_ids, images = _inputs(prompt, sizes)
    embeds, grid = VisionEncoder(model).encode_images(images) if images else (None, None)
    return PrefillRunner(model).prefill(input_ids, embeds, grid)


def _reference(model, prompt: str, sizes: list[tuple[int, int]], n: int) -> list[int]:
    input_ids, images = _inputs(prompt, sizes)
    pixel_values, grid = preprocess(images) if images else (None, None)
    return monolithic_generate(model, input_ids, pixel_values, grid, n)


def _assert_same_bits_or_close(model, got: torch.Tensor, want: torch.Tensor) -> None:
    if model.dtype == torch.bfloat16:
        assert torch.equal(got, want), f"bfloat16 batched != single, max abs {(got - want).abs().max()}"
    else:
        assert torch.allclose(got, want, rtol=0, atol=F32_ATOL), (got - want).abs().max()


@pytest.fixture(scope="module")
def prefills(model) -> list[PrefillResult]:
    return [_prefill(model, prompt, sizes) for prompt, sizes in CASES]


def test_batched_greedy_equals_generate(model, prefills):
    """4 requests, text and images, every step one `step_batch`: 32 tokens each equal `model.generate`'s."""
    runner = DecodeRunner(model)
    caches = [copy.deepcopy(p.past_key_values) for p in prefills]
    tokens = [[int(p.logits.argmax(-1))] for p in prefills]
    for i in range(N_TOKENS - 1):
        logits = runner.step_batch([t[-1] for t in tokens], caches, [p.next_position + i for p in prefills])
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax(-1)))
    assert tokens == [_reference(model, prompt, sizes, N_TOKENS) for prompt, sizes in CASES]


def test_batched_logits_and_caches_against_single_steps(model, prefills):
    """Same tokens fed both ways, with the batch's requests at different steps (request k joins at step k)."""
    runner = DecodeRunner(model)
    single = [copy.deepcopy(p.past_key_values) for p in prefills]
    batched = [copy.deepcopy(p.past_key_values) for p in prefills]
    steps = [0] * len(prefills)
    for turn in range(12):
        rows = [k for k in range(len(prefills)) if k <= turn]
        tokens = [(7 * turn + k) % 1024 for k in rows]
        positions = [prefills[k].next_position + steps[k] for k in rows]
        got = runner.step_batch(tokens, [batched[k] for k in rows], positions)
        want = torch.cat([runner.step(t, single[k], pos) for t, k, pos in zip(tokens, rows, positions)])
        assert got.shape == (len(rows), model.config.text_config.vocab_size)
        _assert_same_bits_or_close(model, got, want)
        for k in rows:
            steps[k] += 1
    for s, b in zip(single, batched):
        assert s.get_seq_length() == b.get_seq_length()
        for ls, lb in zip(s.layers, b.layers):
            _assert_same_bits_or_close(model, lb.keys, ls.keys)
            _assert_same_bits_or_close(model, lb.values, ls.values)


def test_step_batch_refuses_mismatched_lengths(model, prefills):
    runner = DecodeRunner(model)
    with pytest.raises(ValueError, match="as many tokens, caches and positions"):
        runner.step_batch([1, 2], [prefills[0].past_key_values], [0, 1])
    with pytest.raises(ValueError, match="as many tokens, caches and positions"):
        runner.step_batch([], [], [])


def _request(rid: str, p: PrefillResult, **kw) -> DecodeRequest:
    kv = KVTransferParams("tcp://127.0.0.1:1", rid, p.prompt_len, p.rope_delta, int(p.logits.argmax(-1)), 1)
    return DecodeRequest(rid, N_TOKENS, kv, **kw)


def test_server_scheduler_batches_up_to_max_batch(model, prefills):
    """The decode server's scheduler, in process: 3 greedy requests and 1 seeded sampled one with
    --max-batch 3. Greedy tokens equal `model.generate`; the sampled ones equal a single-request replay
    (bfloat16: same logits bits, so the same draws); no forward holds more than 3 requests, and some hold 3."""
    dtype = "bfloat16" if model.dtype == torch.bfloat16 else "float32"
    server = DecodeServer(DecodeSettings(dtype=dtype, kv_blocks=64, max_batch=3))
    try:
        outs = [queue.SimpleQueue() for _ in prefills]
        gens = []
        for k, p in enumerate(prefills):
            kw = {"temperature": 1.0, "seed": 3} if k == 3 else {}
            # what fetch_kv leaves: the prompt's KV in blocks of the server's cache (the scheduler adds more)
            table = server.blocks.allocate(blocks_needed(p.prompt_len, server.cache.block_size))
            server.cache.write_from(p.kv_tensors(), table, p.prompt_len)
            gens.append(server.admit(_request(f"r{k}", p, **kw), table, [], outs[k].put, lambda: None))
        deadline = time.monotonic() + 60
        for out in outs:
            items = []
            while (item := out.get(timeout=max(deadline - time.monotonic(), 0.1))) is not DONE:
                assert not isinstance(item, Exception), item
                items.append(item)
            assert len(items) == N_TOKENS
        counters = server.health()["counters"]
        wait_for(lambda: server.blocks.num_used_blocks == 0, 10, "every KV block freed as its request ended",
                 interval=0.01)
    finally:
        server.close()
    for k, (prompt, sizes) in enumerate(CASES[:3]):
        assert gens[k].tokens == _reference(model, prompt, sizes, N_TOKENS)
    if model.dtype == torch.bfloat16:
        assert gens[3].tokens == _sampled_replay(model, prefills[3], seed=3, temperature=1.0)
    starts: dict[int, int] = {}
    for gen in gens:
        for span in gen.spans:
            starts[span.t_start_ns] = starts.get(span.t_start_ns, 0) + 1  # one forward, one start
    assert max(starts.values()) == 3
    assert counters["decode_forwards"] == len(starts) < counters["tokens_generated"] - len(prefills)


def _sampled_replay(model, p: PrefillResult, seed: int, temperature: float) -> list[int]:
    """The request alone, step by step through HF's cache: token i+1 drawn with the noise of (seed, i+1)."""
    runner, cache = DecodeRunner(model), copy.deepcopy(p.past_key_values)
    tokens = [int(p.logits.argmax(-1))]  # the first token `_request` hands decode
    for i in range(N_TOKENS - 1):
        logits = runner.step(tokens[-1], cache, p.next_position + i)
        tokens.append(int(sample(logits.reshape(1, -1), [temperature], [seed], [i + 1])))
    return tokens


def test_a_request_that_finds_the_pool_empty_while_generating_fails_alone(model, prefills):
    """A decode's blocks grow as it generates. Admitted past the KV reservation (which keeps this from a decode
    request through HTTP; the monolithic server has none), the scheduler fails the one that finds the pool empty
    and goes on. A pool of 9 blocks; a 105-token prompt (7 blocks) generating 40
    tokens takes the free block when it stores token 112; a 2-token prompt (1 block) generating 30 needs a second
    block for token 16 and finds none: it fails with the reason, its block goes back, the other takes it for token
    128 and finishes."""
    dtype = "bfloat16" if model.dtype == torch.bfloat16 else "float32"
    short, long_ = prefills[0], prefills[1]  # 2 and 105 tokens: 1 and 7 blocks
    server = DecodeServer(DecodeSettings(dtype=dtype, kv_blocks=9, max_batch=2))
    try:
        outs = [queue.SimpleQueue(), queue.SimpleQueue()]
        for k, (p, n) in enumerate(((short, 30), (long_, 40))):
            table = server.blocks.allocate(blocks_needed(p.prompt_len, server.cache.block_size))
            server.cache.write_from(p.kv_tensors(), table, p.prompt_len)
            kv = KVTransferParams("tcp://127.0.0.1:1", f"r{k}", p.prompt_len, p.rope_delta,
                                  int(p.logits.argmax(-1)), len(table))
            server.admit(DecodeRequest(f"r{k}", n, kv), table, [], outs[k].put, lambda: None)
        items = [[], []]
        for k, out in enumerate(outs):
            while not isinstance(item := out.get(timeout=60), Exception) and item is not DONE:
                items[k].append(item)
            items[k].append(item)
        assert isinstance(items[0][-1], RuntimeError) and "KV pool exhausted while generating" in str(items[0][-1])
        assert len(items[0]) == 16  # token 0, the 14 steps that fit its block (tokens 2..15 stored), the error
        assert items[1][-1] is DONE and len(items[1]) == 41
        wait_for(lambda: server.blocks.num_used_blocks == 0, 10, "every KV block freed", interval=0.01)
        assert server.health()["counters"]["kv_pool_exhausted"] == 1
    finally:
        server.close()
