"""One analysed 20 ms frame of user audio, and the analysis every transport
runs on its inbound audio (no transport's protocol here: WebRTC's track
reading is :class:`media.inbound.InboundAudio`).

Whatever a client sends (Opus over RTP, G.711 over a WebSocket, a WAV in a
test) becomes 16 kHz mono s16 20 ms frames; :func:`analyse_frame` runs each
through the stream's :class:`media.bargein.BargeInDetector` and stamps it as
an :class:`InboundFrame`, which is what the agent session consumes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from clock import Clock
from media.bargein import BargeInDetector, DetectorEvent
from media.frames import FRAME_MS, VAD_RATE, frame_bytes


@dataclass(frozen=True)
class InboundFrame:
    """One 20 ms frame of user audio.

    Attributes:
        pcm: 640 bytes, 16 kHz mono s16.
        at: clock seconds when it was taken off the transport.
        voiced: webrtcvad's verdict on this frame.
        gated: it passed the detector's gate (voiced, above the noise floor,
            not the agent's own echo).
        echo: the echo guard found it explained by the agent's own audio.
        events: the detector's decisions made on this frame, in order.
        filled: silence put in for a stretch in which the transport gave no
            audio (see ``InboundAudio``'s ``stall_ms``), not received audio.
    """

    pcm: bytes
    at: float
    voiced: bool
    gated: bool = False
    echo: bool = False
    events: tuple[DetectorEvent, ...] = ()
    filled: bool = False


def analyse_frame(detector: BargeInDetector, pcm: bytes, at: float, *, filled: bool = False) -> InboundFrame:
    """Run one frame through the stream's barge-in detector.

    Args:
        detector: the stream's own detector (one per inbound stream).
        pcm: 640 bytes, 16 kHz mono s16 (20 ms).
        at: clock seconds when it arrived.
        filled: it is silence put in for a stall, not received audio.

    Raises:
        ValueError: ``pcm`` is not one 20 ms frame (from the detector).
    """
    verdict, events = detector.feed(pcm, at, received=not filled)
    return InboundFrame(
        pcm=pcm, at=at, voiced=verdict.voiced, gated=verdict.gated, echo=verdict.echo, events=tuple(events),
        filled=filled,
    )


async def analysed_frames(
    detector: BargeInDetector, inbound: asyncio.Queue[tuple[bytes, float] | None], clock: Clock, stall_ms: int
) -> AsyncIterator[InboundFrame]:
    """A WebSocket transport's inbound audio, analysed: each ``(pcm, at)``
    taken from ``inbound`` (20 ms, 16 kHz, clock seconds it arrived) until
    None; a stretch of ``stall_ms`` of the (injected) clock with nothing (the
    far end sends nothing: a device's microphone is off while it speaks)
    yields that much silence (``filled``), so the detector's and
    endpointing's timers run on (0: wait for audio). Shared by the phone and
    device transports; WebRTC's is :class:`media.inbound.InboundAudio`."""
    silence = bytes(frame_bytes(VAD_RATE))
    stall_s = stall_ms / 1000
    pending: asyncio.Future[tuple[bytes, float] | None] = asyncio.ensure_future(inbound.get())
    try:
        while True:
            if stall_s > 0 and not pending.done():
                sleeper: asyncio.Future[Any] = asyncio.ensure_future(clock.sleep(stall_s))
                waiting: set[asyncio.Future[Any]] = {pending, sleeper}
                try:
                    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleeper.cancel()
                if not pending.done():
                    now = clock.monotonic()
                    n = round(stall_s * 1000) // FRAME_MS
                    for i in range(n):
                        yield analyse_frame(detector, silence, now - (n - 1 - i) * FRAME_MS / 1000, filled=True)
                    continue
            item = await pending
            if item is None:
                return
            pending = asyncio.ensure_future(inbound.get())
            pcm, at = item
            yield analyse_frame(detector, pcm, at)
    finally:
        pending.cancel()
