"""The receiver's own logic: the seed's item assignment, config checks, and reassembly in part order
whatever order the notifications arrive in (real ZMQ sockets)."""
from __future__ import annotations

import random
import time
from concurrent.futures import Future

import msgspec
import pytest
import torch
import zmq

from epd_lab.ep import receiver
from epd_lab.ep.messages import EmbeddingData, EmbeddingNotify, EncodeResponse, encode_zmq, part_req_id
from epd_lab.ep.receiver import (
    EmbeddingReceiver,
    EPDError,
    PartPlan,
    ReceiverConfig,
    assign_items_by_modality,
)
from helpers import free_port


def test_assignment_follows_the_seed_example():
    """Seed §7.1: 3 images + 2 videos on 2 encoders -> image parts 0,1, video parts 2,3."""
    plans = assign_items_by_modality({"image": ["i0", "i1", "i2"], "video": ["v0", "v1"]}, 2, random.Random(0))
    assert [(p.part_idx, p.modality, p.items) for p in plans] == [
        (0, "image", ["i0", "i1"]), (1, "image", ["i2"]), (2, "video", ["v0"]), (3, "video", ["v1"])]
    # the first encoder of the shuffled order takes the larger share of each modality
    assert plans[0].encoder == plans[2].encoder != plans[1].encoder


@pytest.mark.parametrize("n_items,n_enc", [(1, 3), (4, 3), (7, 2), (2, 2), (5, 1)])
def test_assignment_covers_every_item_once_in_order(n_items, n_enc):
    items = [f"x{i}" for i in range(n_items)]
    plans = assign_items_by_modality({"image": items}, n_enc, random.Random(n_items))
    assert [x for p in plans for x in p.items] == items
    assert [p.part_idx for p in plans] == list(range(len(plans)))
    assert len(plans) == min(n_items, n_enc)
    assert len({p.encoder for p in plans}) == len(plans)
    sizes = [len(p.items) for p in plans]
    assert max(sizes) - min(sizes) <= 1


def test_shuffle_spreads_load_over_encoders():
    first = {assign_items_by_modality({"image": ["a"]}, 3, random.Random(s))[0].encoder for s in range(30)}
    assert first == {0, 1, 2}


@pytest.mark.parametrize("kwargs,match", [
    (dict(encoder_urls=[]), "at least one"),
    (dict(encoder_urls=["http://x"], backend="pickle"), "mooncake"),
    (dict(encoder_urls=["http://x"], timeout=0), "timeout"),
    (dict(encoder_urls=["http://x"], pool_bytes=-1), "pool_bytes"),
    (dict(encoder_urls=["http://x", "x:2"]), "encoder URL 'x:2' must start with http:// or https://"),
])
def test_config_is_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReceiverConfig(**kwargs)


def test_config_keeps_its_encoder_urls_without_a_trailing_slash():
    """As the prefill's --encoders (`check_urls`): the receiver appends its routes to them."""
    assert ReceiverConfig(["http://x:1/", "https://x:2"]).encoder_urls == ("http://x:1", "https://x:2")


def test_parts_reassemble_in_part_order_whatever_the_arrival_order():
    """Notifications pushed in reverse order over a real ZMQ socket still reassemble in part order;
    invalid frames are dropped and counted."""
    config = ReceiverConfig(["http://127.0.0.1:9"], backend="zmq_to_tokenizer", timeout=5)
    parts = [torch.full((i + 2, 4), float(i)) for i in range(4)]
    rid = "r1"
    plans = [PartPlan(i, i, "image", [f"img{i}"]) for i in range(4)]
    with EmbeddingReceiver(config) as rx:
        futures = {part_req_id(rid, i): Future() for i in range(4)}
        rx._pending.update(futures)
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{rx.embedding_port}")
        try:
            push.send(b"\x93not a message")
            for i in reversed(range(4)):
                push.send(encode_zmq(EmbeddingData(part_req_id(rid, i), i, "image", list(parts[i].shape), "float32",
                                                   [[1, 2, 2]], data=parts[i].numpy().tobytes())))
            msgs = rx._wait(rid, plans, futures, deadline=time.monotonic() + 5)
        finally:
            push.close()
            ctx.term()
        assert [m.part_idx for m in msgs] == [0, 1, 2, 3]
        got = rx._assemble(rid, plans, msgs, [torch.frombuffer(bytearray(m.data), dtype=torch.float32).view(m.shape)
                                              for m in msgs])
        assert torch.equal(got.embeddings["image"], torch.cat(parts))
        assert got.grid_thw["image"] == [[1, 2, 2]] * 4
        assert rx.counters["invalid_messages"] == 1


