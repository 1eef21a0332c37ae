"""The simulated phone provider's playout buffer: what it received from the
agent server, played to the caller at real time, 20 ms at a time.

Its rules are the providers' documented ones (Twilio Media Streams,
"Media Streams - WebSocket Messages"; Telnyx media streaming likewise):

- ``media`` from the server is "buffered and played in the order
  received"; payloads of any length join one continuous stream of 8 kHz
  mu-law bytes; when the buffer runs dry the caller hears silence;
- a ``mark`` is echoed "when the audio that you have sent has been
  completed": once every byte received before it has played (at once when
  nothing is buffered or playing);
- ``clear`` "empties all buffered audio and causes any mark messages to be
  sent back": the unplayed bytes are dropped, never played, and every
  pending mark is echoed at once.

Positions are byte offsets in the stream of everything the server sent
(one byte = one sample = 125 us). This class has no clock and no socket:
:class:`client.phone.PhoneSimulator` calls :meth:`tick` every 20 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

from media.g711 import MULAW_FRAME_BYTES

#: mu-law code of a zero sample (what an idle line plays)
MULAW_SILENCE = 0xFF


@dataclass(frozen=True)
class Tick:
    """One 20 ms frame played to the caller.

    Attributes:
        audio: 160 mu-law bytes as played (silence after ``real`` bytes).
        start: stream offset of its first received byte (bytes).
        real: received bytes in it (0..160); the rest is silence.
        echoes: names of marks whose audio finished playing before this
            frame began, to echo now, in order.
    """

    audio: bytes
    start: int
    real: int
    echoes: list[str]


@dataclass(frozen=True)
class Cleared:
    """What a ``clear`` did: ``at_offset``, the stream offset played when it
    came (the end of the old audio the caller heard); ``dropped``, bytes
    thrown away unplayed; ``echoes``, the pending marks echoed."""

    at_offset: int
    dropped: int
    echoes: list[str]


class ProviderPlayout:
    """The provider-side buffer of one call."""

    def __init__(self) -> None:
        self._buf = bytearray()
        #: stream offset of the end of everything received (bytes)
        self.received = 0
        #: stream offset played or dropped up to (bytes)
        self.played = 0
        #: bytes dropped by ``clear`` in all
        self.dropped = 0
        self._marks: list[tuple[int, str]] = []
        self._playing = False  # the last tick's frame held received audio

    @property
    def buffered(self) -> int:
        """Bytes received and not yet played (each is 125 us of audio)."""
        return len(self._buf)

    @property
    def pending_marks(self) -> list[str]:
        """Names of the marks not yet echoed, in order."""
        return [name for _, name in self._marks]

    def push_media(self, payload: bytes) -> int:
        """Queue mu-law bytes behind what is buffered; returns the stream
        offset of their first byte."""
        at = self.received
        self._buf += payload
        self.received += len(payload)
        return at

    def push_mark(self, name: str) -> list[str]:
        """Queue a mark after everything received so far. Returns ``[name]``
        when it is due at once (nothing buffered and nothing playing), else
        ``[]`` (a later :meth:`tick` echoes it)."""
        if not self._buf and not self._playing and not self._marks:
            return [name]
        self._marks.append((self.received, name))
        return []

    def clear(self) -> Cleared:
        """Drop every unplayed byte and echo every pending mark."""
        at = self.played
        dropped = len(self._buf)
        self._buf.clear()
        self.dropped += dropped
        self.played = self.received
        echoes = [name for _, name in self._marks]
        self._marks.clear()
        return Cleared(at_offset=at, dropped=dropped, echoes=echoes)

    def tick(self) -> Tick:
        """Play the next 20 ms: first echo the marks whose audio has now
        played to its end, then take up to 160 bytes (padded with silence)."""
        echoes: list[str] = []
        while self._marks and self._marks[0][0] <= self.played:
            echoes.append(self._marks.pop(0)[1])
        start = self.played
        real = min(MULAW_FRAME_BYTES, len(self._buf))
        audio = bytes(self._buf[:real]) + bytes([MULAW_SILENCE]) * (MULAW_FRAME_BYTES - real)
        del self._buf[:real]
        self.played += real
        self._playing = real > 0
        return Tick(audio=audio, start=start, real=real, echoes=echoes)
