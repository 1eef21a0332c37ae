"""Voice activity on 20 ms frames: webrtcvad's verdict and its settings.

webrtcvad classifies each 20 ms frame of 16 kHz mono s16 as voiced or not
(the WebRTC VAD accepts 10, 20 or 30 ms frames at 8/16/32/48 kHz). A single
voiced frame is not speech: the barge-in detector (:mod:`media.bargein`)
builds its gate on these verdicts and decides ``SPEECH_STARTED`` (after
``BargeInConfig.pause_after_ms`` of gated frames and a speech-onset score)
and ``SPEECH_STOPPED`` (after ``offset_ms`` of frames that are not).

Defaults: offset 200 ms (10 frames) is the hangover after the last voiced
frame before speech_stopped. It does not end the user's turn: endpointing
(``voice.endpointing.EndpointConfig``, 500 ms of silence by default) does.
Known limit: webrtcvad also marks broadband noise and tones as speech; the
barge-in detector's confirmation stage filters them.
"""

from __future__ import annotations

import webrtcvad
from pydantic import BaseModel, Field, model_validator

from media.frames import FRAME_MS, VAD_RATE, frame_bytes


class VadConfig(BaseModel):
    """VAD settings (env ``TURNKEEPER_VAD__*``).

    Attributes:
        aggressiveness: webrtcvad mode 0..3; 3 filters non-speech hardest.
        offset_ms: unvoiced run (ms, multiple of 20) before speech_stopped.
        preroll_ms: audio kept from before speech_started for STT (ms).
    """

    aggressiveness: int = Field(2, ge=0, le=3)
    offset_ms: int = Field(200, ge=FRAME_MS, le=5000)
    preroll_ms: int = Field(300, ge=0, le=2000)

    @model_validator(mode="after")
    def _multiples_of_frame(self) -> VadConfig:
        for name in ("offset_ms", "preroll_ms"):
            if getattr(self, name) % FRAME_MS:
                raise ValueError(f"{name} must be a multiple of {FRAME_MS} ms")
        return self

    @property
    def offset_frames(self) -> int:
        return self.offset_ms // FRAME_MS

    @property
    def preroll_frames(self) -> int:
        return self.preroll_ms // FRAME_MS


class VoiceActivityDetector:
    """One webrtcvad instance per inbound stream.

    Args:
        config: its mode (``aggressiveness``).
    """

    def __init__(self, config: VadConfig | None = None) -> None:
        self.config = config or VadConfig()
        self._vad = webrtcvad.Vad(self.config.aggressiveness)
        self._frame_bytes = frame_bytes(VAD_RATE)

    def is_voiced(self, frame: bytes) -> bool:
        """webrtcvad's verdict on one 20 ms frame of 16 kHz mono s16.

        Raises:
            ValueError: the frame is not exactly 640 bytes.
        """
        if len(frame) != self._frame_bytes:
            raise ValueError(f"VAD frame must be {self._frame_bytes} bytes (20 ms at 16 kHz), got {len(frame)}")
        return self._vad.is_speech(frame, VAD_RATE)
