"""A reversal's records are never split (turn/ledger.py, run_compensation
and reverse_confirmed): whatever interrupts a stop's reversal (its time
bound firing during a slow store write, a crash after any one write), the
ledger ends by saying what the external system holds. Before, a time bound
that fired between "job done" and "effect compensated", or a crash between
"effect done" and "job written", left an effect recorded done that the
external system had reversed, or would never reverse (CI found the first
under load: test_stop_policy and the ledger fuzzer, "done but not applied").
Both stores."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any

import pytest
from test_ledger import run

from clock import VirtualClock
from demo_shop.service import DemoService
from demo_shop.tools import demo_handlers, demo_tools
from turn.intents import OPEN, Intent, IntentKind, IntentStatus, LookupAnswer
from turn.ledger import Ledger
from turn.models import StopReasonKind
from turn.reconciliation import ReconciliationWorker
from turn.stop_policy import TurnStop, TurnStopOf
from turn.store import TurnStore


class Crash(Exception):
    """The process died right after a write landed."""


class Interrupting:
    """A store that delegates to ``store`` and, after the ``crash_after``-th
    write has landed, raises :class:`Crash`; each write that ``slow(row)``
    picks takes ``slow_s`` more of the virtual clock after it landed (a
    loaded store)."""

    def __init__(self, store: TurnStore, clock: VirtualClock, *, crash_after: int = 0,
                 slow: Callable[[Intent], bool] = lambda _r: False, slow_s: float = 0.0) -> None:
        self._store, self._clock = store, clock
        self.crash_after, self.slow, self.slow_s = crash_after, slow, slow_s
        self.writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def _landed(self) -> None:
        self.writes += 1
        if self.writes == self.crash_after:
            raise Crash(f"after write {self.writes}")

    async def ledger_add(self, row: Intent) -> tuple[Intent, bool]:
        out = await self._store.ledger_add(row)
        await self._landed()
        return out

    async def ledger_replace(self, row: Intent) -> bool:
        ok = await self._store.ledger_replace(row)
        if ok and self.slow(row):
            await self._clock.sleep(self.slow_s)
        await self._landed()
        return ok

    async def audit_add(self, row: Any) -> None:
        await self._store.audit_add(row)
        await self._landed()


@pytest.fixture
async def service(clock: VirtualClock) -> AsyncIterator[DemoService]:
    s = DemoService(clock, latency_s=0.0)
    yield s
    await s.aclose()


def ledger_on(store: Any, clock: VirtualClock, service: DemoService) -> Ledger:
    tools = demo_tools(clock, service, store)
    return Ledger(store, clock, handlers=demo_handlers(lambda: tools, service))


def stopped_by(kind: StopReasonKind, at: datetime | None = None, *, terminal: bool = True) -> TurnStopOf:
    """The worker's view of the turn: stopped for ``kind`` at ``at`` (None:
    a time it does not know, so it judges no stage), ended or still
    stopping."""

    async def stop(_turn_id: str) -> TurnStop:
        return TurnStop(kind, at, terminal)

    return stop


async def settle(store: TurnStore, clock: VirtualClock, service: DemoService, kind: StopReasonKind) -> None:
    """A restarted instance's reconciliation worker, for a minute of the clock."""
    worker = ReconciliationWorker(ledger_on(store, clock, service), stopped_by(kind), pending_grace_s=30)
    for _ in range(12):
        await run(clock, worker.run_once())
        await clock.advance(5)


async def assert_reversed(store: TurnStore, service: DemoService, key: str) -> None:
    rows = await store.ledger_list("t1")
    effect = next(r for r in rows if r.key == key)
    jobs = [r for r in rows if r.kind is IntentKind.COMPENSATION]
    assert effect.status is IntentStatus.COMPENSATED, await store.audit_list(key)
    assert [j.status for j in jobs] == [IntentStatus.DONE]
    assert not [r for r in rows if r.status in OPEN]
    applied = await service.applied(key)
    assert applied[key]["reversed"]  # what the ledger says is what the external system holds
    assert await service.repeats(key) == 0


async def unanswered_order(ledger: Ledger) -> Intent:
    """An order sent to the external system (its intent written), with no answer yet."""
    return await ledger.intent("t1", 1, "create_order", {"item": "tea"}, "compensate")


