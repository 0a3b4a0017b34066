"""The serving floor's admission and liveness rules, in this process (`epd_lab.serving.admission`, `.liveness`),
and the proxy's estimates (`Drain`, `RecentLow`).

The queue is driven on a real event loop with real tasks; nothing is mocked. The roles' use of them runs through
real processes in `test_pd.py` and `test_overload.py`.
"""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from epd_lab.serving import STALL_MISSES, STALL_SILENCE, Admission, BadRequest, Liveness, Unavailable, deadline_budget
from epd_lab.serving.admission import PRIOR_SAMPLES, Drain, RecentLow
from epd_lab.serving.metrics import RoleMetrics
from helpers import plain_metrics


def run(coro):
    return asyncio.run(coro)


def test_a_free_worker_admits_at_once_and_the_service_time_is_measured():
    async def go() -> Admission:
        admission = Admission("role", workers=2, max_queued=4, timeout=10.0, prior_s=0.5)
        ticket = await admission.enter()
        assert admission.running == 1 and admission.queued == 0 and admission.predicted_wait() == 0.0
        await asyncio.sleep(0.05)
        ticket.leave()
        ticket.leave()  # idempotent
        return admission

    admission = run(go())
    assert admission.running == 0 and admission.measured == 1
    assert 0.05 <= admission.service_s < 0.5  # the first measurement replaces the prior


def test_waiters_are_served_in_order_as_slots_free():
    async def go() -> list[int]:
        admission = Admission("role", workers=1, max_queued=8, timeout=10.0, prior_s=0.01)
        order: list[int] = []

        async def one(i: int) -> None:
            ticket = await admission.enter()
            order.append(i)
            await asyncio.sleep(0.01)
            ticket.leave()

        tasks = [asyncio.create_task(one(i)) for i in range(5)]
        await asyncio.sleep(0)  # every task has entered: one runs, four wait
        assert admission.running == 1 and admission.queued == 4 and admission.admitted == 5
        await asyncio.gather(*tasks)
        assert admission.admitted == 0 and admission.queued_total == 4
        return order

    assert run(go()) == [0, 1, 2, 3, 4]


def test_the_predicted_wait_follows_position_and_the_measured_rate():
    async def go() -> None:
        admission = Admission("role", workers=2, max_queued=100, timeout=100.0, prior_s=1.0)
        tickets = [await admission.enter(), await admission.enter()]
        waiting = [asyncio.create_task(admission.enter()) for _ in range(3)]
        await asyncio.sleep(0)
        # three queued: a newcomer starts after 4 completions, 2 workers at 1 s each: 2 per second
        assert admission.predicted_wait() == pytest.approx(2.0)
        assert admission.predicted_wait(0) == pytest.approx(0.5)
        await asyncio.sleep(0.1)
        for t in tickets:
            t.leave()
        # measured: ~0.1 s each, far faster than the prior; one of them loaded, which the prior still outweighs
        assert admission.measured == 2 and admission.service_s < 0.5
        assert admission.measured_loaded == 1 and admission.rate == pytest.approx(2.0)
        while waiting:  # each granted one leaves at once, handing its slot on
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result().leave()
                waiting.remove(task)
        assert admission.admitted == 0 and admission.queued_total == 3

    run(go())


def test_the_rate_comes_from_requests_that_ran_with_every_worker_busy():
    async def go() -> None:
        admission = Admission("role", workers=2, max_queued=8, timeout=100.0, prior_s=1.0)
        for _ in range(3):  # one at a time, as a fresh cluster's first requests: fast, but alone
            ticket = await admission.enter()
            await asyncio.sleep(0.01)
            ticket.leave()
        assert admission.measured == 3 and admission.service_s < 0.5
        assert admission.measured_loaded == 0 and admission.rate == pytest.approx(2.0)  # the prior's: 2 / 1 s
        for n in range(1, PRIOR_SAMPLES + 1):
            first, second = await admission.enter(), await admission.enter()  # the second starts with both busy
            await asyncio.sleep(0.01)
            first.leave()
            second.leave()
            # the prior stands for the loaded times not measured yet: a few (a burst's slow start) do not outweigh it
            assert (admission.rate == pytest.approx(2.0)) == (n < PRIOR_SAMPLES / 2)
        assert admission.measured_loaded == PRIOR_SAMPLES and admission.loaded_service_s < 0.5
        assert admission.rate > 4.0 and admission.stats()["loaded_measured"] is True

    run(go())


