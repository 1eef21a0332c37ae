"""The small protocols every provider sits behind.

All calls are async and cancellable: cancelling the awaiting task stops the
work (a subprocess is killed, a stream closed) before ``CancelledError``
propagates.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Literal, Protocol

from pydantic import BaseModel


class Message(BaseModel):
    """One entry of the conversation history a model sees.

    Attributes:
        role: "user", "assistant" or "system".
        content: the text.
        interrupted: for an assistant message, True if the user cut it off.
    """

    role: Literal["user", "assistant", "system"]
    content: str
    interrupted: bool = False


class SttStream(Protocol):
    """One utterance being recognised."""

    def feed(self, pcm: bytes) -> None:
        """Add audio: 16 kHz mono s16 PCM, any length. Never blocks."""
        ...

    async def finish(self) -> str:
        """End the utterance and return the final transcript ("" if none)."""
        ...

    async def aclose(self) -> None:
        """Abandon the utterance; idempotent, also after ``finish``."""
        ...


class SpeechToText(Protocol):
    """Speech recognition for one session (may hold a loaded model)."""

    async def start(self) -> None:
        """Load what is needed. Idempotent."""
        ...

    def open_stream(self) -> SttStream:
        """Begin a new utterance."""
        ...

    async def aclose(self) -> None:
        """Release the model."""
        ...


class LanguageModel(Protocol):
    """A streaming model."""

    def stream(self, messages: list[Message]) -> AsyncIterator[str]:
        """Yield the reply to ``messages`` as text deltas (tokens) as they are
        produced. Close the iterator (``aclose``) or cancel to abort."""
        ...


PcmSink = Callable[[bytes], None]


class TextToSpeech(Protocol):
    """Speech synthesis."""

    #: rate in Hz of the mono s16 PCM handed to the sink
    sample_rate: int

    async def synthesize(self, text: str, sink: PcmSink) -> None:
        """Speak ``text``, calling ``sink(pcm)`` with audio as it is made.
        Returns when all audio was delivered; cancelling stops synthesis at
        once."""
        ...
