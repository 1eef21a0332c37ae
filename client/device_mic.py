"""The simulated device's microphone: 16 kHz mono Opus packets of 60 ms,
one every 60 ms at real time while the device listens (the firmware's
audio service encodes what its audio processor hands it; 78/xiaozhi-esp32
main/audio/audio_service.cc), each framed by the protocol version and sent
once its 60 ms were captured. Speech said while the microphone is off is
lost at real time, as in a room. :class:`client.device.DeviceSimulator`
owns one and tells it when it is open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from client.device_log import DeviceLog, SentPacket
from clock import Clock
from media.opus import OpusEncoder
from web.devices import framing

log = logging.getLogger(__name__)

UPLINK_RATE = 16_000
UPLINK_FRAME_MS = 60
PACKET_SAMPLES = UPLINK_RATE * UPLINK_FRAME_MS // 1000


class DeviceMicrophone:
    """One device's microphone.

    Args:
        clock: pacing clock.
        is_open: whether the device's state has the microphone open now.
        send: sends one binary message.
        version: binary protocol version (framing).
        log: where each sent packet is recorded.
        origin: the clock time version 2 timestamps count from, s.
    """

    def __init__(self, clock: Clock, is_open: Callable[[], bool], send: Callable[[bytes], Awaitable[None]],
                 version: int, log: DeviceLog, origin: Callable[[], float]) -> None:
        self.clock, self._is_open, self._send, self.version, self.log = clock, is_open, send, version, log
        self._origin = origin
        self._encoder = OpusEncoder(UPLINK_RATE, UPLINK_FRAME_MS, in_rate=UPLINK_RATE)
        self._queue: list[tuple[bytes, int, int]] = []  # (one packet's PCM, utterance, sample)
        self._empty = asyncio.Event()
        self._empty.set()
        self._wake = asyncio.Event()
        self._seq = 0

    def say(self, pcm16k: bytes, utterance: int) -> None:
        """Queue 16 kHz mono s16 PCM (after what is queued), tagged
        ``utterance`` (>= 0) in :attr:`DeviceLog.sent`."""
        pcm16k = pcm16k[: len(pcm16k) // 2 * 2]
        size = PACKET_SAMPLES * 2
        for i in range(0, len(pcm16k), size):
            chunk = pcm16k[i : i + size]
            self._queue.append((chunk + bytes(size - len(chunk)), utterance, i // 2))
        if self._queue:
            self._empty.clear()

    async def said(self) -> None:
        """Wait until everything queued has been captured."""
        await self._empty.wait()

    def changed(self) -> None:
        """The device's state changed (the microphone may open or close)."""
        self._wake.set()

    def drain(self) -> None:
        """What is still queued when the microphone closes is never sent."""
        if self._queue:
            log.debug("microphone closed with %d packets unsaid", len(self._queue))
        self._queue.clear()
        self._empty.set()

    async def run(self) -> None:
        """The capture loop (runs until cancelled): while open, one packet
        per 60 ms, the first 60 ms after the microphone opened."""
        while True:
            await self._while_closed()
            t0, k = self.clock.monotonic(), 0
            opened_ms = round((t0 - self._origin()) * 1000)  # version 2 stamps count from here
            while self._is_open():
                k += 1
                await self.clock.sleep(t0 + k * UPLINK_FRAME_MS / 1000 - self.clock.monotonic())
                if not self._is_open():
                    break
                pcm, utt, sample = self._queue.pop(0) if self._queue else (bytes(PACKET_SAMPLES * 2), -1, 0)
                # The packet's stamp is when its capture ended by the device's
                # sample clock (k packets of 60 ms after the microphone opened),
                # not when the event loop got round to sending it: a late
                # wake-up delays the send, never the audio's time.
                ts = opened_ms + k * UPLINK_FRAME_MS
                for packet in self._encoder.encode(pcm):
                    await self._send(framing.frame(packet, self.version, timestamp_ms=ts))
                    self.log.sent.append(SentPacket(self.clock.monotonic(), self._seq, utt, sample))
                    self._seq += 1
                if not self._queue:
                    self._empty.set()

    async def _while_closed(self) -> None:
        """Wait for the microphone to open; meanwhile what is queued is
        lost, 60 ms per 60 ms."""
        while not self._is_open():
            self._wake.clear()
            sleeper = asyncio.ensure_future(self.clock.sleep(UPLINK_FRAME_MS / 1000))
            waker = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
                woke = waker.done()
            finally:
                sleeper.cancel()
                waker.cancel()
            if not woke and self._queue:
                self._queue.pop(0)
                if not self._queue:
                    self._empty.set()
