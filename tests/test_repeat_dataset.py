"""`bench serve`'s ``image-repeat`` dataset and the cache report of a run: repeats are exact in number and the
very bytes sent before, Zipf's law favours the first images of the pool, and the hit rates and encoder stage
costs are computed from counters and spans as documented."""
from __future__ import annotations

import collections

import pandas as pd
import pytest

from epd_lab.bench.serve import parser, load_requests
from epd_lab.bench.serve.cache import COUNTERS, encoder_stage_ms, hit_rates
from epd_lab.bench.serve.datasets import repeated_images


def _repeats(requests) -> int:
    seen, count = set(), 0
    for r in requests:
        (image,) = r.images
        count += id(image) in seen
        seen.add(id(image))
    return count


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_a_repeat_fraction_is_exact_and_repeats_are_the_bytes_sent_before(fraction: float) -> None:
    requests = repeated_images(40, 3, fraction, pool_size=8, resolution="56x56")
    assert _repeats(requests) == min(39, round(fraction * 40))
    assert len({bytes(r.images[0]) for r in requests}) == 40 - _repeats(requests), "fresh images are distinct"
    assert requests[0].images[0] not in [r.images[0] for r in repeated_images(40, 4, fraction, 8, resolution="56x56")]


def test_repeats_come_from_the_last_pool_size_images() -> None:
    requests = repeated_images(60, 0, 0.5, pool_size=2, resolution="56x56")
    fresh: list[int] = []
    for r in requests:
        if id(r.images[0]) in fresh:
            assert id(r.images[0]) in fresh[-2:]
        else:
            fresh.append(id(r.images[0]))


def test_zipf_draws_from_the_pool_favouring_its_first_images() -> None:
    requests = repeated_images(400, 0, zipf=1.2, pool_size=20, resolution="56x56")
    counts = collections.Counter(bytes(r.images[0]) for r in requests)
    assert len(counts) <= 20
    ranked = [n for _, n in counts.most_common()]
    assert ranked[0] > 4 * ranked[-1]


@pytest.mark.parametrize("kwargs, message", [({"repeat_fraction": 1.5}, "repeat fraction"),
                                             ({"pool_size": 0}, "at least 1"), ({"zipf": 0.0}, "Zipf")])
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        repeated_images(4, **kwargs)


def test_the_command_line_names_the_dataset() -> None:
    args = parser().parse_args(["--dataset-name", "image-repeat", "--num-prompts", "10", "--image-repeat-fraction",
                                "0.3", "--image-resolution", "56x56", "--launch", "2e1p1d", "--mm-global-cache",
                                "both"])
    requests = load_requests(args)
    assert _repeats(requests) == 3 and args.mm_global_cache == "both"
    assert {r.prompt_len for r in requests} == {1024}  # vLLM's --random-input-len, in tokens (bytes here)


def test_a_jsonl_prompt_is_counted_in_tokens(tmp_path) -> None:
    (tmp_path / "d.jsonl").write_text('{"prompt": "héllo"}\n')
    args = parser().parse_args(["--dataset-name", "jsonl", "--dataset-path", str(tmp_path / "d.jsonl")])
    assert [r.prompt_len for r in load_requests(args)] == [6]  # UTF-8 bytes: é is two


def test_hit_rates_count_every_level_over_the_items_taken() -> None:
    before = dict.fromkeys(COUNTERS, 0.0)
    after = {**before, "l1_hits": 2, "l1_misses": 8, "l2_hits": 1, "l3_hits": 3, "l3_misses": 4}
    rates = hit_rates(before, after)
    assert rates["items"] == 10 and rates["hit_rate"] == 0.6 and rates["l3_hit_rate"] == 0.3


def test_encoder_stage_compares_whole_l3_hits_with_vit_misses() -> None:
    def span(req: str, stage: str, start: float, end: float, node: str = "encoder:1") -> dict:
        return {"req_id": req, "stage": stage, "node": node, "t_start_ns": int(start * 1e6),
                "t_end_ns": int(end * 1e6)}

    frame = pd.DataFrame([span("a", "load", 0, 1), span("a", "store_get", 1, 3),  # hit: 2 ms
                          span("b", "load", 0, 1), span("b", "decode", 1, 4), span("b", "vit", 4, 11),  # miss: 10
                          span("c", "load", 0, 1), span("c", "vit", 1, 2),  # an L1 hit: neither
                          span("a", "prefill", 3, 50, node="prefill:2")])
    got = encoder_stage_ms(frame)
    assert got["hit"] == {"parts": 1, "p50": 2.0, "p99": 2.0} and got["miss"]["p50"] == 10.0
    assert got["hit_over_miss_p50"] == pytest.approx(0.2)
