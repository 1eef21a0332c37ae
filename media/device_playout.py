"""The output sink of a xiaozhi-esp32 device socket: the playout buffer,
encoded as Opus packets at the rate the server ``hello`` announced, paced
at real time with a small send-ahead (:class:`media.paced_playout.PacedPlayout`).

The firmware plays every Opus packet it receives, in order, from its own
queue, and keeps playing what it holds after an ``abort`` (78/xiaozhi-esp32,
docs/websocket.md, sections 4.2 and 5): so the server sends no more than
``send_ahead_ms`` beyond real time, stops at once on a barge-in or an abort
(:meth:`DevicePlayout.clear`, in the step the fence moves), and tells the
transport (:meth:`DeviceWire.send_cleared`) so it can end the device's
``tts`` state.

**What the device heard.** The protocol has no acknowledgements (nothing
like telephony's marks), so the heard position of a generation is what was
sent minus the send-ahead still in flight::

    heard = end of the audio sent - max(0, far_end_until - now) * rate

(``far_end_until``: when the device will have played all it was sent, at
real time from receipt), frozen at its value when the output is cleared.
It assumes the device plays on receipt at real time; a device that buffers
more plays later than claimed, never less than was sent.

Packets are whole ``frame_ms`` Opus frames (60 ms: three 20 ms playout
frames); a stretch that ends mid-packet (the queue ran dry, a pause, another
generation) is padded with silence and sent (:meth:`media.opus.OpusEncoder.flush`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from clock import Clock
from media.frames import FRAME_MS, PLAYOUT_RATE
from media.opus import OpusEncoder
from media.outbound import Passes
from media.paced_playout import PacedPlayout
from media.playout import PlayoutFrame

#: generations whose heard books are kept
KEEP_GENERATIONS = 64


class DeviceWire(Protocol):
    """Where the device playout's output goes, in order (the transport
    frames it in the device's protocol version). None of these may block."""

    def send_audio(self, packet: bytes, generation: int) -> None:
        """One Opus packet of ``generation`` (the first of a generation's
        stretch is preceded by the transport's ``tts start``)."""
        ...

    def send_cleared(self) -> None:
        """The output was cleared: drop audio not yet written, end ``tts``."""
        ...