async def in_flight_order(ledger: Ledger, service: DemoService) -> Intent:
    """An order the external system wrote, whose answer never came back."""
    row = await unanswered_order(ledger)
    await service.apply("order", row.key, {"item": "tea"})
    return row


@pytest.mark.parametrize("crash_after", range(1, 14))
@pytest.mark.parametrize("entry", ["stop_in_flight", "stop_done", "reconcile"])
async def test_a_crash_after_any_write_of_a_reversal_leaves_it_to_finish(
    any_store, clock: VirtualClock, service: DemoService, entry: str, crash_after: int  # type: ignore[no-untyped-def]
) -> None:
    row = await in_flight_order(ledger_on(any_store, clock, service), service)
    kind = StopReasonKind.SAFETY_ABORT if entry == "stop_done" else StopReasonKind.BARGE_IN
    store = Interrupting(any_store, clock, crash_after=crash_after)
    ledger = ledger_on(store, clock, service)
    if entry == "stop_done":  # confirmed done before the stop; a safety abort reverses it
        await ledger_on(any_store, clock, service).move(row.key, IntentStatus.DONE)
        await clock.advance(1)
    elif entry == "reconcile":  # the stop called it effect_unknown; the worker finds it present
        await ledger_on(any_store, clock, service).move(row.key, IntentStatus.EFFECT_UNKNOWN)
    try:
        if entry == "reconcile":
            await ReconciliationWorker(ledger, stopped_by(kind)).reconcile(await any_store.ledger_get(row.key), kind)
        else:
            await ledger.resolve_on_stop("t1", kind, clock.now())
    except Crash:
        pass
    await settle(any_store, clock, service, kind)
    await assert_reversed(any_store, service, row.key)


@pytest.mark.parametrize("slow", ["effect", "job", "every"])
async def test_a_time_bound_firing_during_a_slow_write_never_splits_the_record(
    any_store, clock: VirtualClock, service: DemoService, slow: str  # type: ignore[no-untyped-def]
) -> None:
    """The stop's reversal is bounded (COMPENSATE_NOW_S); its records are
    not: a write that takes longer than the bound finishes, and the ledger
    says compensated, not done."""
    row = await in_flight_order(ledger_on(any_store, clock, service), service)
    picks = {
        "effect": lambda r: r.kind is IntentKind.EFFECT and r.status is IntentStatus.COMPENSATED,
        "job": lambda r: r.kind is IntentKind.COMPENSATION and r.status is IntentStatus.DONE,
        "every": lambda _r: True,
    }
    store = Interrupting(any_store, clock, slow=picks[slow], slow_s=1.0)
    ledger = ledger_on(store, clock, service)
    await run(clock, ledger.resolve_on_stop("t1", StopReasonKind.BARGE_IN, clock.now()))
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    await assert_reversed(any_store, service, row.key)


# -- races with other writers (a reviewer's sketches, each failing before) -------------


class Hooked(Interrupting):
    """A store that runs ``after(row)`` once each replace of a row has landed."""

    def __init__(self, store: TurnStore, clock: VirtualClock, after: Callable[[Intent], Awaitable[None]]) -> None:
        super().__init__(store, clock)
        self.after = after

    async def ledger_replace(self, row: Intent) -> bool:
        ok = await self._store.ledger_replace(row)
        if ok:
            await self.after(row)
        return ok


async def test_two_reconcilers_reverse_an_effect_once(any_store, clock: VirtualClock, service: DemoService) -> None:  # type: ignore[no-untyped-def]
    """Two instances' workers read the same effect_unknown row and both
    find it present: one claims it, and the external system sees one
    reversal."""
    led = ledger_on(any_store, clock, service)
    row = await in_flight_order(led, service)
    await led.move(row.key, IntentStatus.EFFECT_UNKNOWN)
    seen = await any_store.ledger_get(row.key)
    workers = [ReconciliationWorker(ledger_on(any_store, clock, service), stopped_by(StopReasonKind.BARGE_IN)) for _ in range(2)]
    await run(clock, asyncio.gather(*(w.reconcile(seen, StopReasonKind.BARGE_IN) for w in workers)))
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    await assert_reversed(any_store, service, row.key)
    assert await service.times_reversed(row.key) == 1


