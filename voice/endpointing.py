"""Endpointing: when the user's utterance is over.

:class:`EndpointConfig` holds the thresholds; :func:`end_at` and
:func:`utterance_over` are the two rules :mod:`voice.turn_taking` applies,
on clock seconds (the detector's times, :class:`media.bargein.DetectorEvent`).

Two modes (``mode``), as DESIGN.md's "end of turn" says:

- ``"silence"``: the turn ends after ``silence_ms`` of silence (the fixed
  rule, and the fallback of the other mode);
- ``"model"``: at a short silence (``tentative_ms``) the end-of-turn judge
  (:mod:`voice.end_of_turn`) reads the utterance's audio (and, for a
  speculative reply, the words heard): both "complete" ends the turn at
  once; finished words in audio the model finds incomplete wait up to
  ``unsure_silence_ms`` of silence; unfinished words ("can I get a") wait
  up to ``incomplete_silence_ms``, and so does a judge that has not
  answered; one that fails leaves the fixed rule (``silence_ms``) to
  decide.

With ``speculative`` on, the reply starts at the tentative end
(``tentative_ms``), before the end is confirmed: recognition is finalised
and the model and TTS run, but nothing is played or delivered, and no side
effect runs, until the end is confirmed; if the user goes on first, the
speculative turn is taken back (stop reason ``speculation_withdrawn``) and
its words join the next turn (DESIGN.md "speculative turn").
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from voice.end_of_turn import EndOfTurnConfig

#: how the end of the user's turn is decided (see the module doc)
EndpointMode = Literal["model", "silence"]


class EndpointConfig(BaseModel):
    """Endpointing: when the user's turn is over (env
    ``TURNKEEPER_SESSION__ENDPOINT__*``).

    After speech_stopped (the VAD's ``offset_ms`` of non-speech), the turn
    ends once the user has been silent ``silence_ms`` since the end of their
    speech; the wait after speech_stopped is kept within ``min_delay_ms`` and
    ``max_delay_ms``. Speech confirmed again inside that wait continues the
    same utterance. ``max_delay_ms`` also ends a turn whose detector keeps
    seeing sound (a noisy room) that long after the last confirmed speech,
    and ``max_utterance_ms`` ends one that never stops.

    Attributes:
        mode: ``"model"`` (the end-of-turn judge) or ``"silence"`` (see the module doc).
        speculative: start the reply at the tentative end (see the module doc).
        tentative_ms: silence after the end of speech at which the judge
            reads the audio and a speculative reply starts, ms (taken no
            sooner than the VAD's speech_stopped, which comes ``offset_ms``
            after the end of speech).
        unsure_silence_ms: mode ``"model"``: silence after the end of
            speech that ends a turn whose words sound finished but whose
            audio the judge found incomplete, ms. Over the turn corpus
            (mid-sentence pauses of 400-800 ms) at the client, 1000 cut off
            1 pause in 26 (800: 2 and 3 in two runs, misheard words making
            half sentences sound finished); see docs/end-of-turn.md.
        decode_at_ms: silence after the end of speech at which the
            recogniser starts decoding the utterance so far, tentatively,
            ms (kept as its final if no speech follows; one the user talks
            over is thrown away). At or above the VAD's ``offset_ms`` it
            starts at speech_stopped.
        incomplete_silence_ms: mode ``"model"``: silence after the end of
            speech that ends a turn whose words are unfinished (or whose
            audio the judge found incomplete with no words known), ms.
        judge: the end-of-turn model's settings (mode ``"model"``; env
            ``TURNKEEPER_SESSION__ENDPOINT__JUDGE__THRESHOLD``, ...).
        silence_ms: silence after the end of speech that ends the turn, ms
            (mode ``"silence"``; mode ``"model"``: the fallback when the
            judge fails).
        min_delay_ms / max_delay_ms: bounds of the wait after speech_stopped, ms.
        max_utterance_ms: longest user utterance, ms.
        continue_window_ms: speech confirmed this soon after the end of the
            previous utterance, whose reply has not been heard at all yet,
            continues it: that reply is cancelled (it never plays) and one
            reply answers both parts, ms. A turn that already called a tool
            is never merged (its words were acted on; the ledger has them).
    """

    mode: EndpointMode = "model"
    speculative: bool = True
    tentative_ms: int = Field(200, ge=0, le=10_000)
    unsure_silence_ms: int = Field(1000, ge=0, le=30_000)
    decode_at_ms: int = Field(200, ge=20, le=10_000)
    incomplete_silence_ms: int = Field(1500, ge=0, le=30_000)
    judge: EndOfTurnConfig = EndOfTurnConfig()
    silence_ms: int = Field(500, ge=0, le=10_000)
    continue_window_ms: int = Field(1500, ge=0, le=30_000)
    min_delay_ms: int = Field(0, ge=0, le=10_000)
    max_delay_ms: int = Field(3000, ge=0, le=30_000)
    max_utterance_ms: int = Field(60_000, ge=1000, le=600_000)

    @model_validator(mode="after")
    def _ordered(self) -> EndpointConfig:
        if self.min_delay_ms > self.max_delay_ms:
            raise ValueError("endpoint min_delay_ms must not exceed max_delay_ms")
        if not self.tentative_ms <= self.unsure_silence_ms <= self.incomplete_silence_ms:
            raise ValueError("endpoint tentative_ms <= unsure_silence_ms <= incomplete_silence_ms must hold "
                             "(the surer the judge, the shorter the wait)")
        if self.tentative_ms > self.silence_ms:
            raise ValueError("endpoint tentative_ms must not exceed silence_ms (the tentative end comes first)")
        return self

    @property
    def tentative(self) -> bool:
        """A tentative end comes before the confirmed one (the judge reads
        the audio, or a speculative reply starts, or both)."""
        return self.mode == "model" or self.speculative


def end_at(config: EndpointConfig, stopped_at: float, speech_end: float) -> float:
    """When the utterance ends (clock seconds), decided at speech_stopped
    (``stopped_at``, clock seconds) for speech that ended at ``speech_end``:
    ``silence_ms`` after the end of speech, the wait after ``stopped_at``
    kept within ``min_delay_ms`` and ``max_delay_ms``."""
    wait = speech_end + config.silence_ms / 1000 - stopped_at
    wait = min(max(wait, config.min_delay_ms / 1000), config.max_delay_ms / 1000)
    return stopped_at + wait


def utterance_over(
    config: EndpointConfig, at: float, *, end: float | None, last_speech_at: float, utterance_at: float
) -> bool:
    """True if the utterance being listened to is over at ``at`` (clock
    seconds): its end (:func:`end_at`, None if not armed) has come, or no
    speech was confirmed for ``max_delay_ms + silence_ms`` since
    ``last_speech_at`` (a noisy room), or it began (``utterance_at``) more
    than ``max_utterance_ms`` ago."""
    return (
        (end is not None and at >= end)
        or at - last_speech_at > (config.max_delay_ms + config.silence_ms) / 1000
        or at - utterance_at > config.max_utterance_ms / 1000
    )