def test_a_deadline_the_prediction_cannot_meet_is_refused_at_once_with_the_wait():
    async def go() -> None:
        admission = Admission("prefill", workers=1, max_queued=100, timeout=10.0, prior_s=1.0)
        first = await admission.enter()
        queued = asyncio.create_task(admission.enter(5.0))  # waits 1 s + runs 1 s: fits 5 s
        await asyncio.sleep(0)
        with pytest.raises(Unavailable) as info:
            await admission.enter(2.5)  # would wait 2 s and run 1 s
        assert info.value.status == 503 and info.value.retry_after == pytest.approx(0.5)
        assert "predicted wait 2.00 s" in info.value.detail and "deadline of 2.50 s" in info.value.detail
        assert info.value.code == "overloaded_deadline"
        assert admission.refused["deadline"] == 1 and admission.queued == 1
        first.leave()
        (await queued).leave()

    run(go())


def test_the_queue_bound_is_a_backstop_of_its_own():
    async def go() -> None:
        admission = Admission("decode", workers=1, max_queued=1, timeout=100.0, prior_s=0.01)
        first = await admission.enter()
        waiting = asyncio.create_task(admission.enter())
        await asyncio.sleep(0)
        with pytest.raises(Unavailable, match="at capacity: 1 running on 1 workers, 1 waiting"):
            await admission.enter()
        assert dict(admission.refused) == {"deadline": 0, "queue_full": 1, "expired": 0}
        first.leave()
        (await waiting).leave()

    run(go())


def test_a_request_whose_deadline_passes_in_the_queue_is_refused_then_and_leaves_no_trace():
    async def go() -> None:
        admission = Admission("role", workers=1, max_queued=8, timeout=10.0, prior_s=0.01)
        first = await admission.enter()  # never leaves while the second waits
        with pytest.raises(Unavailable, match="passed while the request waited"):
            await admission.enter(0.1)
        assert admission.refused["expired"] == 1 and admission.queued == 0
        cancelled = asyncio.create_task(admission.enter())
        await asyncio.sleep(0)
        cancelled.cancel()  # the caller went away: its place goes too
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert admission.queued == 0
        first.leave()
        assert admission.running == 0 and admission.admitted == 0

    run(go())


