"""What a simulated device saw and did (:class:`client.device.DeviceSimulator`),
in the simulator clock's seconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from client.device_speaker import Segment


@dataclass(frozen=True)
class SentPacket:
    """A microphone packet sent: when (clock s), its number from 0, and which
    utterance (index, -1 for silence) from which 16 kHz sample."""

    at: float
    seq: int
    utterance: int
    sample: int


@dataclass(frozen=True)
class ReceivedPacket:
    """A downlink audio message: arrival (clock s), payload bytes, the
    device's state then, and where it played (None: dropped, because the
    device was not speaking, the queue was full, or it did not decode),
    its decoded samples and where its sound ends (s into it, 0 if silent)."""

    at: float
    size: int
    state: str
    segment: Segment | None
    samples: int = 0
    sound_end: float = 0.0


@dataclass
class DeviceLog:
    """What one simulated device saw, in the simulator clock's seconds.

    ``messages_in`` / ``messages_out``: (time, JSON object) received / sent;
    ``states``: (time, new state); ``errors``: the server's protocol
    violations, as text (a bad frame, undecodable Opus, bad JSON).
    """

    sent: list[SentPacket] = field(default_factory=list)
    received: list[ReceivedPacket] = field(default_factory=list)
    messages_in: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    messages_out: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    states: list[tuple[float, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def tts(self, state: str, after: float = float("-inf")) -> list[float]:
        """Arrival times of ``tts`` messages with ``state`` at or after ``after``."""
        return [at for at, m in self.messages_in if m.get("type") == "tts" and m.get("state") == state and at >= after]
