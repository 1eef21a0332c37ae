"""Phone calls end to end over the Twilio Media Streams endpoint: the real
application on loopback, a raw WebSocket client in the provider's role
(tests/telephony_provider.py) sending espeak-ng speech as 20 ms mu-law and
playing what comes back as the provider's buffer would. A turn answered
over the phone; a barge-in (clear after the fence, nothing of the old
generation after it, old turn CANCELLED barge_in, history keeps only what
was heard); DTMF as input and as a barge-in; hang-ups settle turns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import plain, requires_espeak, start_app
from telephony_provider import FakeProvider, wait_until

from turn.events import EventFollower, event_json
from turn.models import StopReasonKind, Turn, TurnStatus
from web.app import MANAGER, PEERS, STORE, create_app
from web.settings import Settings
from web.telephony.call import PhoneCall

pytestmark = requires_espeak


@dataclass
class Server:
    app: web.Application
    url: str

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/telephony/twilio"

    def call(self) -> PhoneCall:
        [call] = [p for p in self.app[PEERS].values() if isinstance(p, PhoneCall)]
        return call

    async def turns(self, session_id: str) -> list[Turn]:
        return await self.app[STORE].list_session(session_id)

    async def events(self, session_id: str) -> list[dict[str, Any]]:
        follower = EventFollower(self.app[STORE], session_id)
        return [event_json(e) for e in await follower.read_available()]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db"))
    runner, url = await start_app(app)
    try:
        yield Server(app, url)
    finally:
        await runner.cleanup()


@pytest.fixture
async def phone(server: Server) -> AsyncIterator[FakeProvider]:
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(server.ws_url)
        provider = FakeProvider(ws)
        await provider.start()
        await wait_until(lambda: any(isinstance(p, PhoneCall) and p.agent for p in server.app[PEERS].values()))
        yield provider
        await provider.aclose()


async def settled(server: Server, session_id: str, n: int, timeout: float = 30) -> list[Turn]:
    """The call's turns once at least ``n`` of them, and every turn, ended;
    a turn merged into a later one (a speculative reply withdrawn when the
    caller went on, as a loaded machine's VAD may split an utterance) is
    part of that one, not a turn of its own."""

    async def conversation() -> tuple[list[Turn], bool]:
        turns = await server.turns(session_id)
        return [t for t in turns if not t.merged_into], all(t.status.is_terminal for t in turns)

    async with asyncio.timeout(timeout):
        while True:
            turns, ended = await conversation()
            if ended and len(turns) >= n:
                return turns
            await asyncio.sleep(0.05)


async def test_a_call_is_answered_over_the_phone(server: Server, phone: FakeProvider, say: Callable[..., Path]) -> None:
    call = server.call()
    phone.play(say("please count to twenty"))
    [turn] = await settled(server, call.id, 1)
    assert turn.status is TurnStatus.COMPLETED and "count" in plain(turn.transcript)
    assert turn.reply and turn.reply.startswith("One, two, three")
    # the reply reached the caller's ear: seconds of sound, 160-byte messages,
    # and every mark echoed back (so completion waited for the far end)
    assert len(phone.audible()) > 50
    assert all(len(p.payload) == 160 for p in phone.played)
    marks = phone.of("mark")
    assert marks and set(phone.echoed) >= {m.msg["mark"]["name"] for m in marks}
    assert call.transport.output.marks.pending() == 0 and call.transport.output.marks.unknown_echoes == 0
    assert not phone.of("clear")  # no barge-in, no clear
    events = await server.events(call.id)
    segments = [(e["type"], e["generation"]) for e in events if e["type"] in ("audio.start", "audio.end")]
    assert segments[0] == ("audio.start", turn.generation) and segments[-1] == ("audio.end", turn.generation)
    [end] = [e for e in events if e["type"] == "audio.end"][-1:]
    assert end["turn_id"] == turn.id and end["samples_sent"] > 48_000
    session = await server.app[MANAGER].store.get_session(call.id)
    assert session.tenant_id == "default"


async def test_a_barge_in_clears_the_far_end_and_history_keeps_what_was_heard(
    server: Server, phone: FakeProvider, say: Callable[..., Path]
) -> None:
    call = server.call()
    phone.play(say("tell me a story"))
    await wait_until(lambda: len(phone.audible()) > 40, 30, "the story is heard")
    phone.play(say("what is the weather like today"))
    await wait_until(lambda: bool(call.agent and call.agent.barge_ins), 10, "a barge-in")
    rec = call.agent.barge_ins[-1]  # type: ignore[union-attr]
    await wait_until(lambda: bool(phone.of("clear")), 5, "clear arrives")
    old, new = (await settled(server, call.id, 2))[:2]
    # the old turn: CANCELLED barge_in; the new one answered
    assert old.status is TurnStatus.CANCELLED
    assert old.stop_reason is not None and old.stop_reason.kind is StopReasonKind.BARGE_IN
    assert old.stop_reason.initiator == "vad"
    assert "weather" in plain(new.transcript)
    # clear left in the fence's own step, and nothing of the old generation after it
    wire = list(call.transport.wire)
    clears = [i for i, w in enumerate(wire) if w.kind == "clear"]
    assert clears, "the server wrote a clear"
    out = call.transport.output
    # the stage-1 pause on speech recalled the provider's audio with a clear
    # (before the fence); the commit sent one more in the fence's own step
    assert len(out.clears_at) == len(clears) <= 2 and out.recalled_frames <= len(clears) * 4
    # (the same step: two clock reads apart, which a loaded machine may stretch)
    assert out.clears_at[-1] == pytest.approx(rec.fenced_at, abs=0.05)
    assert all(at <= rec.fenced_at + 0.05 for at in out.clears_at), (out.clears_at, rec.fenced_at)
    fence_clear = clears[-1]
    assert wire[fence_clear].at - rec.fenced_at < 0.1  # written at once (a sanity bound)
    assert not [w for w in wire[fence_clear:] if w.generation == rec.old_generation and w.kind == "media"]
    # on the caller's side: clear arrived, and what played after it is the new reply only
    clear_at = phone.of("clear")[0].at
    assert clear_at - phone.speech_started_at[-1] < 1.5  # a sanity bound (detector + confirmation)
    # heard: only what the caller heard is kept, marked interrupted
    assert old.reply and old.reply_unheard
    assert "".join([old.reply, " ", old.reply_unheard]).split()[: len(old.reply.split())] == old.reply.split()
    events = await server.events(call.id)
    [interrupted] = [e for e in events if e["type"] == "agent.interrupted" and e["turn_id"] == old.id]
    assert interrupted["heard"] == old.reply
    # what the server counts as heard is close to what the far end played of the old reply
    played_ms = len([p for p in phone.played if p.before_clear == 0 and p.at >= 0]) * 20
    heard_ms = interrupted["played_ms"]
    assert abs(heard_ms - played_ms) < 400, (heard_ms, played_ms)  # a sanity bound
    old_sound = [p.at for p in phone.audible() if p.before_clear == 0]
    stop_ms = (max(old_sound) - phone.speech_started_at[-1]) * 1000
    print(f"phone barge-in: audible stop at the far end {stop_ms:.0f} ms after the speech's first message; "
          f"heard {heard_ms} ms of the reply by the marks, {played_ms} ms played at the far end")
    assert stop_ms < 1000  # a sanity bound: stage 1 pauses sending at speech_started
    history = await call.agent.history()  # type: ignore[union-attr]
    assistant = [m for m in history if m.role == "assistant"]
    assert assistant and assistant[0].content == old.reply and assistant[0].interrupted


async def test_keys_are_the_users_input_and_a_key_barges_in(
    server: Server, phone: FakeProvider, say: Callable[..., Path]
) -> None:
    call = server.call()
    phone.play(say("tell me a story"))
    await wait_until(lambda: len(phone.audible()) > 40, 30, "the story is heard")
    for digit in "42#":
        await phone.dtmf(digit)
    old, keys = (await settled(server, call.id, 2))[:2]
    assert old.status is TurnStatus.CANCELLED
    assert old.stop_reason is not None and old.stop_reason.kind is StopReasonKind.BARGE_IN
    assert old.stop_reason.initiator == "dtmf"
    assert keys.transcript == "42" and keys.status is TurnStatus.COMPLETED
    assert phone.of("clear")


async def test_a_hang_up_mid_reply_settles_the_turn(server: Server, phone: FakeProvider, say: Callable[..., Path]) -> None:
    call = server.call()
    phone.play(say("tell me a story"))
    await wait_until(lambda: len(phone.audible()) > 20, 30, "the story is heard")
    await phone.stop()
    [turn] = await settled(server, call.id, 1)
    assert turn.status is TurnStatus.CANCELLED
    assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.TRANSPORT_DISCONNECTED
    await wait_until(lambda: not server.app[PEERS], 10, "the call is freed")


async def test_a_telnyx_call_with_frames_out_of_order_is_answered(server: Server, say: Callable[..., Path]) -> None:
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(server.url.replace("http://", "ws://") + "/v1/telephony/telnyx")
        phone = FakeProvider(ws, dialect="telnyx", stream_id="32DE0DEA-53CB-4B21-89A4-9E1819C043BC",
                             call_id="v3:abc", shuffle=3)
        await phone.start()
        await wait_until(lambda: any(isinstance(p, PhoneCall) and p.agent for p in server.app[PEERS].values()))
        call = server.call()
        phone.play(say("please count to twenty"))
        [turn] = await settled(server, call.id, 1)
        reorder = call.transport._reorder
        assert reorder is not None and reorder.reordered > 50 and reorder.lost == 0 and reorder.late == 0
        assert turn.status is TurnStatus.COMPLETED and "count" in plain(turn.transcript)
        assert len(phone.audible()) > 50
        out = phone.of("media")[0].msg
        assert set(out) == {"event", "media"} and set(out["media"]) == {"payload"}  # Telnyx's outbound shape
        await phone.aclose()