async def test_a_reversal_is_held_from_its_call_not_from_its_job(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """Recording the effect done takes 2.5 s (a busy store), then the
    compensation's call takes 0.4 s (within its bound). A worker pass while
    the call runs starts no second attempt of the same reversal."""
    led = ledger_on(any_store, clock, service)
    row = await in_flight_order(led, service)
    await led.move(row.key, IntentStatus.EFFECT_UNKNOWN)
    stop_at = clock.now()

    async def busy(r: Intent) -> None:
        if r.kind is IntentKind.EFFECT and r.status is IntentStatus.DONE:
            await clock.sleep(2.5)

    calls, peak = 0, 0
    reverse = service.reverse

    async def slow_reverse(key: str) -> bool:
        nonlocal calls, peak
        calls += 1
        peak = max(peak, calls)
        try:
            await clock.sleep(0.4)
            return await reverse(key)
        finally:
            calls -= 1

    service.reverse = slow_reverse  # type: ignore[method-assign]
    stopping = asyncio.ensure_future(ledger_on(Hooked(any_store, clock, busy), clock, service).resolve_on_stop(
        "t1", StopReasonKind.BARGE_IN, stop_at
    ))
    while not calls and not stopping.done():  # until the stop's call runs
        await clock.advance(0.05)
        await asyncio.sleep(0.001)
    worker = ReconciliationWorker(ledger_on(any_store, clock, service), stopped_by(StopReasonKind.BARGE_IN))
    await run(clock, asyncio.gather(stopping, worker.run_once()))
    assert peak == 1, "two attempts of one reversal ran at once"
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    await assert_reversed(any_store, service, row.key)


@pytest.mark.parametrize("moved_to", ["human_required", "done_before_the_stop"])
async def test_a_row_settled_elsewhere_meanwhile_is_not_reversed(
    any_store, clock: VirtualClock, service: DemoService, moved_to: str  # type: ignore[no-untyped-def]
) -> None:
    """A worker acts on a row it read as effect_unknown; meanwhile another
    instance gave it to a person, or the call's own answer, stamped before
    the stop, landed (a barge-in keeps what was done before it). The worker
    reverses nothing and leaves no job to do it later."""
    led = ledger_on(any_store, clock, service)
    row = await in_flight_order(led, service)
    answered_at = clock.now()
    await led.move(row.key, IntentStatus.EFFECT_UNKNOWN)
    await clock.advance(1)
    seen = await any_store.ledger_get(row.key)
    if moved_to == "human_required":
        await led.give_up(seen, "another instance gave up")
    else:
        await led.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=answered_at)
    await ReconciliationWorker(led, stopped_by(StopReasonKind.BARGE_IN)).reconcile(seen, StopReasonKind.BARGE_IN)
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    assert not (await service.applied(row.key))[row.key]["reversed"]
    assert (await any_store.ledger_get(row.key)).status is {"human_required": IntentStatus.HUMAN_REQUIRED}.get(moved_to, IntentStatus.DONE)
    assert not [r for r in await any_store.ledger_list("t1") if r.status in OPEN]


async def test_a_stop_keeps_an_effect_whose_answer_came_before_it(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """The order's answer came just before the barge-in, but its record
    was written after the stop had called it effect_unknown and while the
    stop looked it up. The stop keeps it (done before the stop), as the
    policy says; before, it reversed it."""
    raw = ledger_on(any_store, clock, service)
    row = await in_flight_order(raw, service)
    answered_at = clock.now()
    await clock.advance(0.1)
    stop_at = clock.now()
    lookup = service.lookup

    async def answer_lands_during_lookup(key: str) -> Any:
        found = await lookup(key)
        await raw.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=answered_at)
        return found

    service.lookup = answer_lands_during_lookup  # type: ignore[method-assign]
    remains = await ledger_on(any_store, clock, service).resolve_on_stop("t1", StopReasonKind.BARGE_IN, stop_at)
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    assert not remains
    assert (await any_store.ledger_get(row.key)).status is IntentStatus.DONE
    assert not (await service.applied(row.key))[row.key]["reversed"]
    jobs = [r for r in await any_store.ledger_list("t1") if r.kind is IntentKind.COMPENSATION]
    assert all(j.status is IntentStatus.ABANDONED for j in jobs)  # none ran


