"""DTMF keys as the user's input: a telephone key pressed while the agent
speaks is a committed barge-in (initiator ``dtmf``), and the keys pressed
until the terminator (``#``) or a pause of ``timeout_ms`` are the user's
utterance: the turn's transcript is the digits, given to the model like
speech (:class:`DigitStream` stands where the recogniser's stream would).
The rule is that of IVRs (ITU-T Q.23 keys; RFC 4733 carries them as events).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from turn.models import RecognitionRecord


class DtmfConfig(BaseModel):
    """Keypad input settings (env ``TURNKEEPER_SESSION__DTMF__*``).

    Attributes:
        timeout_ms: the keys end this long after the last one, ms.
        terminator: the key that ends them at once (not part of the input,
            unless it is the only key pressed); empty: only the timeout.
    """

    timeout_ms: int = Field(3000, ge=100, le=60_000)
    terminator: str = Field("#", pattern=r"^[0-9*#A-D]?$")


class DigitStream:
    """The keypad's stand-in for a recogniser stream (:class:`voice.providers.UtteranceStream`):
    audio fed is ignored, the transcript is the keys pressed.

    Attributes:
        digits: the keys so far, in order.
    """

    def __init__(self) -> None:
        self.digits = ""

    def feed(self, pcm: bytes) -> None:
        """Audio is not the input of a keypad turn: ignored."""

    async def finish(self) -> str:
        """The keys pressed."""
        return self.digits

    async def aclose(self) -> None:
        """Nothing to free."""

    def usage(self) -> list[RecognitionRecord]:
        """Keys cost nothing to recognise: no records."""
        return []
