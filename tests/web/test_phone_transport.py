"""The phone transport's own rules on virtual time, no socket: a clear drops
the media and marks still queued for the socket (nothing old is written
after it), a stretch without audio is filled with silence on the injected
clock, keys pressed while the session starts wait for it."""

from __future__ import annotations

import asyncio

from clock import VirtualClock
from media.playout import PlayoutFrame
from turn.models import StopReasonKind
from voice.transport import ControlKind
from web.telephony.dialect import Dtmf
from web.telephony.transport import PhoneTransport
from web.telephony.twilio import TwilioDialect


class SlowSocket:
    """A socket whose writes wait until released."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.open = asyncio.Event()

    async def send(self, text: str) -> None:
        await self.open.wait()
        self.written.append(text)


async def test_a_clear_drops_what_is_still_queued_for_the_socket() -> None:
    clock = VirtualClock()
    sock = SlowSocket()
    t = PhoneTransport(clock, lambda g: True, TwilioDialect(), sock.send, send_ahead_ms=60, mark_every_ms=40)
    t.started("MZ1")
    writer = asyncio.ensure_future(t.write())
    for i in range(3):
        t.output.push(PlayoutFrame(b"\x00\x20" * 960, 1, i * 960))
    t.output.pump(clock.monotonic())  # 3 media and a mark queued; the first is being written
    await asyncio.sleep(0)
    t.output.clear()
    sock.open.set()
    for _ in range(5):
        await asyncio.sleep(0)
    kinds = [w.kind for w in t.wire]
    assert kinds == ["media", "clear"]  # the rest never left: the provider would only discard it
    assert '"event":"clear"' in sock.written[-1] and '"streamSid":"MZ1"' in sock.written[-1]
    t.close(StopReasonKind.TRANSPORT_DISCONNECTED)
    await asyncio.wait_for(writer, 1)


async def test_silence_is_filled_on_the_clock_while_no_audio_comes() -> None:
    clock = VirtualClock()
    t = PhoneTransport(clock, lambda g: True, TwilioDialect(), SlowSocket().send, stall_ms=240)
    frames = t.frames()
    got = asyncio.ensure_future(frames.__anext__())
    await clock.advance(0.25)
    frame = await asyncio.wait_for(got, 1)
    assert frame.filled and len(frame.pcm) == 640
    rest = [await frames.__anext__() for _ in range(11)]
    assert all(f.filled for f in rest)  # 240 ms of silence: 12 frames
    t.close(StopReasonKind.TRANSPORT_DISCONNECTED)
    await frames.aclose()


async def test_keys_pressed_while_the_session_starts_wait_for_it() -> None:
    clock = VirtualClock()
    t = PhoneTransport(clock, lambda g: True, TwilioDialect(), SlowSocket().send)
    t.on_dtmf(Dtmf("4", "MZ1"))
    t.on_dtmf(Dtmf("2", "MZ1"))
    controls = t.controls()
    first = await controls.__anext__()
    second = await controls.__anext__()
    assert [first.kind, first.digit, second.digit] == [ControlKind.DTMF, "4", "2"]
    nxt = asyncio.ensure_future(controls.__anext__())
    await asyncio.sleep(0)
    t.on_dtmf(Dtmf("#", "MZ1"))  # taken by the session now
    assert (await asyncio.wait_for(nxt, 1)).digit == "#"
    t.close(StopReasonKind.TRANSPORT_DISCONNECTED)
    t.on_dtmf(Dtmf("9", "MZ1"))  # after the end: refused (logged)
    await controls.aclose()