async def test_an_answer_landing_during_a_compensation_that_finds_nothing_is_reversed(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """The compensation's call finds nothing; while its answer comes back
    the order lands and the tool's answer is recorded. The effect is not
    "not done": the job stays open and its next attempt reverses the
    order, and the stop says an effect remains (never CANCELLED)."""
    raw = ledger_on(any_store, clock, service)
    row = await unanswered_order(raw)
    stop_at = clock.now()
    await clock.advance(0.1)
    reverse, first = service.reverse, [True]

    async def reverse_then_land(key: str) -> bool:
        found = await reverse(key)
        if first:
            first.clear()
            await service.apply("order", row.key, {"item": "tea"})
            await raw.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=clock.now())
        return found

    service.reverse = reverse_then_land  # type: ignore[method-assign]
    service.inject("lookup", "lookup_unknown")
    remains = await ledger_on(any_store, clock, service).resolve_on_stop("t1", StopReasonKind.BARGE_IN, stop_at)
    service.clear_faults()
    assert remains
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    await assert_reversed(any_store, service, row.key)


@pytest.mark.parametrize("then", [None, "slow", "fail_before"])
async def test_a_reversal_of_a_late_landing_is_bounded_and_retried(
    any_store, clock: VirtualClock, service: DemoService, then: str | None  # type: ignore[no-untyped-def]
) -> None:
    """The lookup cannot say, so the compensation runs and finds nothing
    (the order has not landed yet); the order lands and the tool answers
    right after the effect was recorded abandoned, before the job is
    closed. A barge-in reverses what was in flight: the order ends
    reversed, by the job's next attempt: the stop does not wait for it (a
    slow shop), and one failure is retried, not handed to a person."""
    raw = ledger_on(any_store, clock, service)
    row = await unanswered_order(raw)
    stop_at = clock.now()
    landed: list[bool] = []

    async def land(r: Intent) -> None:
        if r.kind is IntentKind.EFFECT and r.status is IntentStatus.ABANDONED and not landed:
            landed.append(True)
            await service.apply("order", row.key, {"item": "tea"})
            await raw.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=clock.now())
            if then is not None:
                service.inject("reverse", then)  # the next reversal: 5 s, or refused once

    service.inject("lookup", "lookup_unknown")
    t0 = clock.monotonic()
    await run(clock, ledger_on(Hooked(any_store, clock, land), clock, service).resolve_on_stop("t1", StopReasonKind.BARGE_IN, stop_at))
    assert landed and clock.monotonic() - t0 < 0.5 + 0.2  # the stop's calls kept their bound
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    await assert_reversed(any_store, service, row.key)


