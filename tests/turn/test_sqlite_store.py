"""SqliteStore: compare-and-set transitions, one terminal state, durability."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path

import pytest

from turn.models import StopReason, StopReasonKind, Turn, TurnStatus
from turn.sqlite_store import SqliteStore, path_from_url
from turn.states import Outcome
from turn.store import DuplicateTurn, UnknownTurn

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=timezone.utc)


def new_turn(session: str = "s1", gen: int = 1) -> Turn:
    return Turn(session_id=session, generation=gen, created_at=NOW, updated_at=NOW)


def reason(kind: StopReasonKind = StopReasonKind.BARGE_IN, rid: str = "r1") -> StopReason:
    return StopReason(kind=kind, initiator="test", at=NOW, request_id=rid)


async def test_create_get_roundtrip(store: SqliteStore) -> None:
    t = await store.create(new_turn())
    got = await store.get(t.id)
    assert got == t
    assert got.status is TurnStatus.QUEUED


async def test_unknown_and_duplicate(store: SqliteStore) -> None:
    with pytest.raises(UnknownTurn):
        await store.get("nope")
    with pytest.raises(UnknownTurn):
        await store.transition("nope", TurnStatus.RUNNING, at=NOW)
    with pytest.raises(UnknownTurn):
        await store.update("nope", at=NOW, reply="x")
    t = await store.create(new_turn())
    with pytest.raises(DuplicateTurn):
        await store.create(t)


async def test_update_only_mutable_fields(store: SqliteStore) -> None:
    t = await store.create(new_turn())
    got = await store.update(t.id, at=NOW, transcript="hi", reply="hello")
    assert (got.transcript, got.reply) == ("hi", "hello")
    with pytest.raises(ValueError):
        await store.update(t.id, at=NOW, status="COMPLETED")


async def test_illegal_transition_is_a_conflict(store: SqliteStore) -> None:
    t = await store.create(new_turn())
    res = await store.transition(t.id, TurnStatus.CANCEL_REQUESTED, at=NOW, stop_reason=reason())
    assert res.outcome is Outcome.CONFLICT
    assert (await store.get(t.id)).status is TurnStatus.QUEUED
    assert (await store.get(t.id)).stop_reason is None


async def test_terminal_is_final_and_reports_winner(store: SqliteStore) -> None:
    t = await store.create(new_turn())
    await store.transition(t.id, TurnStatus.RUNNING, at=NOW)
    done = await store.transition(t.id, TurnStatus.COMPLETED, at=NOW)
    assert done.applied and done.turn.terminal_at == NOW
    again = await store.transition(t.id, TurnStatus.FAILED, at=NOW, error="late")
    assert again.outcome is Outcome.ALREADY_TERMINAL
    assert again.turn.status is TurnStatus.COMPLETED
    assert (await store.get(t.id)).error is None


async def test_complete_races_cancel_one_terminal(store: SqliteStore) -> None:
    """Many writers race to end the same turns; each ends exactly once."""
    for _ in range(20):
        t = await store.create(new_turn())
        await store.transition(t.id, TurnStatus.RUNNING, at=NOW)
        attempts = [
            store.transition(t.id, TurnStatus.COMPLETED, at=NOW),
            store.transition(t.id, TurnStatus.CANCEL_REQUESTED, at=NOW, stop_reason=reason()),
            store.transition(t.id, TurnStatus.FAILED, at=NOW, error="boom"),
            store.transition(t.id, TurnStatus.CANCEL_REQUESTED, at=NOW, stop_reason=reason(rid="r2")),
        ]
        results = await asyncio.gather(*attempts)
        terminal_wins = [r for r in results if r.applied and r.turn.status.is_terminal]
        final = await store.get(t.id)
        if final.status is TurnStatus.CANCEL_REQUESTED:
            assert not terminal_wins
            assert final.stop_reason is not None
            assert sum(r.applied for r in results) == 1
        else:
            assert len(terminal_wins) == 1 and terminal_wins[0].turn.status is final.status


async def test_first_stop_reason_wins(store: SqliteStore) -> None:
    t = await store.create(new_turn())
    await store.transition(t.id, TurnStatus.RUNNING, at=NOW)
    await store.transition(t.id, TurnStatus.CANCEL_REQUESTED, at=NOW, stop_reason=reason(rid="first"))
    res = await store.transition(
        t.id, TurnStatus.CANCELLED, at=NOW, stop_reason=reason(StopReasonKind.USER_CANCEL, rid="second")
    )
    assert res.applied
    assert res.turn.stop_reason is not None and res.turn.stop_reason.request_id == "first"
    assert res.turn.stop_reason.kind is StopReasonKind.BARGE_IN


async def test_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "var" / "t.db"
    s1 = SqliteStore(path)
    await s1.open()
    t = await s1.create(new_turn())
    await s1.transition(t.id, TurnStatus.RUNNING, at=NOW)
    await s1.transition(t.id, TurnStatus.CANCEL_REQUESTED, at=NOW, stop_reason=reason())
    await s1.close()
    s2 = SqliteStore(path)
    await s2.open()
    got = await s2.get(t.id)
    assert got.status is TurnStatus.CANCEL_REQUESTED
    assert got.stop_reason == reason()
    await s2.close()


async def test_list_session_in_order(store: SqliteStore) -> None:
    ids = [(await store.create(new_turn("a", g))).id for g in range(1, 4)]
    await store.create(new_turn("b"))
    assert [t.id for t in await store.list_session("a")] == ids
    assert await store.list_session("zzz") == []


async def test_closed_store_refuses(tmp_path: Path) -> None:
    s = SqliteStore(tmp_path / "x.db")
    with pytest.raises(RuntimeError):
        await s.get("x")
    await s.open()
    await s.open()  # idempotent
    await s.close()
    await s.close()


def test_path_from_url() -> None:
    assert path_from_url("sqlite:///var/turnkeeper.db") == Path("var/turnkeeper.db")
    assert path_from_url("sqlite:////tmp/x.db") == Path("/tmp/x.db")
    for bad in ("redis://x", "sqlite://", "sqlite:///", "var/x.db"):
        with pytest.raises(ValueError):
            path_from_url(bad)


async def test_locked_database_is_unavailable_not_corrupt(tmp_path: Path) -> None:
    import sqlite3

    from turn.store import StoreUnavailable

    path = tmp_path / "locked.db"
    s = SqliteStore(path, busy_timeout_ms=50)
    await s.open()
    t = await s.create(new_turn())
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another writer holds the lock
    try:
        with pytest.raises(StoreUnavailable):
            await s.transition(t.id, TurnStatus.RUNNING, at=NOW)
        with pytest.raises(StoreUnavailable):
            await s.create(new_turn())
    finally:
        other.execute("ROLLBACK")
        other.close()
    res = await s.transition(t.id, TurnStatus.RUNNING, at=NOW)  # works again once released
    assert res.applied
    await s.close()
