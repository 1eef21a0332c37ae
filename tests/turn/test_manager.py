"""TurnManager over the SQLite store, on a virtual clock."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from clock import SystemClock, VirtualClock
from turn.lease import TakeOver
from turn.manager import TurnManager
from turn.models import StopReason, StopReasonKind, Turn, TurnKind, TurnStatus
from turn.sqlite_store import SqliteStore
from turn.stopped import TurnStopped
from turn.store import IdempotencyConflict, LeaseLost, StopAnswer, StoreUnavailable, UnknownSession, UnknownTurn, WrongSessionKind


def stop(clock, kind: StopReasonKind = StopReasonKind.BARGE_IN) -> StopReason:
    return StopReason(kind=kind, initiator="test", at=clock.now())


@pytest.fixture
async def manager(store: SqliteStore, clock: VirtualClock) -> TurnManager:
    m = TurnManager(store, clock, owner="me")
    await m.ensure_session("s")
    return m


async def test_open_turn_runs_leased_and_notifies(manager: TurnManager, clock: VirtualClock) -> None:
    seen: list[TurnStatus] = []
    manager.subscribe("s", lambda t: seen.append(t.status))
    turn = await manager.open_turn("s", deadline_s=30)
    assert turn.status is TurnStatus.RUNNING and turn.generation == 1
    assert turn.lease_owner == "me" and turn.heartbeat_at == clock.now()
    assert turn.deadline_at == clock.now() + timedelta(seconds=30)
    assert seen == [TurnStatus.QUEUED, TurnStatus.RUNNING]
    assert (await manager.open_turn("s")).generation == 2  # from the store's counter


async def test_generation_given_by_a_fence_is_kept(manager: TurnManager) -> None:
    turn = await manager.open_turn("s", 1, turn_id="abc123")
    assert (turn.id, turn.generation) == ("abc123", 1)


async def test_unknown_session(manager: TurnManager) -> None:
    with pytest.raises(UnknownSession):
        await manager.open_turn("nope")


async def test_session_belongs_to_its_tenant(manager: TurnManager) -> None:
    await manager.ensure_session("t1", tenant_id="acme", kind=TurnKind.TEXT)
    assert (await manager.ensure_session("t1", tenant_id="acme", kind=TurnKind.TEXT)).tenant_id == "acme"
    with pytest.raises(PermissionError):
        await manager.ensure_session("t1", tenant_id="other", kind=TurnKind.TEXT)
    with pytest.raises(PermissionError):  # the tenant first: another's session is unknown, whatever its kind
        await manager.ensure_session("t1", tenant_id="other")
    with pytest.raises(WrongSessionKind, match="is a text session, not a voice one"):
        await manager.ensure_session("t1", tenant_id="acme")


async def test_stop_goes_through_cancel_requested(manager: TurnManager, clock: VirtualClock) -> None:
    seen: list[str] = []
    manager.subscribe("s", lambda t: seen.append(t.status.label))
    turn = await manager.open_turn("s")
    event = manager.stop_event(turn.id)
    first = await manager.request_stop(turn.id, stop(clock))
    assert (first.answer, first.first) == (StopAnswer.ACCEPTED, True)
    assert first.turn.status is TurnStatus.CANCEL_REQUESTED and event.is_set()
    again = await manager.request_stop(turn.id, stop(clock, StopReasonKind.USER_CANCEL))
    assert (again.answer, again.first) == (StopAnswer.ALREADY_STOPPING, False)
    await clock.advance(0.1)
    res = await manager.confirm_stopped(turn.id)
    assert res.applied and res.turn.status is TurnStatus.CANCELLED
    assert res.turn.stop_reason is not None and res.turn.stop_reason.kind is StopReasonKind.BARGE_IN
    assert res.turn.terminal_at == clock.now()
    late = await manager.request_stop(turn.id, stop(clock))
    assert late.answer is StopAnswer.ALREADY_TERMINAL
    assert seen == ["queued", "running", "stopping", "cancelled"]


async def test_repeated_request_id_one_effect(manager: TurnManager, clock: VirtualClock) -> None:
    turn = await manager.open_turn("s")
    published: list[str] = []
    original = manager.signals.publish

    async def counting(turn_id: str) -> None:
        published.append(turn_id)
        await original(turn_id)

    manager.signals.publish = counting  # type: ignore[method-assign]
    reason = stop(clock, StopReasonKind.USER_CANCEL)
    results = await asyncio.gather(
        *(manager.request_stop(turn.id, reason, request_id=f"k{i % 3}", fingerprint="u") for i in range(30))
    )
    assert published == [turn.id]  # the stop's effect happened once
    assert sum(r.first for r in results) == 1
    with pytest.raises(IdempotencyConflict):
        await manager.request_stop(turn.id, reason, request_id="k0", fingerprint="other")


async def test_completed_turn_is_not_cancelled(manager: TurnManager, clock: VirtualClock) -> None:
    turn = await manager.open_turn("s")
    await manager.complete(turn.id)
    res = await manager.request_stop(turn.id, stop(clock))
    assert res.answer is StopAnswer.ALREADY_TERMINAL and res.turn.status is TurnStatus.COMPLETED
    assert not (await manager.confirm_stopped(turn.id)).applied


async def test_committed_final_step_completes_after_stop(manager: TurnManager, clock: VirtualClock) -> None:
    turn = await manager.open_turn("s")
    await manager.request_stop(turn.id, stop(clock))
    res = await manager.complete(turn.id)
    assert res.applied and res.turn.status is TurnStatus.COMPLETED


async def test_queued_turn_is_cancelled_at_once(manager: TurnManager, clock: VirtualClock) -> None:
    turn = await manager.open_turn("s", start=False)
    assert turn.status is TurnStatus.QUEUED and turn.lease_owner is None
    res = await manager.request_stop(turn.id, stop(clock, StopReasonKind.TRANSPORT_DISCONNECTED))
    assert res.answer is StopAnswer.ACCEPTED and res.turn.status is TurnStatus.CANCELLED


async def test_fail_records_error(manager: TurnManager) -> None:
    turn = await manager.open_turn("s")
    res = await manager.fail(turn.id, "no_speech_recognized")
    assert res.turn.status is TurnStatus.FAILED and res.turn.error == "no_speech_recognized"


async def test_unknown_turn(manager: TurnManager, clock: VirtualClock) -> None:
    with pytest.raises(UnknownTurn):
        await manager.request_stop("missing", stop(clock))


async def test_broken_listener_does_not_break_turns(manager: TurnManager) -> None:
    def boom(_: Turn) -> None:
        raise RuntimeError("listener bug")

    unsubscribe = manager.subscribe("s", boom)
    turn = await manager.open_turn("s")
    assert turn.status is TurnStatus.RUNNING
    unsubscribe()
    unsubscribe()  # idempotent


async def test_record_text(manager: TurnManager) -> None:
    turn = await manager.open_turn("s")
    got = await manager.record(turn.id, transcript="hello", reply="hi there")
    assert (got.transcript, got.reply) == ("hello", "hi there")


async def test_checkpoint_sees_a_missed_signal_within_staleness(store: SqliteStore, clock: VirtualClock) -> None:
    """Another instance stopped the turn and the signal never came: the next
    checkpoint after the cache goes stale still sees the flag in the store."""
    worker = TurnManager(store, clock, owner="worker", flag_staleness_s=0.1)
    other = TurnManager(store, clock, owner="api")  # separate signals: no message reaches the worker
    await worker.ensure_session("s")
    turn = await worker.open_turn("s")
    await worker.checkpoint(turn.id, "before_model")  # reads the store, caches "running"
    await other.request_stop(turn.id, stop(clock, StopReasonKind.USER_CANCEL))
    await worker.checkpoint(turn.id, "after_model")  # cached read is fresh: not seen yet
    await clock.advance(0.11)
    with pytest.raises(TurnStopped):
        await worker.checkpoint(turn.id, "before_model")
    assert worker.stop_event(turn.id).is_set()


async def test_leases_renew_and_expire(store: SqliteStore, clock: VirtualClock) -> None:
    m = TurnManager(store, clock, owner="w1", lease_ttl_s=3)
    await m.ensure_session("s")
    turn = await m.open_turn("s")
    await clock.advance(2)
    assert await m.renew_leases() == 1
    assert not m.lease_expired(await m.get(turn.id))
    await clock.advance(3.5)
    assert m.lease_expired(await m.get(turn.id))  # no heartbeat for 3.5 s > 3 s


async def test_recover_abandoned(store: SqliteStore, clock: VirtualClock) -> None:
    dead = TurnManager(store, clock, owner="dead", lease_ttl_s=5)
    await dead.ensure_session("s")
    left = await dead.open_turn("s")
    queued = await dead.open_turn("s", start=False)
    alive = TurnManager(store, clock, owner="alive", lease_ttl_s=5)
    mine = await alive.open_turn("s")
    reason = StopReason(kind=StopReasonKind.WORKER_SHUTDOWN, initiator="server", at=clock.now(), detail="recovered")
    # leases still fresh: with many instances nothing is taken over yet
    assert await alive.recover_abandoned(reason, all_open=False) == []
    await clock.advance(6)
    await alive.renew_leases()
    got = await alive.recover_abandoned(reason, all_open=False)
    assert [t.id for t in got] == [left.id, queued.id]
    assert all(t.status is TurnStatus.CANCELLED for t in got)
    assert (await alive.get(mine.id)).status is TurnStatus.RUNNING  # its own turn is left alone


async def test_abandoned_running_turns_are_offered_for_take_over(store: SqliteStore, clock: VirtualClock) -> None:
    """With a take-over hook (the text turns'), an abandoned RUNNING turn is
    offered to it first: taken, or won by another worker, it is left alone;
    not resumable (or the hook failed), it is stopped as before. A QUEUED
    one never started and is cancelled without an offer."""
    dead = TurnManager(store, clock, owner="dead", lease_ttl_s=5)
    await dead.ensure_session("s")
    taken, lost, voice, broken = [await dead.open_turn("s") for _ in range(4)]
    queued = await dead.open_turn("s", start=False)
    alive = TurnManager(store, clock, owner="alive", lease_ttl_s=5)
    answers = {taken.id: TakeOver.TAKEN, lost.id: TakeOver.LOST, voice.id: TakeOver.NOT_RESUMABLE}
    offered: list[str] = []

    async def take_over(turn: Turn) -> TakeOver:
        offered.append(turn.id)
        if turn.id == broken.id:
            raise RuntimeError("the hook broke")
        return answers[turn.id]

    alive.take_over_abandoned = take_over
    await clock.advance(6)
    reason = StopReason(kind=StopReasonKind.WORKER_SHUTDOWN, initiator="server", at=clock.now(), detail="recovered")
    got = await alive.recover_abandoned(reason, all_open=False)
    assert sorted(offered) == sorted([taken.id, lost.id, voice.id, broken.id])
    assert sorted(t.id for t in got) == sorted([voice.id, broken.id, queued.id])
    assert all(t.status is TurnStatus.CANCELLED for t in got)
    for t in (taken, lost):
        assert (await alive.get(t.id)).status is TurnStatus.RUNNING


async def test_a_worker_that_finds_its_turn_taken_over_ends_its_work_without_writes(store: SqliteStore, clock: VirtualClock) -> None:
    slow = TurnManager(store, clock, owner="slow", lease_ttl_s=5)
    await slow.ensure_session("s")
    turn = await slow.open_turn("s")
    lost: list[str] = []
    slow.on_lease_lost = lost.append
    await clock.advance(6)  # it stalled: no heartbeat for longer than the TTL
    seen = await store.get(turn.id)
    assert await store.take_over(turn.id, "other", expect_owner="slow", expect_heartbeat=seen.heartbeat_at, at=clock.now())
    before = await store.get(turn.id)
    with pytest.raises(TurnStopped):
        await slow.checkpoint(turn.id, "before_tool")  # its next checkpoint: the round trip finds the lease gone
    assert lost == [turn.id]
    assert turn.id not in slow._owned  # it beats no more for it
    with pytest.raises(LeaseLost):  # nor writes anything else of it
        await slow.record(turn.id, reply="a reply nobody should see")
    with pytest.raises(TurnStopped):
        await slow.flush(turn.id)
    got = await store.get(turn.id)
    assert got == before  # not a field written: heartbeat, steps, usage, reply
    assert got.status is TurnStatus.RUNNING and got.lease_owner == "other" and got.stop_reason is None


class FlakyStore:
    """Wraps a store; its first ``fails`` calls find the store busy."""

    def __init__(self, inner: SqliteStore, fails: int) -> None:
        self.inner = inner
        self.fails = fails
        self.calls = 0

    def __getattr__(self, name: str):
        target = getattr(self.inner, name)

        async def call(*args, **kwargs):
            self.calls += 1
            if self.fails > 0:
                self.fails -= 1
                raise StoreUnavailable("sqlite: database is locked")
            return await target(*args, **kwargs)

        return call


async def test_busy_store_is_retried(store: SqliteStore) -> None:
    flaky = FlakyStore(store, fails=2)
    manager = TurnManager(flaky, SystemClock())  # type: ignore[arg-type]
    await manager.ensure_session("s")
    turn = await manager.open_turn("s")
    assert turn.status is TurnStatus.RUNNING


async def test_store_down_for_good_raises(store: SqliteStore) -> None:
    manager = TurnManager(FlakyStore(store, fails=100), SystemClock(), store_attempts=3)  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable):
        await manager.ensure_session("s")


async def test_stopping_a_turn_run_elsewhere_leaves_nothing_behind(store: SqliteStore, clock: VirtualClock) -> None:
    """An instance that accepts stops for turns other instances run must not
    keep a cache entry or an event writer per stop."""
    worker = TurnManager(store, clock, owner="worker")
    api = TurnManager(store, clock, owner="api")
    await worker.ensure_session("s")
    turns = [await worker.open_turn("s") for _ in range(5)]
    for t in turns:
        await api.request_stop(t.id, stop(clock, StopReasonKind.USER_CANCEL))
    for _ in range(200):
        if len(api.events) == 0:
            break
        await asyncio.sleep(0.01)
    assert api._flags == {} and len(api.events) == 0
    events = await store.read_events("s")
    assert sum(e.payload.get("status") == "CANCEL_REQUESTED" for e in events) == 5  # yet every stop was logged