async def test_a_stale_absent_answer_does_not_undo_a_claimed_reversal(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """A worker finds the order present and claims the row; the stop's
    lookup, made a moment before the order landed, answers absent just
    then. The stop leaves the claimed row to the worker, which reverses it
    (before, the stop recorded it "not done" and the order stood)."""
    raw = ledger_on(any_store, clock, service)
    row = await in_flight_order(raw, service)
    await raw.move(row.key, IntentStatus.EFFECT_UNKNOWN)
    seen = await any_store.ledger_get(row.key)
    stop = ledger_on(any_store, clock, service)
    shop = stop.handlers

    class Stale:
        """The stop's view of the shop: its lookup saw nothing yet."""

        def __getattr__(self, name: str) -> Any:
            return getattr(shop(row.tool), name)

        async def lookup_effect(self, _key: str) -> LookupAnswer:
            return LookupAnswer.ABSENT

    stop.handlers = lambda _name: Stale()  # type: ignore[assignment,return-value]
    fired: list[Intent] = []

    async def stop_answers_absent(r: Intent) -> None:
        if r.key == row.key and r.status is IntentStatus.EFFECT_UNKNOWN and r.version == seen.version + 1 and not fired:
            fired.append(await stop.reverse_in_flight(seen))

    hooked = ledger_on(Hooked(any_store, clock, stop_answers_absent), clock, service)
    worker = ReconciliationWorker(hooked, stopped_by(StopReasonKind.BARGE_IN))
    await worker.reconcile(seen, StopReasonKind.BARGE_IN)
    assert fired and fired[0].status is not IntentStatus.ABANDONED
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    await assert_reversed(any_store, service, row.key)


# -- a call's answer landing after its stop was resolved (a tool that ignored
# its cancellation): judged by the stop's policy at the stage the answer
# gives it, by whoever sees it (the answer's own record, a job, the worker)


def ledger_stopped(
    store: Any, clock: VirtualClock, service: DemoService, kind: StopReasonKind, at: datetime, *, terminal: bool = True
) -> Ledger:
    """The product's ledger: it knows the turn's stop (the manager reads the turn)."""
    ledger = ledger_on(store, clock, service)
    ledger.turn_stop = stopped_by(kind, at, terminal=terminal)
    return ledger


async def test_a_job_left_by_a_slow_lookup_keeps_an_order_answered_before_the_barge_in(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """The order was placed and answered just before the barge-in, but its
    record had not been written when the stop resolved the turn; the
    stop's lookup took longer than its bound, so it left a compensation
    job. Then the answer's record lands. A barge-in keeps what was done
    before it: the job does not run and the order stands (before, the
    worker reversed it: the job did not know the stop's time)."""
    row = await in_flight_order(ledger_on(any_store, clock, service), service)
    answered_at = clock.now()
    await clock.advance(0.1)
    stop_at = clock.now()
    service.inject("lookup", "slow")
    ledger = ledger_stopped(any_store, clock, service, StopReasonKind.BARGE_IN, stop_at)
    await run(clock, ledger.resolve_on_stop("t1", StopReasonKind.BARGE_IN, stop_at))
    service.clear_faults()
    jobs = [r for r in await any_store.ledger_list("t1") if r.kind is IntentKind.COMPENSATION]
    assert [j.status for j in jobs] == [IntentStatus.PENDING]  # left to a job
    await ledger.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=answered_at)
    worker = ReconciliationWorker(ledger, stopped_by(StopReasonKind.BARGE_IN, stop_at))
    for _ in range(12):
        await run(clock, worker.run_once())
        await clock.advance(5)
    assert not (await service.applied(row.key))[row.key]["reversed"]
    assert await service.times_reversed(row.key) == 0
    rows = await any_store.ledger_list("t1")
    assert [(r.kind, r.status) for r in rows] == [
        (IntentKind.EFFECT, IntentStatus.DONE), (IntentKind.COMPENSATION, IntentStatus.ABANDONED)
    ]


async def test_the_worker_reverses_an_order_whose_answer_after_the_stop_lands_during_its_lookup(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """The stop left the order effect_unknown. While the worker looks it
    up, the call's answer, stamped after the stop, is recorded (by a writer
    that does not judge it). The order was in flight at the barge-in, so
    the worker reverses it (before, it left the row to "whoever changed
    it": the order stood, done, with no job)."""
    raw = ledger_on(any_store, clock, service)
    row = await in_flight_order(raw, service)
    stop_at = clock.now()
    await raw.move(row.key, IntentStatus.EFFECT_UNKNOWN)
    await clock.advance(0.2)
    seen = await any_store.ledger_get(row.key)
    lookup = service.lookup

    async def answer_lands_during_lookup(key: str) -> Any:
        found = await lookup(key)
        await raw.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=clock.now())
        return found

    service.lookup = answer_lands_during_lookup  # type: ignore[method-assign]
    worker = ReconciliationWorker(ledger_on(any_store, clock, service), stopped_by(StopReasonKind.BARGE_IN, stop_at))
    await run(clock, worker.run_once())
    service.lookup = lookup  # type: ignore[method-assign]
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    await assert_reversed(any_store, service, row.key)
    assert seen.status is IntentStatus.EFFECT_UNKNOWN


@pytest.mark.parametrize("resolved", ["absent", "left_to_its_work"])
async def test_an_order_that_lands_after_its_turn_was_cancelled_is_reversed(
    any_store, clock: VirtualClock, service: DemoService, resolved: str  # type: ignore[no-untyped-def]
) -> None:
    """The stop resolved the turn while the order had not landed: its
    lookup found nothing (abandoned, the turn CANCELLED), or a tool that
    ignored its cancellation still held it (left to its work). Then the
    order lands and the tool answers, after the barge-in. What was in
    flight at a barge-in is reversed: its answer's record writes the
    compensation job and tries it at once (before, the order stood: only
    an already-run compensation was redone)."""
    raw = ledger_on(any_store, clock, service)
    row = await unanswered_order(raw)
    stop_at = clock.now()
    ledger = ledger_stopped(any_store, clock, service, StopReasonKind.BARGE_IN, stop_at)
    remains = await run(clock, ledger.resolve_on_stop(
        "t1", StopReasonKind.BARGE_IN, stop_at, work_running=resolved == "left_to_its_work"
    ))
    assert (await any_store.ledger_get(row.key)).status is {
        "absent": IntentStatus.ABANDONED, "left_to_its_work": IntentStatus.PENDING
    }[resolved]
    assert remains is (resolved == "left_to_its_work")
    await clock.advance(0.3)
    await service.apply("order", row.key, {"item": "tea"})
    await run(clock, ledger.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=clock.now()))
    assert (await service.applied(row.key))[row.key]["reversed"]  # at once, not only by the worker
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    await assert_reversed(any_store, service, row.key)
    assert await service.times_reversed(row.key) == 1


