"""A transport for tests: the transport seam (:class:`voice.transport.Transport`)
implemented from WAV files and a recorder, nothing else.

It shows that a client kind is added by implementing the seam alone. Inbound,
every 20 ms of the injected clock it takes the next 20 ms of queued speech
(:meth:`WavTransport.play`: a WAV, or 16 kHz mono s16 PCM), or silence, and
runs it through the same analysis a real transport uses
(:func:`media.inbound_frame.analyse_frame` on the stream's own
:class:`media.bargein.BargeInDetector`). Outbound, the output sink (a
:class:`media.playout.PlayoutBuffer`) is drained by the same paced track and
delivery gate as WebRTC's (:class:`media.outbound.PacedAudioTrack`), one
frame per 20 ms tick, and every tick is recorded as it would have been
played (:class:`PlayedTick`), so a test can measure silence after a barge-in
in what the far end heard. Controls are put with :meth:`WavTransport.press`;
events delivered and controls refused are kept.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clock import Clock
from media.bargein import BargeInDetector
from media.bargein_config import BargeInConfig
from media.frames import FRAME_MS, VAD_RATE, frame_bytes, load_pcm
from media.inbound_frame import InboundFrame, analyse_frame
from media.outbound import PacedAudioTrack, Passes
from media.playout import PlayoutBuffer, PlayoutFrame
from media.vad import VadConfig
from turn.models import StopReasonKind
from voice.transport import CloseNotice, Control, ControlInbox, ControlKind

#: if the loop stalls longer than this (s), inbound pacing restarts instead of bursting
MAX_LAG_S = 0.1


@dataclass(frozen=True)
class PlayedTick:
    """One 20 ms tick of the output as the far end got it.

    Attributes:
        at: clock seconds of the tick.
        generation: the generation of the frame sent, None for silence.
        audible: the frame sent carries sound (a reply's speech, not its pauses).
        pcm: what was sent, 1920 bytes of 48 kHz mono s16 (after the declick ramps).
    """

    at: float
    generation: int | None
    audible: bool
    pcm: bytes


class WavTransport:
    """A call fed from WAV files and recorded (see the module doc).

    Args:
        clock: time source (pacing both ways, frame stamps).
        passes: the delivery gate's rule (``GenerationFence.passes``).
        vad: VAD settings of the detector.
        bargein: the detector's two-stage settings.

    Attributes:
        output: the output sink (the agent session pushes into it).
        detector: this stream's barge-in detector.
        played: every output tick so far, in order.
        delivered: every event delivered (read back from the session's log).
        refused: every control refused, with its error code.
        utterances_at: clock seconds at which each played WAV's first frame
            went in, in order.
        idle: set while no speech is queued.
    """

    kind = "wav"

    def __init__(
        self, clock: Clock, passes: Passes, vad: VadConfig | None = None, bargein: BargeInConfig | None = None,
    ) -> None:
        self.clock = clock
        self.output = PlayoutBuffer()
        self.detector = BargeInDetector(vad, bargein)
        self.played: list[PlayedTick] = []
        self.delivered: list[dict[str, Any]] = []
        self.refused: list[tuple[Control, str]] = []
        self.utterances_at: list[float] = []
        self.idle = asyncio.Event()
        self.idle.set()
        self._track = PacedAudioTrack(self.output, passes, clock, on_sent=self._on_sent)
        self._queue: deque[tuple[bytes, bool]] = deque()  # (20 ms of pcm16, first of an utterance)
        self._controls = ControlInbox()
        self._closed = CloseNotice()
        self._sent: tuple[PlayoutFrame | None, float] = (None, 0.0)  # the tick's frame and clock time

    # -- the test's side -----------------------------------------------------------

    def play(self, speech: str | Path | bytes) -> None:
        """Queue an utterance: a WAV (any rate; decoded to 16 kHz mono) or
        16 kHz mono s16 PCM. It goes in after what is queued, padded with
        silence to whole 20 ms frames.

        Raises:
            FileNotFoundError, ValueError: the WAV cannot be read.
        """
        pcm = speech if isinstance(speech, bytes) else load_pcm(speech, VAD_RATE)
        size = frame_bytes(VAD_RATE)
        pcm += bytes(-len(pcm) % size)
        self._queue.extend((pcm[i : i + size], i == 0) for i in range(0, len(pcm), size))
        if self._queue:
            self.idle.clear()

    def press(self, kind: ControlKind, digit: str | None = None) -> bool:
        """The client sends a control now. Returns False if no session takes
        controls (it is refused as ``session_not_ready`` then)."""
        control = Control(kind, self.clock.monotonic(), digit)
        if self._controls.put(control):
            return True
        self.refuse(control, "session_not_ready")
        return False

    def close(self, reason: StopReasonKind = StopReasonKind.TRANSPORT_DISCONNECTED) -> None:
        """The call ends (a hang-up): subscribers are told, the inbound
        frames end at the next tick, controls end."""
        if self._closed.close(reason):
            self._controls.end()

    def audible(self, generation: int, since: float | None = None) -> list[PlayedTick]:
        """The ticks that played sound of ``generation`` (from clock ``since`` on)."""
        return [t for t in self.played if t.generation == generation and t.audible and (since is None or t.at >= since)]

    def recording(self) -> bytes:
        """Everything played, 48 kHz mono s16, one 20 ms frame per tick."""
        return b"".join(t.pcm for t in self.played)

    # -- the seam ------------------------------------------------------------------

    async def frames(self) -> AsyncIterator[InboundFrame]:
        """One analysed 20 ms frame per 20 ms tick until :meth:`close`; the
        output is paced out meanwhile (and stops with the frames)."""
        silence = bytes(frame_bytes(VAD_RATE))
        drain = asyncio.ensure_future(self._drain())
        start: float | None = None
        tick = 0
        try:
            while self._closed.reason is None:
                now = self.clock.monotonic()
                if start is None:
                    start = now
                else:
                    tick += 1
                    due = start + tick * FRAME_MS / 1000
                    if now - due > MAX_LAG_S:
                        start, tick = now, 0
                    else:
                        await self.clock.sleep(due - now)
                if self._closed.reason is not None:
                    return
                at = self.clock.monotonic()
                if self._queue:
                    pcm, first = self._queue.popleft()
                    if first:
                        self.utterances_at.append(at)
                else:
                    pcm = silence
                    self.idle.set()
                yield analyse_frame(self.detector, pcm, at)
        finally:
            drain.cancel()
            await asyncio.wait({drain})

    def controls(self) -> AsyncIterator[Control]:
        """What :meth:`press` put, in order."""
        return self._controls.items()

    def refuse(self, control: Control, code: str) -> None:
        """Kept in ``refused``."""
        self.refused.append((control, code))

    def deliver(self, event: dict[str, Any]) -> None:
        """Kept in ``delivered``."""
        self.delivered.append(event)

    def reset_detector(self) -> None:
        """Forget the detector's current run."""
        self.detector.reset()

    def on_close(self, callback: Callable[[StopReasonKind], None]) -> None:
        """Call ``callback`` once with the reason :meth:`close` is given."""
        self._closed.subscribe(callback)

    # -- outbound --------------------------------------------------------------------

    def _on_sent(self, frame: PlayoutFrame | None, at: float) -> None:
        self._sent = (frame, at)

    async def _drain(self) -> None:
        """Stands in for the far end: takes a frame every 20 ms and records it."""
        while True:
            pcm = (await self._track.recv()).to_ndarray().tobytes()
            frame, at = self._sent
            gen, audible = (None, False) if frame is None else (frame.generation, frame.audible)
            self.played.append(PlayedTick(at, gen, audible, pcm))
