"""Opus (RFC 6716) for device sockets and the WebRTC downlink.

Devices (the xiaozhi-esp32 protocol, docs/websocket.md of 78/xiaozhi-esp32):
each binary message carries one Opus packet of one frame, 60 ms by
default; the device sends 16 kHz mono and plays the rate the server's
``hello`` announces (16 or 24 kHz). WebRTC: :class:`media.outbound.OpusPacedTrack`
codes its 20 ms frames at 48 kHz mono with an :class:`OpusEncoder`.

Encoding and decoding go through PyAV's libopus (``CodecContext`` "libopus");
nothing here parses Opus itself. One :class:`OpusDecoder` and one
:class:`OpusEncoder` belong to one connection (codec and resampler state
carry from packet to packet) and are dropped with it.
"""

from __future__ import annotations

import fractions

import av
from av.audio.codeccontext import AudioCodecContext
from av.codec.context import CodecContext
from av.packet import Packet

from media.frames import BYTES_PER_SAMPLE, PcmResampler, pcm_to_frame

#: the frame durations Opus allows, ms (RFC 6716 section 2.1.4)
OPUS_FRAME_MS = (10, 20, 40, 60)
#: the rates an Opus encoder takes, Hz
OPUS_RATES = (8_000, 12_000, 16_000, 24_000, 48_000)
#: libopus's modes as FFmpeg's libopus encoder names them ("application")
OPUS_APPLICATIONS = ("voip", "audio", "lowdelay")
#: an Opus packet is at most this long, bytes (RFC 6716 section 3.2.1: 120 ms at 510 kbit/s)
MAX_PACKET_BYTES = 1275 * 3 + 7


class OpusError(ValueError):
    """A packet that is not Opus (or not decodable), or a bad parameter."""


