"""End to end with a speech provider: the real server on loopback with
``stt.provider`` set to a provider whose fake server (testkit/) runs beside
it, driven over WebRTC by the aiortc client with espeak-ng speech. What the
caller sees (transcripts, the barge-in, the events), what the REST view and
the session's log hold (usage), and what the provider's fake recorded
(audio sent, control messages) are checked, also when the provider fails
mid-call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import plain, requires_espeak, start_app

from client.call import CallClient
from client.results import CallResult, Utterance
from media.frames import PLAYOUT_RATE, load_pcm
from testkit.fake_deepgram import FakeDeepgram, FakeDeepgramOptions
from testkit.fake_openai_transcriptions import FakeTranscriptions
from testkit.stt_backend import Latency, SttBackend
from web.app import PEERS, STORE, create_app
from web.settings import Settings

pytestmark = [pytest.mark.e2e, requires_espeak]
TOKEN = "tok-default-0123456789"
KEY = "stt-test-key"


@pytest_asyncio.fixture
async def backend(grammar_file: Path) -> AsyncIterator[SttBackend]:
    b = SttBackend(str(grammar_file), max_decoders=1)
    await b.start()
    yield b
    await b.aclose()


def utt(path: Path, at_s: float | None = None, kind: str = "speech") -> Utterance:
    return Utterance(pcm=load_pcm(path, PLAYOUT_RATE), at_s=at_s, label=path.name, kind=kind)


class Call:
    """A server configured for a provider, one call to it, and what it logged."""

    def __init__(self, tmp_path: Path, **stt: object) -> None:
        self.app = create_app(Settings(
            store=f"sqlite:///{tmp_path}/var/t.db", api_tokens=f"default:{TOKEN}", demo_shop=False,
            stt={"max_decoders": 1, **stt},
        ))
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def __aenter__(self) -> Call:
        self.runner, self.url = await start_app(self.app)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def run(self, opening: Utterance, clips: list[Utterance]) -> CallResult:
        return await CallClient(self.url, token=TOKEN).run(opening, clips, timeout_s=60)

    async def logged(self, session_id: str, type: str) -> list[dict[str, Any]]:
        """The session's logged events of ``type`` once it has ended (the
        session tells its recognition usage as it ends, after the caller hung up)."""
        async with asyncio.timeout(10):
            while session_id in self.app[PEERS]:
                await asyncio.sleep(0.05)
        events = await self.app[STORE].read_events(session_id)
        return [e.payload for e in events if e.type == type]

    async def turn(self, turn_id: str) -> dict[str, Any]:
        async with aiohttp.ClientSession() as http, http.get(
            f"{self.url}/v1/turns/{turn_id}", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            assert r.status == 200
            return dict(await r.json())


async def test_a_call_heard_by_deepgram(backend: SttBackend, tmp_path: Path, say: Callable[..., Path]) -> None:
    """The story is asked for, a backchannel is let go and a request barges
    in, all heard by Deepgram: only speech went over the wire (a Finalize at
    each utterance's end), each turn carries what recognising it cost, and
    the session tells its usage, Deepgram's own figure beside ours."""
    fake = FakeDeepgram(backend, FakeDeepgramOptions(api_key=KEY, latency=Latency(0.15, 0.3)))
    fake_runner, fake_url = await start_app(fake.app())
    try:
        async with Call(tmp_path, provider="deepgram", base_url=fake_url.replace("http://", "ws://"), api_key=KEY,
                        cents_per_minute=6.0) as call:
            result = await call.run(
                utt(say("tell me a story")),
                [utt(say("yeah", wpm=160), at_s=1.0, kind="backchannel"), utt(say("what is the weather like today"), at_s=1.0)],
            )
            assert not result.timed_out
            old, new = result.turns
            assert (old.transcript, new.transcript) == ("Tell me a story.", "What is the weather like today.")
            assert old.stop_reason == "barge_in" and new.status == "COMPLETED" and "sunny" in new.reply
            backchannel, request = result.barge_ins
            assert not backchannel.barged_in and backchannel.resumed == "backchannel" and request.barged_in
            record = await call.turn(new.id)
            [usage] = await call.logged(result.session_id, "stt.usage")
            assert not await call.logged(result.session_id, "stt.failover")
    finally:
        await fake_runner.cleanup()
    # on the wire: one session stream (besides the startup probe), only speech, a Finalize per utterance
    [conn] = [c for c in fake.connections if c.audio_s > 0]
    assert 2.5 < conn.audio_s < 9.0, conn.audio_s  # three utterances with their pre-roll, not the call's silences
    assert conn.controls.count("Finalize") >= 3 and conn.controls[-1] == "CloseStream"
    # the turn's recognition, priced at 6 cents a minute, counted in what it spent
    [rec] = record["usage"]["recognition"]
    assert rec["provider"] == "deepgram" and 1.0 < rec["audio_s"] < 4.0 and rec["cents"] == pytest.approx(rec["audio_s"] / 10, abs=1e-4)
    assert record["spent"]["cents"] >= rec["cents"]
    # the session's: all it sent (backchannel included), and Deepgram's Metadata agreeing
    assert usage["provider"] == "deepgram" and usage["audio_s"] == pytest.approx(conn.audio_s, abs=0.05)
    assert usage["reported_audio_s"] == pytest.approx(conn.audio_s, abs=0.05)
    assert usage["connection_s"] >= usage["audio_s"] and usage["cents"] == pytest.approx(usage["audio_s"] / 10, abs=1e-3)


async def test_a_provider_that_drops_mid_call_is_replaced_and_nothing_said_is_lost(
    backend: SttBackend, tmp_path: Path, say: Callable[..., Path]
) -> None:
    """The transcription server answers 503 to every request: the session
    reconnects once, falls back to the embedded recogniser, the client is
    told, and the caller's request is still heard and answered."""
    fake = FakeTranscriptions(backend, api_key=KEY, status=503)
    fake_url = await fake.start()
    try:
        async with Call(tmp_path, provider="openai", base_url=fake_url, api_key=KEY) as call:
            result = await call.run(utt(say("what is the weather like today")), [])
            failovers = await call.logged(result.session_id, "stt.failover")
    finally:
        await fake.aclose()
    [turn] = result.turns
    assert plain(turn.transcript) == "what is the weather like today" and turn.status == "COMPLETED"  # heard by the embedded Whisper
    assert [(f["provider"], f["error"], f["action"]) for f in failovers] == [
        ("openai", "provider", "reconnect"), ("openai", "provider", "fallback")]
    assert failovers[-1]["fallback"] == "whisper"
    assert len(fake.requests) == 2  # the utterance, and its one retry: never a third
