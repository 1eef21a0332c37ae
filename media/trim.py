"""Trimming silence from synthesized speech, as it streams.

TTS engines pad each sentence with silence (espeak-ng: about 330 ms at the
end). Played as is, that is dead air between sentences, and after the last
one it keeps a finished reply "speaking" for a third of a second, so a user
who answers right away would cut off a reply they heard in full.
:class:`SilenceTrimmer` drops leading silence and keeps at most
``keep_tail_ms`` of silence after the last sound, holding back silence only
until it knows whether more sound follows.
"""

from __future__ import annotations

from media.frames import BYTES_PER_SAMPLE, rms_dbfs


class SilenceTrimmer:
    """Streams mono s16 PCM through, minus leading and excess trailing silence.

    Args:
        rate: sample rate, Hz.
        threshold_dbfs: a 10 ms window quieter than this is silence.
        keep_tail_ms: silence kept after the last sound (a natural pause).
    """

    def __init__(self, rate: int, *, threshold_dbfs: float = -50.0, keep_tail_ms: int = 120) -> None:
        self.window = rate // 100 * BYTES_PER_SAMPLE  # 10 ms, bytes
        self.threshold = threshold_dbfs
        self.keep_tail = rate * keep_tail_ms // 1000 * BYTES_PER_SAMPLE
        self._carry = b""  # under one window, not judged yet
        self._silence = bytearray()  # silence held back after sound
        self._heard = False  # any sound yet?
        self.dropped_bytes = 0

    def push(self, pcm: bytes) -> bytes:
        """Add PCM; return what can be played now."""
        data = self._carry + pcm
        usable = len(data) - len(data) % self.window
        self._carry = data[usable:]
        out = bytearray()
        for i in range(0, usable, self.window):
            w = data[i : i + self.window]
            if rms_dbfs(w) > self.threshold:
                if self._heard:
                    out += self._silence  # a pause inside speech is kept whole
                else:
                    self.dropped_bytes += len(self._silence)
                self._silence.clear()
                out += w
                self._heard = True
            else:
                self._silence += w
        return bytes(out)

    def flush(self) -> bytes:
        """End of the stream: up to ``keep_tail_ms`` of the trailing silence."""
        tail = bytes(self._silence) + self._carry
        self._silence.clear()
        self._carry = b""
        if not self._heard:
            self.dropped_bytes += len(tail)
            return b""
        kept = tail[: self.keep_tail]
        self.dropped_bytes += len(tail) - len(kept)
        return kept