class OpusDecoder:
    """One connection's uplink: Opus packets to mono s16 PCM at ``rate`` Hz
    (16 kHz for the VAD pipeline), whatever rate the packets were coded at.

    Args:
        rate: output sample rate, Hz.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        codec = CodecContext.create("libopus", "r")
        codec.layout = "mono"
        self._codec: AudioCodecContext = codec
        self._resampler = PcmResampler(rate)

    def decode(self, packet: bytes) -> bytes:
        """Decode one packet (one message's payload) into PCM at ``rate``
        (60 ms at 16 kHz: 960 samples, 1920 bytes, give or take the
        resampler's few samples of delay).

        Raises:
            OpusError: empty, oversized or undecodable (the decoder is left
                usable: the next good packet decodes).
        """
        if not packet:
            raise OpusError("empty Opus packet")
        if len(packet) > MAX_PACKET_BYTES:
            raise OpusError(f"Opus packet of {len(packet)} bytes (at most {MAX_PACKET_BYTES})")
        try:
            frames = self._codec.decode(Packet(packet))
        except av.error.FFmpegError as exc:
            raise OpusError(f"not an Opus packet: {exc}") from exc
        return b"".join(self._resampler.frame(f) for f in frames)


class OpusEncoder:
    """One connection's downlink: mono s16 PCM at ``in_rate`` Hz (the 48 kHz
    playout frames) to Opus packets of ``frame_ms`` at ``rate`` Hz (what the
    server ``hello`` announced).

    A run of digital silence costs one encode: once two silent frames in a
    row came out as the same packet (libopus's CELT modes settle on a 3-byte
    silence frame), that packet is sent again for every further silent
    frame without calling the encoder; the encoder's state is the same
    silence either way, so the first frame after the run codes as it would
    have. (The SILK modes keep coding comfort noise, whose packets differ,
    so in ``voip`` nothing is reused.)

    Args:
        rate: the coded rate, Hz (one of :data:`OPUS_RATES`).
        frame_ms: each packet's duration, ms (one of :data:`OPUS_FRAME_MS`).
        in_rate: the PCM pushed in, Hz.
        bitrate: target bit rate, bit/s.
        application: libopus's mode (:data:`OPUS_APPLICATIONS`): ``voip``
            (SILK and hybrid, 6.5 ms look-ahead) or ``lowdelay`` (CELT
            only, 2.5 ms look-ahead, about half the CPU; RFC 6716 section 2).
        complexity: the encoder's effort, 0-10 (libopus's default 10).

    Raises:
        OpusError: a rate, frame duration, mode or complexity Opus does not
            have.
    """

    def __init__(self, rate: int, frame_ms: int, *, in_rate: int, bitrate: int = 24_000,
                 application: str = "voip", complexity: int = 10) -> None:
        if rate not in OPUS_RATES:
            raise OpusError(f"Opus has no {rate} Hz mode (one of {OPUS_RATES})")
        if frame_ms not in OPUS_FRAME_MS:
            raise OpusError(f"Opus has no {frame_ms} ms frame (one of {OPUS_FRAME_MS})")
        if application not in OPUS_APPLICATIONS:
            raise OpusError(f"Opus has no {application!r} mode (one of {OPUS_APPLICATIONS})")
        if not 0 <= complexity <= 10:
            raise OpusError(f"Opus complexity is 0-10, not {complexity}")
        self.rate = rate
        self.frame_ms = frame_ms
        self.in_rate = in_rate
        self.frame_samples = rate * frame_ms // 1000
        self._bitrate = bitrate
        self._application = application
        self._complexity = complexity
        self._silent_frame = bytes(self.frame_samples * BYTES_PER_SAMPLE)
        self.reused_silence = 0
        self.reset()

    def reset(self) -> None:
        """Start a new stream: codec, resampler and the partial frame
        forgotten (after the device was told to stop: the next audio is a
        new reply's)."""
        codec = CodecContext.create("libopus", "w")
        codec.sample_rate = self.rate
        codec.format = "s16"
        codec.layout = "mono"
        codec.time_base = fractions.Fraction(1, self.rate)
        codec.bit_rate = self._bitrate
        codec.options = {"frame_duration": str(self.frame_ms), "application": self._application,
                         "compression_level": str(self._complexity)}
        codec.open()
        self._codec: AudioCodecContext = codec
        self._resampler = PcmResampler(self.rate)
        self._pending = bytearray()
        self._pts = 0
        self._last_silence: bytes | None = None  # the packet the last silent frame coded to
        self._silence_packet: bytes | None = None  # set while a silent run reuses it

    def encode(self, pcm: bytes) -> list[bytes]:
        """Add PCM at ``in_rate``; return every whole packet now ready
        (maybe none: a 60 ms packet needs three 20 ms frames).

        Raises:
            ValueError: an odd number of bytes (not s16).
        """
        resampled = self._resampler.pcm(pcm, self.in_rate) if self.in_rate != self.rate else pcm
        if len(resampled) % BYTES_PER_SAMPLE:
            raise ValueError("s16 PCM must have an even number of bytes")
        self._pending += resampled
        size = self.frame_samples * BYTES_PER_SAMPLE
        out: list[bytes] = []
        while len(self._pending) >= size:
            chunk = bytes(self._pending[:size])
            del self._pending[:size]
            out += self._encode_frame(chunk)
        return out

    def _encode_frame(self, chunk: bytes) -> list[bytes]:
        """One frame of ``frame_samples`` samples through the codec, or the
        silence packet again while a silent run reuses it."""
        self._pts += self.frame_samples
        silent = chunk == self._silent_frame
        if silent and self._silence_packet is not None:
            self.reused_silence += 1
            return [self._silence_packet]
        packets = [bytes(p) for p in self._codec.encode(pcm_to_frame(chunk, self.rate, pts=self._pts - self.frame_samples))]
        if not silent:
            self._last_silence = self._silence_packet = None
        elif len(packets) == 1:
            if packets[0] == self._last_silence:
                self._silence_packet = packets[0]
            self._last_silence = packets[0]
        return packets

    def flush(self) -> list[bytes]:
        """The last partial frame padded with silence, as packets (end of a
        reply)."""
        if not self._pending:
            return []
        size = self.frame_samples * BYTES_PER_SAMPLE
        self._pending += bytes(size - len(self._pending))
        return self.encode(b"")