class _Families:
    """A collector of fixed families."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> list:
        return self.families


def exposition(role: str, admission: Admission) -> str:
    """`admission`'s families as a role's /metrics writes them (prometheus-client), read back by `plain_metrics`."""
    registry = CollectorRegistry()
    registry.register(_Families(admission.metric_families(RoleMetrics(role, "m"))))
    return plain_metrics(generate_latest(registry).decode())


def test_admission_metrics_name_every_refusal_reason():
    admission = Admission("prefill", workers=4, max_queued=1024, timeout=10.0)
    text = exposition("prefill", admission)
    for line in ('epd_lab:prefill_refused_total{reason="deadline"} 0',
                 'epd_lab:prefill_refused_total{reason="queue_full"} 0',
                 'epd_lab:prefill_refused_total{reason="expired"} 0', "epd_lab:prefill_queue_length 0",
                 "epd_lab:prefill_predicted_wait_seconds 0", "epd_lab:prefill_workers 4", "epd_lab:prefill_admitted 0"):
        assert line in text
    assert admission.stats()["refused"] == {"deadline": 0, "queue_full": 0, "expired": 0}


def test_deadline_budget_reads_the_header():
    assert deadline_budget({}, 10.0) == 10.0
    assert deadline_budget({"x-epd-deadline-ms": "2500"}, 10.0) == 2.5
    assert deadline_budget({"x-epd-deadline-ms": "60000"}, 10.0) == 60.0  # the sender's own wait
    assert deadline_budget({"x-epd-deadline-ms": "-5"}, 10.0) < 0  # no time left: refused by the admission
    for bad in ("soon", "nan", ""):
        with pytest.raises(BadRequest, match="X-EPD-Deadline-Ms"):
            deadline_budget({"x-epd-deadline-ms": bad}, 10.0)
    with pytest.raises(ValueError):
        Admission("role", workers=0, max_queued=1, timeout=1.0)


def test_missed_probes_stall_a_backend_only_when_nothing_else_was_heard():
    now = 1000.0
    busy = Liveness(retry_after=1.0, heard_at=now)
    for i in range(STALL_MISSES + 3):  # its /health is slow, but its tokens keep coming
        now += 1.5
        busy.heard(now - 0.1)
        assert busy.probed(False, now) is False
    assert not busy.stalled and busy.up(now)
    now += STALL_SILENCE  # then nothing at all: stalled by the next miss
    assert busy.probed(False, now) is True and busy.stalled and not busy.up(now)
    assert busy.probed(False, now + 1) is False  # found once
    assert busy.probed(True, now + 2) is False and not busy.stalled

    silent = Liveness(retry_after=1.0, heard_at=now)
    results = [silent.probed(False, now + 1.5 * (i + 1)) for i in range(STALL_MISSES)]
    assert results == [False] * (STALL_MISSES - 1) + [True]  # a frozen one is found as before


def test_a_waiter_the_prediction_no_longer_fits_is_refused_when_that_is_known_not_at_its_deadline():
    async def go() -> None:
        admission = Admission("role", workers=1, max_queued=8, timeout=10.0, prior_s=0.1)
        first = await admission.enter()
        a = asyncio.create_task(admission.enter(1.0))  # waits ~0.1 s, runs ~0.1 s: fits 1 s
        b = asyncio.create_task(admission.enter(1.0))
        await asyncio.sleep(0.5)  # the first takes 5 times the prior: the service time rose
        assert admission.queued == 2 and not b.done()
        first.leave()  # its slot goes to a; b would now wait behind a and run ~0.5 s itself, past its deadline
        done, _ = await asyncio.wait({b}, timeout=0.3)  # refused at once, not at its deadline 0.5 s later
        assert b in done
        with pytest.raises(Unavailable, match="predicted wait now .* does not fit the 0.[45].* left"):
            b.result()
        assert admission.refused["deadline"] == 1 and admission.refused["expired"] == 0
        (await a).leave()
        assert admission.admitted == 0

    run(go())


def test_weighted_requests_take_their_units_in_fifo_order_and_wait_for_what_comes_back():
    """Decode's KV admission: a capacity of 10 blocks. A request of 6 runs; one of 6 more waits (4 free); one of 2,
    which would fit, waits behind it (no overtaking: a large request is never starved). The predicted waits count
    the units that must come back at the rate (10 blocks per 1 s of service: 10 per second). More units than the
    capacity is a 400: it could never run."""
    async def go() -> None:
        admission = Admission("kv", workers=10, max_queued=8, timeout=100.0, prior_s=1.0, unit="blocks")
        with pytest.raises(BadRequest, match="needs 11 blocks of a capacity of 10"):
            await admission.enter(units=11)
        first = await admission.enter(units=6)
        assert admission.running == 6 and admission.predicted_wait(units=4) == 0.0
        assert admission.predicted_wait(units=6) == pytest.approx(0.2)  # 2 of the 6 must come back
        second = asyncio.create_task(admission.enter(units=6))
        await asyncio.sleep(0)
        third = asyncio.create_task(admission.enter(units=2))
        await asyncio.sleep(0)
        assert admission.queued == 2 and admission.admitted == 14 and not third.done()
        assert admission.predicted_wait(units=2) == pytest.approx(0.6)  # 6 + 2 ahead and its 2, less 4 free
        first.leave()  # 10 free: the second takes 6, the third's 2 fit beside them
        granted = [await second, await third]
        assert admission.running == 8 and admission.queued == 0 and admission.queued_total == 2
        for ticket in granted:
            ticket.leave()
        assert admission.admitted == 0
        text = exposition("decode", admission)
        assert "epd_lab:decode_queued_total 2" in text

    run(go())


def test_a_weighted_waiter_is_refused_when_the_units_ahead_of_it_cannot_come_back_in_time():
    async def go() -> None:
        admission = Admission("decode KV", workers=10, max_queued=8, timeout=100.0, prior_s=1.0, unit="blocks",
                              prefix="kv_admission_")
        held = await admission.enter(units=9)
        # its 8 blocks, less the 1 free, must come back (0.7 s), then 1 s of service: past its 1.5 s
        with pytest.raises(Unavailable, match=r"decode KV overloaded: predicted wait 0\.70 s .* on 10 blocks"):
            await admission.enter(1.5, units=8)
        held.leave()
        text = exposition("decode", admission)
        assert 'epd_lab:decode_kv_admission_refused_total{reason="deadline"} 1' in text

    run(go())


def test_an_idle_role_judges_a_deadline_by_its_best_case_not_its_median():
    """A median service time above the deadline refuses a newcomer while others run; an idle role judges by the
    fastest service it measured lately or assumes (its prior), so that a service time is measured again (by the
    median, an idle role would never measure one, and would refuse every request for good: an encoder whose one
    part was held past its timeout did, in test_epd). A deadline below even the best case is still refused."""
    async def go() -> None:
        admission = Admission("encoder", workers=2, max_queued=0, timeout=1.0, prior_s=0.01)
        slow = await admission.enter()
        slow._started -= 5.0  # it was held 5 s: the median service is now 5 s, above the 1 s deadline
        slow.leave()
        assert admission.service_s >= 5.0 and admission.best_case_s == 0.01
        probe = await admission.enter()  # idle: admitted
        with pytest.raises(Unavailable) as info:
            await admission.enter()  # one runs: the median holds
        assert info.value.code == "overloaded_deadline"
        probe._started -= 0.05  # it ran 50 ms
        probe.leave()
        assert admission.measured == 2 and admission.service_s < 5.0  # measured again: the median moves
        with pytest.raises(Unavailable):
            await admission.enter(0.001)  # idle, but not even the best case fits 1 ms

    run(go())


def test_the_drain_is_seconds_per_request_ahead_and_light_traffic_refreshes_it():
    """A sender's measure of the drain behind it: a request that found 99 ahead and was answered 5 s later
    drained at 0.05 s per request; one that found a worker free says only that `workers` run at once, so light
    traffic replaces a slow burst's samples instead of leaving them to refuse for good."""
    drain = Drain()
    assert drain.per_request_s is None and drain.predicted_s(10) is None
    for _ in range(3):
        drain.add(5.0, ahead=99, workers=4)
    assert drain.per_request_s == pytest.approx(0.05)
    assert drain.predicted_s(199) == pytest.approx(10.0)  # the 200th in line: 200 × 0.05 s
    for _ in range(40):  # light traffic: one at a time, 0.1 s each, on 4 workers
        drain.add(0.1, ahead=0, workers=4)
    assert drain.per_request_s == pytest.approx(0.025)


def test_recent_low_keeps_the_lowest_of_the_last_values_told_each_noted_once():
    low = RecentLow(count=3)
    assert low.seen(60.0) == 60.0
    assert low.seen(45.0) == 45.0  # a swing down is planned with ...
    assert low.seen(70.0) == 45.0  # ... while it is among the last 3 noted
    for _ in range(100):
        assert low.seen(70.0) == 45.0  # told again and again while idle: noted once, the swing still remembered
    assert low.seen(65.0) == 45.0
    assert low.seen(70.0) == 65.0  # 45 is 3 values back: forgotten
