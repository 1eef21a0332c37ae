"""The stop policy table (turn/stop_policy.py, README "Side effects: the
ledger"): every stop kind x tool class x stage, through the Ledger's own
stop resolution and the reconciliation worker, against the in-process
external system, on both stores. Each case checks what the ledger ends with,
whether the effect stands in the external system, and whether the turn is
RECONCILE_REQUIRED (an effect remains after the stop)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC

import pytest

from clock import VirtualClock
from demo_shop.service import DemoService
from demo_shop.tools import demo_handlers, demo_tools
from turn.intents import Intent, IntentKind, IntentStatus, compensation_key
from turn.ledger import Ledger
from turn.models import StopReasonKind
from turn.reconciliation import ReconciliationWorker
from turn.stop_policy import POLICIES, Stage, TurnStop, policy_for, stage_at_stop
from voice.history import tool_outcome_text

K = StopReasonKind
LIMITS = {K.DEADLINE_EXCEEDED, K.BUDGET_EXCEEDED, K.MAX_STEPS, K.LOOP_DETECTED}
#: reverse a compensable effect done before the stop (the turn should never have acted:
#: a safety abort, or a speculative turn taken back, which runs no effect before its
#: end of turn is confirmed; should one have run, it is reversed)
REVERSE_DONE = {K.SAFETY_ABORT, K.SPECULATION_WITHDRAWN}
#: reverse a compensable effect in flight at the stop (once it is known to have happened)
REVERSE_IN_FLIGHT = REVERSE_DONE | {K.USER_CANCEL, K.BARGE_IN} | LIMITS
#: retry an effect in flight found absent (same key)
RETRY_ABSENT = {K.WORKER_SHUTDOWN}

TOOL = {"none": "lookup_weather", "complete": "charge_payment", "compensate": "create_order"}
OP = {"complete": "payment", "compensate": "order"}
#: the stages a row can be in when the stop is resolved
VARIANTS = ("done_before", "confirmed_after", "in_flight_applied", "in_flight_absent", "not_started")


def expected(kind: StopReasonKind, effect: str, variant: str) -> tuple[IntentStatus, bool, bool]:
    """(final status, the effect stands in the external system, an effect
    remains after the stop): the README's table, row by row."""
    if variant == "not_started":
        return IntentStatus.ABANDONED, False, False  # nothing is sent after a known stop
    if effect == "none":  # a read: kept when done, abandoned when cut off
        done = variant in ("done_before", "confirmed_after")
        return (IntentStatus.DONE if done else IntentStatus.ABANDONED), False, False
    reverse = kind in (REVERSE_DONE if variant == "done_before" else REVERSE_IN_FLIGHT) and effect == "compensate"
    if variant == "done_before":
        return (IntentStatus.COMPENSATED, False, False) if reverse else (IntentStatus.DONE, True, False)
    if variant == "confirmed_after":  # e.g. a must-complete call that committed after the stop
        return (IntentStatus.COMPENSATED, False, False) if reverse else (IntentStatus.DONE, True, True)
    if variant == "in_flight_applied":  # cut off; the external system has it: looked up, present
        return (IntentStatus.COMPENSATED, False, False) if reverse else (IntentStatus.DONE, True, True)
    # in flight, never applied: looked up, absent
    if reverse:
        return IntentStatus.ABANDONED, False, False  # nothing to reverse: "not done"
    if kind in RETRY_ABSENT:
        return IntentStatus.DONE, True, True
    return IntentStatus.ABANDONED, False, True


@pytest.fixture
async def service(clock: VirtualClock) -> AsyncIterator[DemoService]:
    s = DemoService(clock, latency_s=0.0)
    yield s
    await s.aclose()


def test_every_stop_kind_has_a_policy() -> None:
    assert set(POLICIES) == set(StopReasonKind) | {None}
    for kind in StopReasonKind:
        p = policy_for(kind)
        assert p.compensate_done == (kind in REVERSE_DONE)
        assert p.compensate_in_flight == (kind in REVERSE_IN_FLIGHT)
        assert p.retry_absent == (kind in RETRY_ABSENT)
        assert p.finish_queued == (kind is K.WORKER_SHUTDOWN)
        assert p.new_effects == (kind not in REVERSE_DONE)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("effect", ["none", "complete", "compensate"])