class DevicePlayout(PacedPlayout):
    """One device's output sink (see the module doc). Not thread-safe.

    Args:
        clock: pacing time source.
        passes: the delivery gate's rule (``GenerationFence.passes``).
        wire: where packets go.
        sample_rate: the downlink Opus rate, Hz (the server ``hello``'s).
        frame_ms: the downlink packet duration, ms (the server ``hello``'s).
        send_ahead_ms: see :class:`media.paced_playout.PacedPlayout`.
        on_played: called with each 20 ms frame (48 kHz PCM, or None on an
            idle tick) and the clock second it is due at the device (the
            echo guard's reference); None: not called.

    Attributes:
        sent_packets: Opus packets sent, per generation.
        clears_at: clock seconds of every clear that dropped or stopped audio.
    """

    def __init__(
        self, clock: Clock, passes: Passes, wire: DeviceWire, *, sample_rate: int = 24_000, frame_ms: int = 20,
        send_ahead_ms: int = 40, on_played: Callable[[bytes | None, float], None] | None = None,
        rate: int = PLAYOUT_RATE,
    ) -> None:
        super().__init__(clock, passes, send_ahead_ms=send_ahead_ms, rate=rate)
        self.wire = wire
        self.encoder = OpusEncoder(sample_rate, frame_ms, in_rate=rate)
        self.packet_s = frame_ms / 1000
        self.on_played = on_played
        self.sent_packets: dict[int, int] = {}
        self.clears_at: list[float] = []
        self._stretch: int | None = None  # generation of the frames in the encoder / last sent
        self._in_encoder_end = 0  # end sample of the frames given to the encoder
        self._stretch_start = 0  # first sample of the stretch being encoded
        self._stretch_packets = 0  # packets of it sent
        self._packet_samples = round(frame_ms * rate / 1000)  # a packet's audio, samples at ``rate``
        self._sent_end: dict[int, int] = {}
        self._first: dict[int, int] = {}
        self._frozen: dict[int, int] = {}
        self._audible_end: dict[int, int] = {}
        self._muted_through = -1

    # -- the pacer --------------------------------------------------------------------

    def mute(self, generation: int) -> None:
        """Nothing of ``generation`` or older is sent any more (an ``abort``:
        the reply's frames still on their way from TTS are dropped), then
        :meth:`clear`."""
        self._muted_through = max(self._muted_through, generation)
        self.clear()

    def next_deliverable(self) -> PlayoutFrame | None:
        """The gate, and the mute: see :meth:`PacedPlayout.next_deliverable`."""
        while (frame := super().next_deliverable()) is not None:
            if frame.generation > self._muted_through:
                return frame
            self.fenced_frames += 1
        return None

    def emit(self, frame: PlayoutFrame, now: float) -> None:
        """Encode one frame; send every packet that completes."""
        gen = frame.generation
        if self._stretch is not None and self._stretch != gen:
            self._end_stretch(now)
        if self._stretch is None:
            self._stretch_start, self._stretch_packets = frame.sample, 0
        self._stretch = gen
        self._first.setdefault(gen, frame.sample)
        self._in_encoder_end = frame.sample + len(frame.pcm) // 2
        if frame.audible:
            self._audible_end[gen] = self._in_encoder_end
        if self.on_played is not None:
            self.on_played(frame.pcm, max(self.far_end_until, now))
        self._send(self.encoder.encode(frame.pcm), gen, now)
        self._forget()

    def idle(self, now: float) -> None:
        """Nothing more may go: the stretch's last partial packet goes."""
        if self.on_played is not None and self.far_end_until <= now:
            self.on_played(None, now)
        if self._stretch is not None:
            self._end_stretch(now)

    def _end_stretch(self, now: float) -> None:
        gen = self._stretch
        assert gen is not None
        self._send(self.encoder.flush(), gen, now)
        self.encoder.reset()
        self._stretch = None

    def _send(self, packets: list[bytes], generation: int, now: float) -> None:
        if not packets:
            return
        for packet in packets:
            self.wire.send_audio(packet, generation)
            self.far_end_until = max(self.far_end_until, now) + self.packet_s
        self.sent_packets[generation] = self.sent_packets.get(generation, 0) + len(packets)
        self._stretch_packets += len(packets)
        # what the packets sent so far carry (the last one of a stretch is padded past its frames)
        sent = self._stretch_start + self._stretch_packets * self._packet_samples
        self._sent_end[generation] = min(self._in_encoder_end, sent)

    def _forget(self) -> None:
        for books in (self._sent_end, self._first, self._frozen, self._audible_end):
            while len(books) > KEEP_GENERATIONS:
                del books[min(books)]

    # -- the seam (voice.transport.OutputSink) ------------------------------------------

    def clear(self) -> int:
        """Drop everything queued and what the encoder holds, at once; what
        the device heard of each generation is frozen now; the wire is told
        (:meth:`DeviceWire.send_cleared`) if anything had been sent since the
        last clear. Returns the frames dropped here."""
        n = super().clear()
        now = self.clock.monotonic()
        for gen in self._sent_end:
            self._frozen.setdefault(gen, self.played_samples(gen))
        sent_since = self.far_end_until > 0 or self._stretch is not None
        self.encoder.reset()
        self._stretch = None
        if sent_since:
            self.far_end_until = 0.0
            self.clears_at.append(now)
            self.wire.send_cleared()
        return n

    def played_samples(self, generation: int) -> int:
        """How far the device heard into ``generation``'s audio, samples at
        ``rate``: sent minus what is still in flight (see the module doc)."""
        if generation in self._frozen:
            return self._frozen[generation]
        end = self._sent_end.get(generation)
        if end is None:
            return 0
        in_flight = max(0.0, self.far_end_until - self.clock.monotonic()) if generation == self._last_sent() else 0.0
        return max(self._first.get(generation, 0), end - round(in_flight * self.rate))

    def _last_sent(self) -> int | None:
        return max(self._sent_end) if self._sent_end else None

    def audible_pending(self, generation: int) -> bool:
        """Sound of ``generation`` is queued, in the encoder, or sent and not heard yet."""
        if super().audible_pending(generation):
            return True
        if generation in self._frozen:
            return False  # cleared: what was in flight is not coming
        if self._stretch == generation and self._audible_end.get(generation, 0) > self._sent_end.get(generation, 0):
            return True
        return self.played_samples(generation) < min(self._audible_end.get(generation, 0), self._sent_end.get(generation, 0))

    async def wait_empty(self) -> None:
        """Return once every queued frame was sent and the device has
        played it (real time from receipt), or it was cleared."""
        await super().wait_empty()
        while len(self) or self._stretch is not None or self.far_end_until > self.clock.monotonic():
            await self.clock.sleep(FRAME_MS / 1000)
