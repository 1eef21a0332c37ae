"""The side-effect ledger, on both stores: intents by idempotency key with
compare-and-set, audit rows, the work queue; and the Ledger's rules for
stops, compensations and reconciliation against a real in-process external
system."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from clock import VirtualClock
from demo_shop.service import DemoService
from demo_shop.tools import demo_tools
from turn.intents import Intent, IntentKind, IntentStatus, LookupAnswer, compensation_key, effect_key
from turn.ledger import MAX_ATTEMPTS, Ledger
from turn.models import StopReasonKind
from turn.reconciliation import ReconciliationWorker
from turn.stop_policy import TurnStop, effect_remains, policy_for
from turn.store import UnknownIntent

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def intent(turn: str = "t1", step: int = 1, **kw) -> Intent:  # type: ignore[no-untyped-def]
    return Intent(key=effect_key(turn, step), turn_id=turn, step=step, tool="create_order", created_at=T0, updated_at=T0, **kw)


# -- the store contract ------------------------------------------------------------


async def test_add_is_idempotent_by_key(any_store) -> None:  # type: ignore[no-untyped-def]
    first, created = await any_store.ledger_add(intent(args={"item": "tea"}))
    assert created and first.status is IntentStatus.PENDING
    again, created = await any_store.ledger_add(intent(args={"item": "other"}))
    assert not created and again.args == {"item": "tea"}  # the first row stands
    assert await any_store.ledger_get("t1:1") == first
    with pytest.raises(UnknownIntent):
        await any_store.ledger_get("t1:99")


async def test_replace_is_compare_and_set(any_store) -> None:  # type: ignore[no-untyped-def]
    row, _ = await any_store.ledger_add(intent())
    done = row.model_copy(update={"status": IntentStatus.DONE, "version": 2})
    assert await any_store.ledger_replace(done)
    stale = row.model_copy(update={"status": IntentStatus.ABANDONED, "version": 2})
    assert not await any_store.ledger_replace(stale)  # written from an old read: refused
    assert (await any_store.ledger_get(row.key)).status is IntentStatus.DONE
    with pytest.raises(UnknownIntent):
        await any_store.ledger_replace(intent(step=7).model_copy(update={"version": 2}))


async def test_concurrent_writers_one_wins(any_store) -> None:  # type: ignore[no-untyped-def]
    row, _ = await any_store.ledger_add(intent())
    tries = [row.model_copy(update={"status": s, "version": 2}) for s in (IntentStatus.DONE, IntentStatus.ABANDONED) * 10]
    results = await asyncio.gather(*(any_store.ledger_replace(t) for t in tries))
    assert results.count(True) == 1


async def test_list_due_and_open_count(any_store) -> None:  # type: ignore[no-untyped-def]
    await any_store.ledger_add(intent("a", 1))
    await any_store.ledger_add(intent("a", 2, status=IntentStatus.DONE))
    later = intent("b", 1, status=IntentStatus.EFFECT_UNKNOWN, next_attempt_at=T0 + timedelta(seconds=60))
    await any_store.ledger_add(later)
    assert [i.key for i in await any_store.ledger_list("a")] == ["a:1", "a:2"]
    assert await any_store.ledger_open_count() == 2
    assert [i.key for i in await any_store.ledger_due(T0)] == ["a:1"]
    assert {i.key for i in await any_store.ledger_due(T0 + timedelta(seconds=61))} == {"a:1", "b:1"}
    done = (await any_store.ledger_get("a:1")).model_copy(update={"status": IntentStatus.DONE, "version": 2})
    await any_store.ledger_replace(done)
    assert await any_store.ledger_open_count() == 1


async def test_audit_rows(any_store) -> None:  # type: ignore[no-untyped-def]
    from turn.intents import AuditRow

    await any_store.audit_add(AuditRow(key="t1:1", at=T0, action="intent", detail="x"))
    await any_store.audit_add(AuditRow(key="t1:1", at=T0, action="done"))
    assert [r.action for r in await any_store.audit_list("t1:1")] == ["intent", "done"]
    assert await any_store.audit_list("t1:2") == []


async def test_work_queue_hands_each_item_out_once(any_store) -> None:  # type: ignore[no-untyped-def]
    for i in range(5):
        await any_store.queue_push("q", {"turn_id": "t", "key": f"k{i}"})
    a = await any_store.queue_claim("q", "w1", 3)
    b = await any_store.queue_claim("q", "w2", 10)
    assert [x["key"] for _, x in a] == ["k0", "k1", "k2"] and [x["key"] for _, x in b] == ["k3", "k4"]
    assert await any_store.queue_claim("q", "w3", 10) == []
    assert await any_store.queue_pending("q") == 5
    for item_id, _ in a + b:
        await any_store.queue_ack("q", item_id)
    assert await any_store.queue_pending("q") == 0


# -- the rules -----------------------------------------------------------------------


@pytest.fixture
async def service(clock: VirtualClock) -> AsyncIterator[DemoService]:
    s = DemoService(clock, latency_s=0.0)
    yield s
    await s.aclose()


@pytest.fixture
def ledger(store, clock: VirtualClock, service: DemoService) -> Ledger:  # type: ignore[no-untyped-def]
    tools = demo_tools(clock, service, store)
    return Ledger(store, clock, handlers=tools.get)


#: real seconds with nothing but bounds waiting on the clock before ``run``
#: lets the earliest bound fire (the code waits on something only time ends)
STUCK_S = 2.0


async def run(clock: VirtualClock, coro):  # type: ignore[no-untyped-def]
    """Await ``coro`` on virtual time in which real I/O (the store, the
    shop's database thread) takes none: the clock moves only when the code
    waits on time itself (a slow shop, a backoff), straight to that wait's
    end, firing any bound due on the way. A bound (``timeout_after``) thus
    never fires because the machine is loaded (before, time moved 0.05 s
    per real ms, so a slow store write looked like a slow shop: CI failed
    on it). Only when nothing but bounds has waited for ``STUCK_S`` real
    seconds does the earliest bound fire."""
    task = asyncio.ensure_future(coro)
    idle_since = asyncio.get_running_loop().time()
    while not task.done():
        await asyncio.sleep(0.001)
        if task.done():
            break
        due = clock.next_wake(besides_alarms=True)
        now = asyncio.get_running_loop().time()
        if due is None and now - idle_since >= STUCK_S:
            due = clock.next_wake()
        if due is not None:
            await clock.advance(max(0.0, due - clock.monotonic()))
            idle_since = now
    return task.result()


def test_policies_differ_by_reason() -> None:
    cancel, shutdown = policy_for(StopReasonKind.USER_CANCEL), policy_for(StopReasonKind.WORKER_SHUTDOWN)
    # a stop after a step committed is a no-op for that step; what it cut off is reversed
    assert not cancel.compensate_done and cancel.compensate_in_flight and not cancel.retry_absent
    assert policy_for(StopReasonKind.SAFETY_ABORT).compensate_done  # "should never have been taken"
    assert shutdown.retry_absent and not shutdown.compensate_done and not shutdown.compensate_in_flight
    assert not policy_for(StopReasonKind.SAFETY_ABORT).new_effects
    barge = policy_for(StopReasonKind.BARGE_IN)  # "I want to speak now", not "undo"
    assert not barge.compensate_done and barge.compensate_in_flight


async def test_a_safety_abort_compensates_a_done_order(ledger: Ledger, service: DemoService, clock: VirtualClock) -> None:
    row = await ledger.intent("t1", 1, "create_order", {"item": "tea"}, "compensate")
    await service.apply("order", row.key, {"item": "tea"})
    await ledger.move(row.key, IntentStatus.DONE)
    stop_at = clock.now()
    remains = await run(clock, ledger.resolve_on_stop("t1", StopReasonKind.SAFETY_ABORT, stop_at))
    assert not remains
    rows = {i.key: i for i in await ledger.store.ledger_list("t1")}
    assert rows[row.key].status is IntentStatus.COMPENSATED
    assert rows[compensation_key(row.key)].status is IntentStatus.DONE
    assert (await service.applied())[row.key]["reversed"]
    actions = [a.action for a in await ledger.store.audit_list(row.key)]
    assert actions[0] == "intent" and "compensated" in actions


async def test_a_failing_compensation_never_blocks_and_never_disappears(
    ledger: Ledger, service: DemoService, clock: VirtualClock
) -> None:
    row = await ledger.intent("t1", 1, "create_order", {}, "compensate")
    await service.apply("order", row.key, {})
    await ledger.move(row.key, IntentStatus.DONE)
    service.inject("reverse", *["fail_before"] * (MAX_ATTEMPTS + 2))
    remains = await run(clock, ledger.resolve_on_stop("t1", StopReasonKind.SAFETY_ABORT, clock.now()))
    assert remains  # the order stands for now: RECONCILE_REQUIRED
    job = await ledger.store.ledger_get(compensation_key(row.key))
    assert job.status is IntentStatus.RETRYING and job.attempts == 1 and job.next_attempt_at is not None
    worker = ReconciliationWorker(ledger, _kind(StopReasonKind.SAFETY_ABORT))
    for _ in range(MAX_ATTEMPTS + 2):
        await clock.advance(400)
        await run(clock, worker.run_once())
    job = await ledger.store.ledger_get(compensation_key(row.key))
    assert job.status is IntentStatus.HUMAN_REQUIRED and job.attempts == MAX_ATTEMPTS
    assert len(await ledger.store.audit_list(job.key)) >= MAX_ATTEMPTS


async def test_a_compensation_that_recovers_is_done(ledger: Ledger, service: DemoService, clock: VirtualClock) -> None:
    row = await ledger.intent("t1", 1, "create_order", {}, "compensate")
    await service.apply("order", row.key, {})
    await ledger.move(row.key, IntentStatus.DONE)
    service.inject("reverse", "fail_before")
    await run(clock, ledger.resolve_on_stop("t1", StopReasonKind.SAFETY_ABORT, clock.now()))
    await clock.advance(5)
    await run(clock, ReconciliationWorker(ledger, _kind(StopReasonKind.SAFETY_ABORT)).run_once())
    assert (await ledger.store.ledger_get(row.key)).status is IntentStatus.COMPENSATED


@pytest.mark.parametrize(
    "kind, applied, answer, expected",
    [
        (StopReasonKind.USER_CANCEL, True, None, IntentStatus.COMPENSATED),  # present: done, then reversed
        (StopReasonKind.USER_CANCEL, False, None, IntentStatus.ABANDONED),  # absent: no retry after a cancel
        (StopReasonKind.WORKER_SHUTDOWN, False, None, IntentStatus.DONE),  # absent: retried with the same key
        (StopReasonKind.WORKER_SHUTDOWN, True, None, IntentStatus.DONE),  # present: kept
        (StopReasonKind.SAFETY_ABORT, False, None, IntentStatus.ABANDONED),  # no new effect, ever
        (StopReasonKind.WORKER_SHUTDOWN, False, "lookup_unknown", IntentStatus.EFFECT_UNKNOWN),  # asks again later
    ],
)
async def test_reconciliation_by_lookup(
    ledger: Ledger, service: DemoService, clock: VirtualClock, kind, applied, answer, expected  # type: ignore[no-untyped-def]
) -> None:
    row = await ledger.intent("t1", 1, "charge_payment" if kind is not StopReasonKind.USER_CANCEL else "create_order", {}, "x")
    tool = row.tool
    effect = "compensate" if tool == "create_order" else "complete"
    row = await ledger.store.ledger_get(row.key)
    await ledger.store.ledger_replace(row.model_copy(update={"effect": effect, "status": IntentStatus.EFFECT_UNKNOWN, "version": 2}))
    if applied:
        await service.apply("order" if tool == "create_order" else "payment", row.key, {})
    if answer:
        service.inject("lookup", answer)
    worker = ReconciliationWorker(ledger, _kind(kind))
    await run(clock, worker.run_once())
    after = await ledger.store.ledger_get(row.key)
    assert after.status is expected
    assert await service.times_applied(row.key) <= 1
    if expected is IntentStatus.EFFECT_UNKNOWN:
        assert after.attempts == 1 and after.next_attempt_at is not None


async def test_unknown_forever_becomes_human_required(ledger: Ledger, service: DemoService, clock: VirtualClock) -> None:
    row = await ledger.intent("t1", 1, "charge_payment", {}, "complete")
    await ledger.move(row.key, IntentStatus.EFFECT_UNKNOWN)
    service.inject("lookup", *["lookup_unknown"] * 20)
    worker = ReconciliationWorker(ledger, _kind(StopReasonKind.USER_CANCEL))
    for _ in range(MAX_ATTEMPTS + 1):
        await run(clock, worker.run_once())
        await clock.advance(400)
    assert (await ledger.store.ledger_get(row.key)).status is IntentStatus.HUMAN_REQUIRED


def test_effect_remains_rules() -> None:
    stop = T0 + timedelta(seconds=10)
    cancel = policy_for(StopReasonKind.SAFETY_ABORT)  # reverses what committed, too
    before = T0 + timedelta(seconds=5)
    after = T0 + timedelta(seconds=15)
    paid_before = intent(step=1, effect="complete", status=IntentStatus.DONE, done_at=before)
    paid_after = intent(step=2, effect="complete", status=IntentStatus.DONE, done_at=after)
    order = intent(step=3, effect="compensate", status=IntentStatus.DONE, done_at=before)
    reversed_order = order.model_copy(update={"status": IntentStatus.COMPENSATED})
    read = intent(step=4, effect="none", status=IntentStatus.ABANDONED)
    unknown = intent(step=5, effect="complete", status=IntentStatus.EFFECT_UNKNOWN)
    assert not effect_remains([paid_before, reversed_order, read], stop, cancel)
    assert effect_remains([paid_after], stop, cancel)
    assert effect_remains([order], stop, cancel)  # its compensation has not succeeded
    assert not effect_remains([order], stop, policy_for(StopReasonKind.WORKER_SHUTDOWN))
    assert not effect_remains([order], stop, policy_for(StopReasonKind.BARGE_IN))  # kept: nothing after the stop
    assert not effect_remains([order], stop, policy_for(StopReasonKind.USER_CANCEL))  # a committed step: kept
    order_after = order.model_copy(update={"done_at": after})
    assert effect_remains([order_after], stop, policy_for(StopReasonKind.BARGE_IN))  # in flight: not reversed yet
    assert effect_remains([unknown], stop, cancel)
    job = intent(step=6, kind=IntentKind.COMPENSATION, status=IntentStatus.RETRYING)
    assert not effect_remains([reversed_order, job], stop, cancel)


def _kind(kind: StopReasonKind):  # type: ignore[no-untyped-def]
    async def get(_turn_id: str) -> TurnStop:
        return TurnStop(kind, None, True)

    return get


def test_lookup_answers_are_a_closed_set() -> None:
    assert {a.value for a in LookupAnswer} == {"present", "absent", "unknown"}