@pytest.mark.parametrize("kind", list(StopReasonKind))
async def test_the_policy_table(any_store, clock: VirtualClock, service: DemoService, kind, effect, variant) -> None:  # type: ignore[no-untyped-def]
    tools = demo_tools(clock, service, any_store)
    ledger = Ledger(any_store, clock, handlers=demo_handlers(lambda: tools, service))
    row = await ledger.intent("t1", 1, TOOL[effect], {}, effect)
    apply = (lambda: service.apply(OP[effect], row.key, {})) if effect != "none" else None
    if variant == "done_before":
        if apply:
            await apply()
        await ledger.move(row.key, IntentStatus.DONE, result="ok")
        await clock.advance(1)
        stop_at = clock.now()
    elif variant == "confirmed_after":
        stop_at = clock.now()
        await clock.advance(1)
        if apply:
            await apply()
        await ledger.move(row.key, IntentStatus.DONE, result="ok")
    elif variant == "in_flight_applied":
        if apply:
            await apply()  # the external system wrote it; the answer never came back
        stop_at = clock.now()
    elif variant == "in_flight_absent":
        stop_at = clock.now()
    else:
        await ledger.move(row.key, IntentStatus.ABANDONED, detail="stopped before it was sent")
        stop_at = clock.now()

    # awaited without moving the clock: the external system answers at once
    # (latency 0), so a reversal always fits its bound however slow the
    # machine (moving virtual time while the store works made a loaded
    # machine look like a slow external system)
    remains = await ledger.resolve_on_stop("t1", kind, stop_at)

    async def stop_of(_turn_id: str) -> TurnStop:
        return TurnStop(kind, stop_at, True)

    worker = ReconciliationWorker(ledger, stop_of)
    for _ in range(4):
        await worker.run_once()
        await clock.advance(5)
    status, stands, remain = expected(kind, effect, variant)
    final = await any_store.ledger_get(row.key)
    assert (final.status, remains) == (status, remain), await any_store.audit_list(row.key)
    applied = await service.applied(row.key)
    assert bool(applied) and not applied.get(row.key, {}).get("reversed", False) if stands else not any(
        not e["reversed"] for e in applied.values()
    )
    assert await service.repeats(row.key) == 0  # never a blind retry
    rows = await any_store.ledger_list("t1")
    jobs = [r for r in rows if r.kind is IntentKind.COMPENSATION]
    if status is IntentStatus.COMPENSATED:
        assert [j.status for j in jobs] == [IntentStatus.DONE]
        assert tool_outcome_text(final) == "cancelled: it was done, then reversed"
    elif variant == "in_flight_absent" and effect == "compensate":
        assert jobs == []  # looked up first: nothing to reverse, no reversal run
    if status is IntentStatus.ABANDONED and effect != "none":
        assert tool_outcome_text(final) == "cancelled: it was not done"


def test_stages() -> None:
    from datetime import datetime, timedelta

    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def row(status: IntentStatus, done_at: datetime | None = None) -> Intent:
        return Intent(key="t:1", turn_id="t", step=1, tool="x", effect="compensate", status=status,
                      created_at=t0, updated_at=t0, done_at=done_at)

    stop = t0 + timedelta(seconds=5)
    assert stage_at_stop(row(IntentStatus.DONE, t0), stop) is Stage.DONE_BEFORE_STOP
    assert stage_at_stop(row(IntentStatus.DONE, stop), stop) is Stage.DONE_BEFORE_STOP  # done_at <= stop_at
    assert stage_at_stop(row(IntentStatus.DONE, stop + timedelta(milliseconds=1)), stop) is Stage.IN_FLIGHT
    assert stage_at_stop(row(IntentStatus.COMPENSATED, t0), stop) is Stage.DONE_BEFORE_STOP  # keeps its effect's stage
    for s in (IntentStatus.PENDING, IntentStatus.EFFECT_UNKNOWN, IntentStatus.HUMAN_REQUIRED):
        assert stage_at_stop(row(s), stop) is Stage.IN_FLIGHT
    assert stage_at_stop(row(IntentStatus.ABANDONED), stop) is Stage.NOT_STARTED
    barge = policy_for(K.BARGE_IN)
    assert not barge.compensates(row(IntentStatus.DONE, t0), stop)
    assert barge.compensates(row(IntentStatus.EFFECT_UNKNOWN), stop)
    assert not barge.compensates(row(IntentStatus.DONE, t0).model_copy(update={"effect": "complete"}), stop)


async def test_a_compensation_that_finds_nothing_abandons_the_effect(store, clock: VirtualClock, service: DemoService) -> None:  # type: ignore[no-untyped-def]
    """The lookup could not say, so the compensation runs anyway; the shop
    answers that it never placed the order: "not done", not "reversed"."""
    tools = demo_tools(clock, service, store)
    ledger = Ledger(store, clock, handlers=demo_handlers(lambda: tools, service))
    row = await ledger.intent("t1", 1, "create_order", {}, "compensate")
    service.inject("lookup", "lookup_unknown")
    assert not await ledger.resolve_on_stop("t1", K.USER_CANCEL, clock.now())
    final = await store.ledger_get(row.key)
    assert final.status is IntentStatus.ABANDONED and "nothing to reverse" in [a.detail for a in await store.audit_list(row.key)][-1]
    assert (await store.ledger_get(compensation_key(row.key))).status is IntentStatus.DONE
    assert await service.applied("t1") == {}