def test_a_mooncake_part_is_viewed_as_its_answer_announced_and_its_notify_must_agree():
    """The request's buffer is viewed per part from the /encode answers before the wait; a region that does not
    hold the answer's tensor, an unknown dtype, or a notify describing another tensor is an `EPDError`."""
    answer = EncodeResponse("r_local_part_0", 0, 3 * 4 * 2, 3, 4, "bfloat16", [[1, 2, 6]])
    buf = torch.arange(64, dtype=torch.uint8)
    view = receiver._answered_view(answer, buf[8:32])
    assert (view.shape, view.dtype) == (torch.Size([3, 4]), torch.bfloat16)
    assert view.data_ptr() == buf[8:].data_ptr()  # in place: no copy
    with pytest.raises(EPDError, match="do not hold shape"):
        receiver._answered_view(answer, buf[8:30])
    with pytest.raises(EPDError, match="unknown dtype"):
        receiver._answered_view(msgspec.structs.replace(answer, dtype="float8"), buf[8:32])
    notify = EmbeddingNotify("r_local_part_0", 0, "IMAGE", [3, 4], "bfloat16", [[1, 2, 6]])
    receiver._check_notified(notify, answer)
    for wrong in ({"shape": [4, 3]}, {"dtype": "float32"}):
        with pytest.raises(EPDError, match="its /encode answer"):
            receiver._check_notified(msgspec.structs.replace(notify, **wrong), answer)


def test_encoder_down_is_an_error_not_a_hang():
    """No encoder listens at the URL: the request fails at once with the URL in the message."""
    port = free_port()
    with EmbeddingReceiver(ReceiverConfig([f"http://127.0.0.1:{port}"], timeout=2)) as rx:
        with pytest.raises(EPDError, match=f"127.0.0.1:{port}"):
            rx.receive(["a.png"])
        assert rx.engine.stats()["regions"] == 0


def test_a_landing_lands_once_on_the_last_good_part_or_when_told():
    """`Landing.part_done` lands on the last of its parts' good notifies, not on a failed part (the waiting
    thread lands then); `land` deregisters and runs the callbacks exactly once, and a deregistration's error is
    kept for `check` while the callbacks still run."""
    calls: list[str] = []
    landing = receiver.Landing(None, 2, lambda: calls.append("deregister"))
    landing.when_landed(lambda: calls.append("landed"))
    good, failed = Future(), Future()
    good.set_result(EmbeddingNotify("r_local_part_0", 0, "IMAGE", [1, 4], "float32", [[1, 2, 2]]))
    failed.set_exception(EPDError("part 1 failed"))
    landing.part_done(good)
    landing.part_done(failed)
    assert calls == [] and landing.watched
    landing.land()
    landing.land()
    landing.when_landed(lambda: calls.append("late"))
    assert calls == ["deregister", "landed", "late"]
    landing.check()

    def refuse() -> None:
        raise receiver.EPDError("unknown region")

    calls.clear()
    landing = receiver.Landing(None, 1, refuse)
    landing.when_landed(lambda: calls.append("landed"))
    landing.part_done(good)
    assert calls == ["landed"]
    with pytest.raises(EPDError, match="unknown region"):
        landing.check()
