"""Voice activity detection with hysteresis on 20 ms frames.

webrtcvad classifies each 20 ms frame of 16 kHz mono s16 as voiced or not
(the WebRTC VAD accepts 10, 20 or 30 ms frames at 8/16/32/48 kHz). A single
voiced frame is not speech: :class:`VoiceActivityDetector` reports
``speech_started`` only after ``onset_ms`` of consecutive voiced frames and
``speech_stopped`` only after ``offset_ms`` of consecutive unvoiced ones.

Defaults: onset 60 ms (3 frames) keeps the barge-in fast; offset 200 ms
(10 frames) is the hangover after the last voiced frame before
speech_stopped. It does not end the user's turn: endpointing
(``voice.endpointing.EndpointConfig``, 500 ms of silence by default) does.
Known limit: webrtcvad also marks broadband noise and tones as speech; the
barge-in quality work adds a confirmation stage on top of this gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import webrtcvad
from pydantic import BaseModel, Field, model_validator

from media.frames import FRAME_MS, VAD_RATE, frame_bytes


class VadConfig(BaseModel):
    """VAD settings (env ``TURNKEEPER_VAD__*``).

    Attributes:
        aggressiveness: webrtcvad mode 0..3; 3 filters non-speech hardest.
        onset_ms: voiced run (ms, multiple of 20) before speech_started.
        offset_ms: unvoiced run (ms, multiple of 20) before speech_stopped.
        preroll_ms: audio kept from before speech_started for STT (ms).
    """

    aggressiveness: int = Field(2, ge=0, le=3)
    onset_ms: int = Field(60, ge=FRAME_MS, le=2000)
    offset_ms: int = Field(200, ge=FRAME_MS, le=5000)
    preroll_ms: int = Field(300, ge=0, le=2000)

    @model_validator(mode="after")
    def _multiples_of_frame(self) -> "VadConfig":
        for name in ("onset_ms", "offset_ms", "preroll_ms"):
            if getattr(self, name) % FRAME_MS:
                raise ValueError(f"{name} must be a multiple of {FRAME_MS} ms")
        return self

    @property
    def onset_frames(self) -> int:
        return self.onset_ms // FRAME_MS

    @property
    def offset_frames(self) -> int:
        return self.offset_ms // FRAME_MS

    @property
    def preroll_frames(self) -> int:
        return self.preroll_ms // FRAME_MS


class VadEventKind(StrEnum):
    """The two hysteresis decisions."""

    SPEECH_STARTED = "speech_started"
    SPEECH_STOPPED = "speech_stopped"


@dataclass(frozen=True)
class VadEvent:
    """A hysteresis decision.

    Attributes:
        kind: speech_started or speech_stopped.
        at: clock seconds of the frame that completed the decision.
        onset_at: clock seconds of the first frame of the run that led to it
            (for speech_started: the first voiced frame, i.e. speech onset).
    """

    kind: VadEventKind
    at: float
    onset_at: float


class VoiceActivityDetector:
    """One webrtcvad instance per inbound stream, plus hysteresis.

    Args:
        config: thresholds.
    """

    def __init__(self, config: VadConfig | None = None) -> None:
        self.config = config or VadConfig()
        self._vad = webrtcvad.Vad(self.config.aggressiveness)
        self._frame_bytes = frame_bytes(VAD_RATE)
        self.in_speech = False
        self._run = 0
        self._run_start = 0.0

    def is_voiced(self, frame: bytes) -> bool:
        """webrtcvad's verdict on one 20 ms frame of 16 kHz mono s16.

        Raises:
            ValueError: the frame is not exactly 640 bytes.
        """
        if len(frame) != self._frame_bytes:
            raise ValueError(f"VAD frame must be {self._frame_bytes} bytes (20 ms at 16 kHz), got {len(frame)}")
        return self._vad.is_speech(frame, VAD_RATE)

    def feed(self, frame: bytes, at: float) -> tuple[bool, VadEvent | None]:
        """Classify one frame received at clock time ``at`` (seconds).

        Returns:
            (voiced, event): the frame's verdict and a speech_started /
            speech_stopped event when hysteresis crosses a threshold.
        """
        voiced = self.is_voiced(frame)
        # Count the run of frames that disagree with the current state.
        if voiced != self.in_speech:
            if self._run == 0:
                self._run_start = at
            self._run += 1
        else:
            self._run = 0
        need = self.config.offset_frames if self.in_speech else self.config.onset_frames
        if self._run >= need:
            self.in_speech = not self.in_speech
            self._run = 0
            kind = VadEventKind.SPEECH_STARTED if self.in_speech else VadEventKind.SPEECH_STOPPED
            return voiced, VadEvent(kind=kind, at=at, onset_at=self._run_start)
        return voiced, None

    def reset(self) -> None:
        """Forget the current state (e.g. after push-to-talk took over)."""
        self.in_speech = False
        self._run = 0
