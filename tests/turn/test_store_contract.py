"""The store contract: every TurnStore implementation (SQLite, Redis) passes
the same suite."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from turn.models import Budget, EventRecord, InstanceInfo, Session, Spent, StopReason, StopReasonKind, Turn, TurnKind, TurnStatus, Usage
from turn.states import Outcome
from turn.store import (
    DuplicateSession,
    DuplicateTurn,
    IdempotencyConflict,
    LeaseLost,
    StopAnswer,
    UnknownSession,
    UnknownTurn,
)

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def new_turn(session: str = "s1", gen: int = 1, **kw: Any) -> Turn:
    kw.setdefault("created_at", NOW)
    kw.setdefault("updated_at", NOW)
    return Turn(session_id=session, generation=gen, **kw)


def reason(kind: StopReasonKind = StopReasonKind.BARGE_IN, rid: str = "r1") -> StopReason:
    return StopReason(kind=kind, initiator="test", at=NOW, request_id=rid)


async def running(store, **kw: Any) -> Turn:
    t = await store.create(new_turn(**kw))
    return (await store.transition(t.id, TurnStatus.RUNNING, at=NOW)).turn


# -- turns ---------------------------------------------------------------------


async def test_create_get_roundtrip(any_store) -> None:
    t = new_turn(
        tenant_id="acme", kind=TurnKind.TEXT, transcript="", deadline_at=NOW + timedelta(seconds=30),
        budget=Budget(cents=12.5, tokens=4000), spent=Spent(cents=0.25, tokens=10), usage=Usage(prompt_tokens=3),
    )
    await any_store.create(t)
    got = await any_store.get(t.id)
    assert got == t
    assert got.transcript == ""  # empty is not absent


async def test_unknown_and_duplicate(any_store) -> None:
    with pytest.raises(UnknownTurn):
        await any_store.get("nope")
    with pytest.raises(UnknownTurn):
        await any_store.transition("nope", TurnStatus.RUNNING, at=NOW)
    with pytest.raises(UnknownTurn):
        await any_store.update("nope", at=NOW, reply="x")
    with pytest.raises(UnknownTurn):
        await any_store.request_stop("nope", "r", reason(), at=NOW)
    t = await any_store.create(new_turn())
    with pytest.raises(DuplicateTurn):
        await any_store.create(t)


async def test_update_fields(any_store) -> None:
    t = await any_store.create(new_turn())
    later = NOW + timedelta(seconds=1)
    got = await any_store.update(
        t.id, at=later, transcript="hi", reply="hello", step_count=3, spent=Spent(cents=1.5, tokens=7),
        lease_owner="w1", heartbeat_at=later,
    )
    assert (got.transcript, got.reply, got.step_count, got.lease_owner) == ("hi", "hello", 3, "w1")
    assert got.spent == Spent(cents=1.5, tokens=7) and got.heartbeat_at == later and got.updated_at == later
    got = await any_store.update(t.id, at=later, lease_owner=None)
    assert got.lease_owner is None
    with pytest.raises(ValueError):
        await any_store.update(t.id, at=NOW, status="COMPLETED")


async def test_heard_and_unheard_reply_and_merge_are_kept_apart(any_store) -> None:
    """What was heard, what was generated but not heard (audit) and the
    turn a continuation merged it into: each its own field, as stored."""
    t = await any_store.create(new_turn())
    later = NOW + timedelta(seconds=1)
    await any_store.update(t.id, at=later, reply="One, two,", reply_unheard="three, four.", merged_into="later-turn")
    got = await any_store.get(t.id)
    assert (got.reply, got.reply_unheard, got.merged_into) == ("One, two,", "three, four.", "later-turn")
    [listed] = await any_store.list_session(t.session_id)
    assert (listed.reply_unheard, listed.merged_into) == ("three, four.", "later-turn")


async def test_illegal_transition_is_a_conflict(any_store) -> None:
    t = await any_store.create(new_turn())
    res = await any_store.transition(t.id, TurnStatus.CANCEL_REQUESTED, at=NOW, stop_reason=reason())
    assert res.outcome is Outcome.CONFLICT and res.previous is TurnStatus.QUEUED
    got = await any_store.get(t.id)
    assert got.status is TurnStatus.QUEUED and got.stop_reason is None


async def test_terminal_is_final_and_reports_winner(any_store) -> None:
    t = await running(any_store)
    later = NOW + timedelta(seconds=2)
    done = await any_store.transition(t.id, TurnStatus.COMPLETED, at=later)
    assert done.applied and done.turn.terminal_at == later
    again = await any_store.transition(t.id, TurnStatus.FAILED, at=NOW, error="late")
    assert again.outcome is Outcome.ALREADY_TERMINAL and again.turn.status is TurnStatus.COMPLETED
    assert (await any_store.get(t.id)).error is None


async def test_complete_races_cancel_one_terminal(any_store) -> None:
    for _ in range(15):
        t = await running(any_store)
        results = await asyncio.gather(
            any_store.transition(t.id, TurnStatus.COMPLETED, at=NOW),
            any_store.request_stop(t.id, f"{t.id}-a", reason(rid="a"), at=NOW),
            any_store.transition(t.id, TurnStatus.FAILED, at=NOW, error="boom"),
            any_store.request_stop(t.id, f"{t.id}-b", reason(rid="b"), at=NOW),
        )
        final = await any_store.get(t.id)
        transitions = [r for r in results if hasattr(r, "outcome")]
        stops = [r for r in results if hasattr(r, "answer")]
        if final.status is TurnStatus.CANCEL_REQUESTED:
            assert not any(r.applied for r in transitions)
            assert sum(s.first for s in stops) == 1
        else:
            assert final.status in (TurnStatus.COMPLETED, TurnStatus.FAILED)
            assert sum(r.applied for r in transitions) == 1 and not any(s.first for s in stops)
            assert all(s.answer is StopAnswer.ALREADY_TERMINAL for s in stops)
        # and afterwards, completing a stopping turn is still one terminal state
        end = await asyncio.gather(
            any_store.transition(t.id, TurnStatus.CANCELLED, at=NOW),
            any_store.transition(t.id, TurnStatus.COMPLETED, at=NOW),
        )
        assert sum(r.applied for r in end) == (1 if final.status is TurnStatus.CANCEL_REQUESTED else 0)


async def test_first_stop_reason_wins(any_store) -> None:
    t = await running(any_store)
    await any_store.request_stop(t.id, "first", reason(rid="first"), at=NOW)
    res = await any_store.transition(
        t.id, TurnStatus.CANCELLED, at=NOW, stop_reason=reason(StopReasonKind.USER_CANCEL, rid="second")
    )
    assert res.applied and res.turn.stop_reason is not None
    assert (res.turn.stop_reason.request_id, res.turn.stop_reason.kind) == ("first", StopReasonKind.BARGE_IN)


# -- idempotent stop -----------------------------------------------------------


async def test_stop_answers_by_facts_and_repeats(any_store) -> None:
    t = await running(any_store)
    first = await any_store.request_stop(t.id, "k1", reason(rid="k1"), at=NOW, fingerprint="user_cancel")
    assert (first.answer, first.first, first.repeat) == (StopAnswer.ACCEPTED, True, False)
    assert first.turn.status is TurnStatus.CANCEL_REQUESTED
    again = await any_store.request_stop(t.id, "k1", reason(rid="k1"), at=NOW, fingerprint="user_cancel")
    assert (again.answer, again.first, again.repeat) == (StopAnswer.ACCEPTED, False, True)
    other = await any_store.request_stop(t.id, "k2", reason(rid="k2"), at=NOW)
    assert (other.answer, other.first) == (StopAnswer.ALREADY_STOPPING, False)
    await any_store.transition(t.id, TurnStatus.CANCELLED, at=NOW)
    late = await any_store.request_stop(t.id, "k3", reason(rid="k3"), at=NOW)
    assert late.answer is StopAnswer.ALREADY_TERMINAL
    # the first request still gets its own answer, not today's facts
    assert (await any_store.request_stop(t.id, "k1", reason(rid="k1"), at=NOW, fingerprint="user_cancel")).answer is StopAnswer.ACCEPTED


async def test_stop_reuse_with_other_parameters_is_refused(any_store) -> None:
    a = await running(any_store)
    b = await running(any_store)
    await any_store.request_stop(a.id, "key", reason(), at=NOW, fingerprint="user_cancel")
    with pytest.raises(IdempotencyConflict):
        await any_store.request_stop(a.id, "key", reason(), at=NOW, fingerprint="safety_abort")
    with pytest.raises(IdempotencyConflict):
        await any_store.request_stop(b.id, "key", reason(), at=NOW, fingerprint="user_cancel")
    assert (await any_store.get(b.id)).status is TurnStatus.RUNNING


async def test_stop_queued_and_reconcile(any_store) -> None:
    q = await any_store.create(new_turn())
    res = await any_store.request_stop(q.id, "q", reason(), at=NOW)
    assert (res.answer, res.first, res.turn.status) == (StopAnswer.ACCEPTED, True, TurnStatus.CANCELLED)
    r = await running(any_store)
    await any_store.request_stop(r.id, "r1", reason(), at=NOW)
    await any_store.transition(r.id, TurnStatus.RECONCILE_REQUIRED, at=NOW)
    assert (await any_store.request_stop(r.id, "r2", reason(), at=NOW)).answer is StopAnswer.RECONCILE_REQUIRED


async def test_hundred_concurrent_stops_one_effect(any_store) -> None:
    t = await running(any_store)
    ids = [f"req-{i % 7}" for i in range(100)]  # 7 distinct ids, repeated
    results = await asyncio.gather(*(any_store.request_stop(t.id, rid, reason(rid=rid), at=NOW) for rid in ids))
    assert sum(r.first for r in results) == 1
    by_id: dict[str, set[StopAnswer]] = {}
    for rid, r in zip(ids, results, strict=True):
        by_id.setdefault(rid, set()).add(r.answer)
    assert all(len(a) == 1 for a in by_id.values())  # each id: one answer
    assert sorted(a for s in by_id.values() for a in s).count(StopAnswer.ACCEPTED) == 1
    assert (await any_store.get(t.id)).status is TurnStatus.CANCEL_REQUESTED


# -- sessions, generations, listing --------------------------------------------


async def test_sessions_and_generations(any_store) -> None:
    s = await any_store.create_session(Session(id="sess", tenant_id="acme", kind=TurnKind.TEXT, created_at=NOW))
    assert await any_store.get_session("sess") == s
    with pytest.raises(DuplicateSession):
        await any_store.create_session(s)
    with pytest.raises(UnknownSession):
        await any_store.get_session("nope")
    with pytest.raises(UnknownSession):
        await any_store.next_generation("nope")
    gens = await asyncio.gather(*(any_store.next_generation("sess") for _ in range(20)))
    assert sorted(gens) == list(range(1, 21))
    assert (await any_store.get_session("sess")).generation == 20


async def test_list_session_and_open(any_store) -> None:
    ids = []
    for g in range(1, 4):
        ids.append((await any_store.create(new_turn("a", g, created_at=NOW + timedelta(seconds=g)))).id)
    other = await any_store.create(new_turn("b"))
    assert [t.id for t in await any_store.list_session("a")] == ids
    assert await any_store.list_session("zzz") == []
    await any_store.transition(ids[0], TurnStatus.RUNNING, at=NOW)
    await any_store.transition(ids[0], TurnStatus.COMPLETED, at=NOW)
    assert {t.id for t in await any_store.list_open()} == {ids[1], ids[2], other.id}


async def test_heartbeat_only_for_owner_and_open(any_store) -> None:
    a = await running(any_store)
    b = await running(any_store)
    c = await running(any_store)
    for t in (a, b):
        await any_store.update(t.id, at=NOW, lease_owner="w1", heartbeat_at=NOW)
    await any_store.update(c.id, at=NOW, lease_owner="w2", heartbeat_at=NOW)
    await any_store.transition(b.id, TurnStatus.COMPLETED, at=NOW)
    later = NOW + timedelta(seconds=5)
    assert await any_store.heartbeat("w1", [a.id, b.id, c.id], at=later) == 1
    assert (await any_store.get(a.id)).heartbeat_at == later
    assert (await any_store.get(c.id)).heartbeat_at == NOW
    assert await any_store.heartbeat("w1", [], at=later) == 0


async def test_take_over_is_one_compare_and_set_on_the_lease_seen_expired(any_store) -> None:
    a = await running(any_store)
    await any_store.update(a.id, at=NOW, lease_owner="dead", heartbeat_at=NOW)
    later = NOW + timedelta(seconds=9)
    seen = dict(expect_owner="dead", expect_heartbeat=NOW, at=later)
    results = await asyncio.gather(*(any_store.take_over(a.id, f"w{i}", **seen) for i in range(5)))
    assert sorted(results) == [False] * 4 + [True]  # one sweeper wins
    got = await any_store.get(a.id)
    assert got.lease_owner == f"w{results.index(True)}" and got.heartbeat_at == later and got.status is TurnStatus.RUNNING
    # a worker that was only slow beat meanwhile: it keeps its turn
    b = await running(any_store)
    await any_store.update(b.id, at=NOW, lease_owner="slow", heartbeat_at=NOW)
    await any_store.heartbeat("slow", [b.id], at=later)
    assert not await any_store.take_over(b.id, "w9", expect_owner="slow", expect_heartbeat=NOW, at=later)
    assert (await any_store.get(b.id)).lease_owner == "slow"
    # only a RUNNING turn is taken over
    c = await running(any_store)
    await any_store.update(c.id, at=NOW, lease_owner="dead", heartbeat_at=NOW)
    await any_store.transition(c.id, TurnStatus.COMPLETED, at=NOW)
    assert not await any_store.take_over(c.id, "w9", expect_owner="dead", expect_heartbeat=NOW, at=later)
    with pytest.raises(UnknownTurn):
        await any_store.take_over("nope", "w9", expect_owner="dead", expect_heartbeat=NOW, at=later)
    # a CANCEL_REQUESTED turn is stopped, never taken over; nor one leased to another owner with the same heartbeat
    d = await running(any_store)
    await any_store.update(d.id, at=NOW, lease_owner="dead", heartbeat_at=NOW)
    await any_store.request_stop(d.id, "r1", StopReason(kind=StopReasonKind.USER_CANCEL, initiator="user", at=NOW), at=NOW)
    assert not await any_store.take_over(d.id, "w9", expect_owner="dead", expect_heartbeat=NOW, at=later)
    e = await running(any_store)
    await any_store.update(e.id, at=NOW, lease_owner="alive", heartbeat_at=NOW)
    assert not await any_store.take_over(e.id, "w9", expect_owner="dead", expect_heartbeat=NOW, at=later)


async def test_an_update_fenced_on_the_lease_writes_nothing_once_it_was_taken_over(any_store) -> None:
    a = await running(any_store)
    await any_store.update(a.id, at=NOW, lease_owner="w1", heartbeat_at=NOW)
    later = NOW + timedelta(seconds=1)
    got = await any_store.update(a.id, at=later, fence_owner="w1", step_count=2)
    assert got.step_count == 2
    assert await any_store.take_over(a.id, "w2", expect_owner="w1", expect_heartbeat=NOW, at=later)
    with pytest.raises(LeaseLost) as lost:
        await any_store.update(a.id, at=later + timedelta(seconds=1), fence_owner="w1", step_count=9, reply="stale")
    assert lost.value.holder == "w2"
    got = await any_store.get(a.id)
    assert got.step_count == 2 and got.reply is None and got.lease_owner == "w2" and got.updated_at == later
    with pytest.raises(UnknownTurn):
        await any_store.update("nope", at=later, fence_owner="w1", step_count=1)


# -- event log -----------------------------------------------------------------


async def test_event_log_seq_replay_and_fence(any_store) -> None:
    await any_store.create_session(Session(id="s", created_at=NOW))
    with pytest.raises(UnknownSession):
        await any_store.append_event(EventRecord(session_id="nope", type="x", at=NOW))
    appended = await asyncio.gather(
        *(
            any_store.append_event(EventRecord(session_id="s", turn_id="t", generation=1, type="agent.delta", at=NOW, payload={"i": i}))
            for i in range(30)
        )
    )
    assert sorted(e.seq for e in appended) == list(range(1, 31))
    await any_store.mark_fenced("s", 5)
    fenced = await any_store.append_event(EventRecord(session_id="s", generation=0, type="agent.delta", at=NOW, fenced=True))
    everything = await any_store.read_events("s")
    assert [e.seq for e in everything] == list(range(1, 32))
    assert [e.seq for e in everything if e.fenced] == [5, fenced.seq]
    after = await any_store.read_events("s", after_seq=27)
    assert [e.seq for e in after] == [28, 29, 30, 31]
    assert after[0].payload == next(e.payload for e in appended if e.seq == 28)
    assert [e.seq for e in await any_store.read_events("s", after_seq=10, limit=3)] == [11, 12, 13]
    assert await any_store.read_events("s", after_seq=31) == []
    assert await any_store.read_events("unknown") == []


async def test_wait_events_wakes_on_append(any_store) -> None:
    await any_store.create_session(Session(id="w", created_at=NOW))
    assert not await any_store.wait_events("w", 0, 0.05)
    waiter = asyncio.create_task(any_store.wait_events("w", 0, 5))
    await asyncio.sleep(0.05)
    await any_store.append_event(EventRecord(session_id="w", type="x", at=NOW))
    assert await asyncio.wait_for(waiter, 3)
    assert await any_store.wait_events("w", 0, 0.05)  # already there: at once


async def test_secret_is_stable(any_store) -> None:
    a = await any_store.secret("resume")
    assert len(a) == 32 and await any_store.secret("resume") == a
    assert await any_store.secret("other") != a


async def test_instances_register_renew_expire_and_leave(any_store) -> None:
    def info(i: str, at: datetime, state: str = "serving", sessions: int = 0) -> InstanceInfo:
        return InstanceInfo(id=i, url=f"http://{i}:8080", state=state, voice_sessions=sessions, started_at=NOW,
                            heartbeat_at=at)  # type: ignore[arg-type]

    await any_store.instance_heartbeat(info("b", NOW), ttl_s=10)
    await any_store.instance_heartbeat(info("a", NOW), ttl_s=10)
    assert [i.id for i in await any_store.instance_list(NOW + timedelta(seconds=1))] == ["a", "b"]
    later = NOW + timedelta(seconds=8)
    await any_store.instance_heartbeat(info("a", later, "draining", 3), ttl_s=10)  # renewed, now draining
    [a] = await any_store.instance_list(NOW + timedelta(seconds=12))  # b stopped heartbeating: gone
    assert (a.id, a.state, a.voice_sessions, a.heartbeat_at) == ("a", "draining", 3, later)
    await any_store.instance_remove("a")
    assert await any_store.instance_list(NOW + timedelta(seconds=12)) == []
    await any_store.instance_remove("never-was")  # no error


async def test_closed_store_refuses(any_store) -> None:
    await any_store.close()
    with pytest.raises(RuntimeError):
        await any_store.get("x")
    await any_store.open()
    await any_store.open()  # idempotent


async def test_device_tokens_are_found_by_hash_until_revoked(any_store) -> None:
    await any_store.device_add("dev_a", "tenant_a", "h" * 64, NOW)
    await any_store.device_add("dev_b", "tenant_b", "k" * 64, NOW)
    assert await any_store.device_by_token("h" * 64) == ("dev_a", "tenant_a")
    assert await any_store.device_by_token("x" * 64) is None
    with pytest.raises(ValueError):
        await any_store.device_add("dev_a", "tenant_a", "z" * 64, NOW)  # the id is taken
    with pytest.raises(ValueError):
        await any_store.device_add("dev_c", "tenant_a", "h" * 64, NOW)  # the token is taken
    assert await any_store.device_by_token("z" * 64) is None  # the refused add left nothing
    assert not await any_store.device_revoke("dev_a", "tenant_b")  # not that tenant's device
    assert await any_store.device_by_token("h" * 64) == ("dev_a", "tenant_a")
    assert await any_store.device_revoke("dev_a", "tenant_a")
    assert not await any_store.device_revoke("dev_a", "tenant_a")  # once
    assert await any_store.device_by_token("h" * 64) is None
    assert await any_store.device_by_token("k" * 64) == ("dev_b", "tenant_b")


async def test_client_tokens_are_claimed_once_and_expire(any_store) -> None:
    """A grant is taken once (also by 20 concurrent claims: one wins), is
    gone after its expiry, and a refused start may put it back."""
    later = NOW + timedelta(seconds=60)
    await any_store.client_token_put("a" * 64, '{"t":"tenant_a"}', later, NOW)
    await any_store.client_token_put("b" * 64, '{"t":"tenant_b"}', NOW + timedelta(seconds=1), NOW)
    claims = await asyncio.gather(*(any_store.client_token_claim("a" * 64, NOW) for _ in range(20)))
    assert [c for c in claims if c is not None] == ['{"t":"tenant_a"}']
    assert await any_store.client_token_claim("a" * 64, NOW) is None
    await any_store.client_token_put("a" * 64, '{"t":"tenant_a"}', later, NOW)  # put back
    assert await any_store.client_token_claim("a" * 64, NOW + timedelta(seconds=59)) == '{"t":"tenant_a"}'
    assert await any_store.client_token_claim("b" * 64, NOW + timedelta(seconds=1)) is None  # expired
    assert await any_store.client_token_claim("c" * 64, NOW) is None  # never issued


async def test_a_claim_succeeds_once_until_it_expires(any_store) -> None:
    until = NOW + timedelta(seconds=300)
    results = await asyncio.gather(*(any_store.claim_once("call:CA1", until, NOW) for _ in range(20)))
    assert results.count(True) == 1
    assert not await any_store.claim_once("call:CA1", until, NOW + timedelta(seconds=299))
    assert await any_store.claim_once("call:CA2", until, NOW)

