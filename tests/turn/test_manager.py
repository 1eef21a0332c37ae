"""TurnManager over the SQLite store, on a virtual clock."""

from __future__ import annotations

import pytest

from turn.clock import SystemClock, VirtualClock
from turn.manager import StopOutcome, TurnManager
from turn.models import StopReason, StopReasonKind, Turn, TurnStatus
from turn.sqlite_store import SqliteStore
from turn.store import StoreUnavailable, UnknownTurn


def stop(clock: VirtualClock, kind: StopReasonKind = StopReasonKind.BARGE_IN) -> StopReason:
    return StopReason(kind=kind, initiator="test", at=clock.now())


@pytest.fixture
def manager(store: SqliteStore, clock: VirtualClock) -> TurnManager:
    return TurnManager(store, clock)


async def test_open_turn_runs_and_notifies(manager: TurnManager) -> None:
    seen: list[TurnStatus] = []
    manager.subscribe("s", lambda t: seen.append(t.status))
    turn = await manager.open_turn("s", 3)
    assert turn.status is TurnStatus.RUNNING and turn.generation == 3
    assert seen == [TurnStatus.QUEUED, TurnStatus.RUNNING]
    assert (await manager.get(turn.id)).status is TurnStatus.RUNNING


async def test_chosen_turn_id(manager: TurnManager) -> None:
    turn = await manager.open_turn("s", 1, turn_id="abc123")
    assert turn.id == "abc123"


async def test_stop_goes_through_cancel_requested(manager: TurnManager, clock: VirtualClock) -> None:
    seen: list[str] = []
    manager.subscribe("s", lambda t: seen.append(t.status.label))
    turn = await manager.open_turn("s", 1)
    first = await manager.request_stop(turn.id, stop(clock))
    assert first.outcome is StopOutcome.ACCEPTED
    assert first.turn.status is TurnStatus.CANCEL_REQUESTED
    again = await manager.request_stop(turn.id, stop(clock, StopReasonKind.USER_CANCEL))
    assert again.outcome is StopOutcome.ALREADY_STOPPING
    await clock.advance(0.1)
    res = await manager.confirm_stopped(turn.id)
    assert res.applied and res.turn.status is TurnStatus.CANCELLED
    assert res.turn.stop_reason is not None and res.turn.stop_reason.kind is StopReasonKind.BARGE_IN
    assert res.turn.terminal_at == clock.now()
    late = await manager.request_stop(turn.id, stop(clock))
    assert late.outcome is StopOutcome.ALREADY_TERMINAL
    assert seen == ["queued", "running", "stopping", "cancelled"]


async def test_completed_turn_is_not_cancelled(manager: TurnManager, clock: VirtualClock) -> None:
    turn = await manager.open_turn("s", 1)
    await manager.complete(turn.id)
    ans = await manager.request_stop(turn.id, stop(clock))
    assert ans.outcome is StopOutcome.ALREADY_TERMINAL
    assert ans.turn.status is TurnStatus.COMPLETED
    assert not (await manager.confirm_stopped(turn.id)).applied


async def test_committed_final_step_completes_after_stop(manager: TurnManager, clock: VirtualClock) -> None:
    turn = await manager.open_turn("s", 1)
    await manager.request_stop(turn.id, stop(clock))
    res = await manager.complete(turn.id)
    assert res.applied and res.turn.status is TurnStatus.COMPLETED


async def test_queued_turn_is_cancelled_at_once(manager: TurnManager, store: SqliteStore, clock: VirtualClock) -> None:
    now = clock.now()
    turn = await store.create(Turn(session_id="s", generation=1, created_at=now, updated_at=now))
    ans = await manager.request_stop(turn.id, stop(clock, StopReasonKind.TRANSPORT_DISCONNECTED))
    assert ans.outcome is StopOutcome.CANCELLED_BEFORE_START
    assert ans.turn.status is TurnStatus.CANCELLED


async def test_fail_records_error(manager: TurnManager) -> None:
    turn = await manager.open_turn("s", 1)
    res = await manager.fail(turn.id, "no_speech_recognized")
    assert res.turn.status is TurnStatus.FAILED and res.turn.error == "no_speech_recognized"


async def test_unknown_turn(manager: TurnManager, clock: VirtualClock) -> None:
    with pytest.raises(UnknownTurn):
        await manager.request_stop("missing", stop(clock))


async def test_broken_listener_does_not_break_turns(manager: TurnManager) -> None:
    def boom(_: Turn) -> None:
        raise RuntimeError("listener bug")

    unsubscribe = manager.subscribe("s", boom)
    turn = await manager.open_turn("s", 1)
    assert turn.status is TurnStatus.RUNNING
    unsubscribe()
    unsubscribe()  # idempotent


async def test_record_text(manager: TurnManager) -> None:
    turn = await manager.open_turn("s", 1)
    got = await manager.record(turn.id, transcript="hello", reply="hi there")
    assert (got.transcript, got.reply) == ("hello", "hi there")


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
    turn = await manager.open_turn("s", 1)
    assert turn.status is TurnStatus.RUNNING
    assert flaky.calls == 4  # two busy answers, then create and start


async def test_store_down_for_good_raises(store: SqliteStore) -> None:
    manager = TurnManager(FlakyStore(store, fails=100), SystemClock(), store_attempts=3)  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable):
        await manager.open_turn("s", 1)


async def test_open_without_start_stays_queued(manager: TurnManager) -> None:
    turn = await manager.open_turn("s", 1, start=False)
    assert turn.status is TurnStatus.QUEUED