async def test_an_answer_before_the_stop_that_lands_after_it_is_kept(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """The same late landing, but the order was answered before the
    barge-in: it is kept, with no job, whoever records it."""
    raw = ledger_on(any_store, clock, service)
    row = await in_flight_order(raw, service)
    answered_at = clock.now()
    await clock.advance(0.1)
    stop_at = clock.now()
    ledger = ledger_stopped(any_store, clock, service, StopReasonKind.BARGE_IN, stop_at)
    await run(clock, ledger.resolve_on_stop("t1", StopReasonKind.BARGE_IN, stop_at, work_running=True))
    await run(clock, ledger.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=answered_at))
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    assert not (await service.applied(row.key))[row.key]["reversed"]
    assert [(r.kind, r.status) for r in await any_store.ledger_list("t1")] == [(IntentKind.EFFECT, IntentStatus.DONE)]


@pytest.mark.parametrize("fault", ["fail_before", "fail_after"])
async def test_a_failed_reversal_of_an_order_answered_before_the_barge_in_goes_to_a_person(
    any_store, clock: VirtualClock, service: DemoService, fault: str  # type: ignore[no-untyped-def]
) -> None:
    """The stop's lookup could not say, so it tried the compensation; the
    call failed (before the shop reversed anything, or after: the answer
    was lost). Then the order's answer lands, stamped before the barge-in,
    which keeps it. Whether the shop still holds it is not known, so the
    job goes to a person: it is neither rerun (undoing what the barge-in
    keeps) nor dropped (the ledger saying done of an order the shop may
    have reversed, as a first draft did)."""
    raw = ledger_on(any_store, clock, service)
    row = await in_flight_order(raw, service)
    answered_at = clock.now()
    await clock.advance(0.1)
    stop_at = clock.now()
    ledger = ledger_stopped(any_store, clock, service, StopReasonKind.BARGE_IN, stop_at)
    service.inject("lookup", "lookup_unknown")
    service.inject("reverse", fault)
    assert await run(clock, ledger.resolve_on_stop("t1", StopReasonKind.BARGE_IN, stop_at))
    await run(clock, ledger.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=answered_at))
    worker = ReconciliationWorker(ledger, stopped_by(StopReasonKind.BARGE_IN, stop_at))
    for _ in range(12):
        await run(clock, worker.run_once())
        await clock.advance(5)
    rows = {r.kind: r for r in await any_store.ledger_list("t1")}
    assert rows[IntentKind.COMPENSATION].status is IntentStatus.HUMAN_REQUIRED
    assert "may have reversed it" in (rows[IntentKind.COMPENSATION].error or "")
    assert rows[IntentKind.EFFECT].status is IntentStatus.DONE
    assert (await service.applied(row.key))[row.key]["reversed"] is (fault == "fail_after")  # one try, never a second
    assert await service.times_reversed(row.key) == (fault == "fail_after")


