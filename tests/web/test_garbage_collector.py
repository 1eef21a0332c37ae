"""The collector kept off the live audio (web/garbage_collector.py): the
survivors of startup are frozen, nothing frozen is kept for good, and the
idle settle runs once per idle spell after serving, on virtual time."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from clock import VirtualClock
from web import garbage_collector
from web.garbage_collector import settle, settle_when_idle


@pytest.fixture(autouse=True)
def _unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test process keeps CPython's defaults


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_settle_collects_the_garbage_then_freezes_what_lives() -> None:
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    kept = Node()
    done = settle()
    assert gone() is None and done.collected >= 1
    assert done.frozen == gc.get_freeze_count() > 0
    assert gc.is_tracked(kept) and not any(o is kept for o in gc.get_objects(2))  # frozen: no generation walks it
    assert done.ms >= 0


def test_a_frozen_object_that_becomes_garbage_is_freed_by_the_next_settle() -> None:
    node = Node()
    gone = weakref.ref(node)
    settle()
    del node
    gc.collect()
    assert gone() is not None  # frozen: a collection does not see it
    settle()
    assert gone() is None  # nothing frozen is kept for good


async def test_settles_once_per_idle_spell_after_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = VirtualClock()
    settled: list[float] = []
    monkeypatch.setattr(garbage_collector, "settle",
                        lambda: settled.append(clock.monotonic()) or garbage_collector.Settled(0, 0, 0.0))
    start = clock.monotonic()
    live = [0]
    task = asyncio.create_task(settle_when_idle(lambda: live[0], clock, every_s=5))
    try:
        await clock.advance(20)
        assert settled == []  # idle since startup: startup settled already
        live[0] = 2
        await clock.advance(20)
        assert settled == []  # never while a call is live
        live[0] = 0
        await clock.advance(5)
        assert [t - start for t in settled] == [45.0]  # the first look after the last call ended
        await clock.advance(60)
        assert [t - start for t in settled] == [45.0]  # once per idle spell
        live[0] = 1
        await clock.advance(5)
        live[0] = 0
        await clock.advance(5)
        assert [t - start for t in settled] == [45.0, 115.0]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
