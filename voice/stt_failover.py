"""What a session's recognition does when its recogniser fails (issue 28,
item 6): reconnect once, then fall back to the embedded recogniser
(``stt.fallback = "embedded"``) or give up, in which case the utterances
waiting for a transcript fail with a clear reason (their turns end
FAILED) and the next utterance tries the configured recogniser afresh.

A failure that retrying cannot mend (a refused key: ``unauthorized``) goes
straight to the fallback, and so do a provider that cannot be reached
(``unreachable``) and one that owed a final too long (``timeout``): trying
it again at once would only add its connect timeout, or another wait for
a final, to the caller's wait. A reconnect is for a connection that broke
(``dropped``, ``closed``, ``protocol``, ``provider``): a new one usually
works at once. A reconnect that delivers a final counts as a
recovery (:meth:`Failover.recovered`): a later drop may reconnect once more.
The audio a new stream needs (everything since the last final) is replayed
by :class:`voice.transcription.Transcription`; this module only decides.
"""

from __future__ import annotations

from typing import Literal

from voice.recognition import Recogniser, RecognitionError

#: what a failure led to: the same recogniser again, the fallback, or nothing
FailoverAction = Literal["reconnect", "fallback", "failed"]


class Failover:
    """The recogniser a session's transcription uses now, and the next one
    after a failure.

    Args:
        primary: the configured recogniser (``stt.provider``).
        fallback: the embedded one (``stt.fallback = "embedded"``), or None.
    """

    def __init__(self, primary: Recogniser, fallback: Recogniser | None = None) -> None:
        self.primary = primary
        self.fallback = fallback if fallback is not primary else None
        #: the recogniser in use
        self.current: Recogniser = primary
        self._reconnected = False

    def after(self, error: RecognitionError) -> tuple[Recogniser | None, FailoverAction]:
        """The current recogniser failed with ``error``: which one next
        (None: none is left), and what that is."""
        if error.retryable and error.kind not in ("unreachable", "timeout") and not self._reconnected:
            self._reconnected = True
            return self.current, "reconnect"
        if self.current is self.primary and self.fallback is not None:
            self.current = self.fallback
            self._reconnected = False
            return self.current, "fallback"
        return None, "failed"

    def recovered(self) -> None:
        """The current recogniser delivered a final: a later failure may
        reconnect once more."""
        self._reconnected = False

    def restart(self) -> Recogniser:
        """After giving up: the next utterance tries the primary afresh."""
        self.current = self.primary
        self._reconnected = False
        return self.current