async def test_an_answer_landing_right_after_a_lookup_confirmed_the_order_keeps_it(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """The stop's lookup found the order and recorded it done (no result:
    a lookup's); right then the call's answer lands, stamped before the
    barge-in. The answer is recorded over the lookup's (before, it was
    dropped) and the stop keeps the order."""
    raw = ledger_on(any_store, clock, service)
    row = await in_flight_order(raw, service)
    answered_at = clock.now()
    await clock.advance(0.1)
    stop_at = clock.now()
    landed: list[bool] = []

    async def answer_lands(r: Intent) -> None:
        if r.key == row.key and r.status is IntentStatus.DONE and r.result is None and not landed:
            landed.append(True)
            await raw.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=answered_at)

    ledger = ledger_on(Hooked(any_store, clock, answer_lands), clock, service)
    ledger.turn_stop = stopped_by(StopReasonKind.BARGE_IN, stop_at)
    assert not await run(clock, ledger.resolve_on_stop("t1", StopReasonKind.BARGE_IN, stop_at))
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    assert landed
    effect = await any_store.ledger_get(row.key)
    assert (effect.status, effect.result, effect.done_at) == (IntentStatus.DONE, "placed", answered_at)
    assert not (await service.applied(row.key))[row.key]["reversed"]
    jobs = [r for r in await any_store.ledger_list("t1") if r.kind is IntentKind.COMPENSATION]
    assert [j.status for j in jobs] == [IntentStatus.ABANDONED]


async def test_an_answer_during_the_stop_leaves_the_reversal_to_the_stop_not_to_the_tools_task(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """The order's answer, stamped after the barge-in, is recorded while
    the turn is still stopping (the stop waits for the tool's task). The
    record writes the compensation job, due, and returns without calling
    the shop (before, the reversal ran in the tool's task, so the stop saw
    a child that ignored its cancellation); the stop then reverses it."""
    raw = ledger_on(any_store, clock, service)
    row = await in_flight_order(raw, service)
    stop_at = clock.now()
    await clock.advance(0.1)
    ledger = ledger_stopped(any_store, clock, service, StopReasonKind.BARGE_IN, stop_at, terminal=False)
    await ledger.settle_late(row.key, IntentStatus.DONE, result="placed", done_at=clock.now())
    assert await service.times_reversed(row.key) == 0
    jobs = [r for r in await any_store.ledger_list("t1") if r.kind is IntentKind.COMPENSATION]
    assert [(j.status, j.next_attempt_at) for j in jobs] == [(IntentStatus.PENDING, None)]  # due for anyone
    await run(clock, ledger.resolve_on_stop("t1", StopReasonKind.BARGE_IN, stop_at))
    assert (await service.applied(row.key))[row.key]["reversed"]  # by the stop itself
    await assert_reversed(any_store, service, row.key)


async def test_a_retry_on_its_way_when_a_barge_in_calls_the_order_not_done_is_reversed(
    any_store, clock: VirtualClock, service: DemoService  # type: ignore[no-untyped-def]
) -> None:
    """The worker reconciles an order of a turn not stopped (yet): absent,
    so it retries it (the shop takes 1 s). Meanwhile a barge-in is
    resolved: its lookup finds nothing and calls the order "not done".
    Then the retry places it. The retry's answer is recorded like the
    call's own and judged by the stop: placed after the barge-in, it is
    reversed (before, its "done" write failed on the abandoned row and the
    order stood, the ledger saying "not done")."""
    stops = {"t1": TurnStop(None, None, False)}

    async def turn_stop(turn_id: str) -> TurnStop:
        return stops[turn_id]

    ledger = ledger_on(any_store, clock, service)
    ledger.turn_stop = turn_stop
    row = await unanswered_order(ledger)
    row = await ledger.move(row.key, IntentStatus.EFFECT_UNKNOWN, detail="the call failed")  # type: ignore[assignment]
    service.slow_s = 1.0
    service.inject("order", "slow")
    worker = ReconciliationWorker(ledger, turn_stop)
    retrying = asyncio.ensure_future(worker.reconcile(row, None))
    while row.key not in service.received:  # the retry is on its way
        await asyncio.sleep(0.001)
    stop_at = clock.now()
    stops["t1"] = TurnStop(StopReasonKind.BARGE_IN, stop_at, False)
    await ledger.resolve_on_stop("t1", StopReasonKind.BARGE_IN, stop_at)  # the shop answers at once: no time passes
    assert (await any_store.ledger_get(row.key)).status is IntentStatus.ABANDONED
    stops["t1"] = TurnStop(StopReasonKind.BARGE_IN, stop_at, True)
    await run(clock, retrying)
    await settle(any_store, clock, service, StopReasonKind.BARGE_IN)
    await assert_reversed(any_store, service, row.key)
    assert await service.times_applied(row.key) == 1
