"""A session leaves nothing behind: after calls over real WebRTC (a barge-in,
a hang-up mid-answer) have ended, every per-session object is freed by one
garbage collection and every registry keyed by session or turn is empty.

Issue 11.5: each session's whole object graph (its agent, detector, Silero
model, turns, frames) stayed alive for the turn's deadline (300 s), held by
the context of cancelled asyncio timers; a server's memory grew for its
first ~60 sessions. Only the Silero models stay, idle in their bounded pool
for the next sessions. The check is on objects, not on RSS (which is noisy)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import corpus as C
import pytest
from aiohttp import web
from conftest import requires_espeak, start_app

from client.call import CallClient
from client.results import Utterance
from media.frames import PLAYOUT_RATE, VAD_RATE
from media.silero import SILERO_IDLE_MAX, SILERO_POOL
from web.app import MANAGER, PEERS, STORE, create_app
from web.settings import Settings

pytestmark = [pytest.mark.e2e, requires_espeak]


def spoken(text: str, at_s: float | None = None) -> Utterance:
    pcm, _ = C.embed(C.espeak(text, "en-us", 140), 0, 300)
    return Utterance(C.resample(pcm, VAD_RATE, PLAYOUT_RATE), at_s=at_s, label=text)


class Tracker:
    """Weak references to every session's objects, taken while they live."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.refs: dict[tuple[str, str], weakref.ref[Any]] = {}

    def _keep(self, session_id: str, name: str, obj: Any) -> None:
        if obj is not None and (session_id, name) not in self.refs:
            self.refs[(session_id, name)] = weakref.ref(obj)

    def grab(self) -> None:
        for peer in list(self.app[PEERS].values()):
            keep = lambda name, obj, peer=peer: self._keep(peer.id, name, obj)  # noqa: E731
            keep("PeerSession", peer)
            keep("RTCPeerConnection", peer.pc)
            keep("WebRtcTransport", peer.transport)
            keep("OpusPacedTrack", peer.transport.outbound)
            keep("PlayoutBuffer", peer.transport.output)
            keep("AgentSession", peer.agent)
            keep("SessionEventLog", peer.log)
            keep("EspeakSynthesiser", peer.agent.providers.tts)
            keep("LocalAgent", peer.agent.providers.llm)
            if (inbound := peer.transport.inbound) is not None:
                keep("InboundAudio", inbound)
                keep("BargeInDetector", inbound.detector)
                keep("Silero", inbound.detector._confirmation.model)
            for i, run in enumerate(list(peer.agent._runs)):
                keep(f"TurnHandle{i}", run)
                keep(f"TurnScope{i}", run.scope)

    async def watch(self) -> None:
        """Grab every 10 ms (no session is referenced from this frame)."""
        while True:
            self.grab()
            await asyncio.sleep(0.01)

    def alive(self) -> list[tuple[str, str]]:
        return sorted((sid[:8], name) for (sid, name), ref in self.refs.items() if ref() is not None)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[web.Application, str]]:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/var/t.db"))
    runner, url = await start_app(app)
    yield app, url
    await runner.cleanup()


async def test_ended_sessions_leave_no_objects_and_no_registry_entries(served: tuple[web.Application, str]) -> None:
    app, url = served
    tracker = Tracker(app)
    watcher = asyncio.create_task(tracker.watch())
    story, weather = spoken("tell me a story"), spoken("what is the weather like today", at_s=1.0)
    try:
        # a barge-in whose new turn is cut by the hang-up, then a hang-up mid-story, twice
        for _ in range(2):
            barged = await CallClient(url).run(story, [weather], timeout_s=7, settle_s=0.2)
            assert [t.status for t in barged.turns][:1] == ["CANCELLED"], barged.as_dict()
            hung_up = await CallClient(url).run(story, timeout_s=3, settle_s=0.2)
            assert hung_up.turns and hung_up.received_audio_ms > 0, hung_up.as_dict()
        async with asyncio.timeout(10):
            while app[PEERS]:
                await asyncio.sleep(0.05)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        del watcher
    names = {name for _, name in tracker.refs}
    assert len({sid for sid, _ in tracker.refs}) == 4
    assert {"PeerSession", "AgentSession", "RTCPeerConnection", "BargeInDetector", "Silero", "TurnHandle0", "TurnScope0"} <= names
    # while the turns' 300 s deadline timers are still in the loop's heap (cancelled)
    loop = asyncio.get_running_loop()
    assert any(h.cancelled() and h.when() > loop.time() + 200 for h in loop._scheduled)  # type: ignore[attr-defined]
    gc.collect()
    # the Silero models went back to the pool (bounded), everything else is freed
    pooled = {id(m) for m in SILERO_POOL._idle}
    assert 1 <= len(SILERO_POOL) <= SILERO_IDLE_MAX
    assert all(id(ref()) in pooled for (_, name), ref in tracker.refs.items() if name == "Silero" and ref() is not None)
    assert [(sid, name) for sid, name in tracker.alive() if name != "Silero"] == []
    manager = app[MANAGER]
    registries = {
        "peers": len(app[PEERS]),
        "event logs": len(manager.events),
        "turns owned": len(manager._owned),
        "turn runtimes": len(manager._runtime),
        "turn locations": len(manager._where),
        "stop flags": len(manager._flags),
        "stop hooks": len(manager._stop_hooks),
        "listeners": len(manager._listeners),
        "stop signals": len(manager.signals._events),
        "event waiters": len(app[STORE]._event_waiters),
    }
    assert registries == dict.fromkeys(registries, 0)
