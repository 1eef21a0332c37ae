"""Backchannels: short replies a listener gives without taking the turn
("uh-huh", "okay", "yeah right") while the agent speaks.

Two parts, each usable alone:

- :class:`BackchannelConfig`: the thresholds and the word list, and
  :meth:`BackchannelConfig.matches` (is a transcript only backchannel words);
- :func:`judge`: the rule that turns what the recogniser heard, the
  utterance's length and its syllable count into a verdict (pure).

What the recogniser heard comes from the session's transcription
(:meth:`voice.transcription.Utterance.heard`: an interim that covers the
speech, else its final).

When to ask (an utterance made while the agent speaks ended within
``max_ms``) and what a verdict does (resume the paused reply, or commit the
barge-in) is :mod:`voice.turn_taking`'s business.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field

#: short replies a listener gives without taking the turn (lower case, no
#: punctuation; hyphens and spaces are equivalent)
DEFAULT_BACKCHANNELS = (
    "uh huh", "mm hmm", "mhm", "hmm", "hm", "mm", "aha", "uh", "um", "huh", "ah", "oh", "eh",
    "yeah", "yes", "yep", "yup", "okay", "ok", "right", "sure", "alright", "all right", "i see", "got it",
)


#: a hum however it is spelt: m, h and u only, with an m or an h ("mm-m-hmm" is "mm m hmm")
HUM = re.compile(r"(?=[muh]*[mh])[muh]+")


class BackchannelConfig(BaseModel):
    """Backchannels (env ``TURNKEEPER_SESSION__BACKCHANNEL__*``): short
    utterances such as "uh-huh" or "okay" while the agent speaks, which tell
    it to go on rather than to stop.

    An utterance made while the agent speaks is a backchannel when it ends
    (speech_stopped) no more than ``max_ms`` after its onset and every word
    the recogniser heard in it is in ``words`` (or it heard none), and it has
    no more than ``max_syllables`` syllable nuclei. The agent's
    paused audio then resumes; the utterance is not added to the next user
    turn. Longer speech commits the barge-in the moment it passes ``max_ms``.

    Attributes:
        enabled: on by default; off, confirmed speech commits at once.
        max_ms: longest backchannel, ms from speech onset to its end.
            1000: a drawn-out "mm-hmm" or "okay" runs 0.7-0.9 s (espeak-ng
            at 120-140 wpm; at 700 they cancelled the reply). Longer speech
            is not held back by it: more syllables than ``max_syllables``
            commit at its end without waiting for the recogniser, and a
            word that is no backchannel commits as soon as it is heard.
        unrecognised_max_ms: an utterance in which the recogniser heard no
            word at all is a backchannel only up to this long (ms): longer,
            it is speech the recogniser failed on, and it barges in.
        rejoin_ms: speech confirmed this soon (ms) after a backchannel was
            let go may be the user going on after a pause inside one
            utterance ("yeah ... but", "uh ... huh"): it is judged with the
            backchannel's words (only backchannel words: one again; any
            other word: it commits, and the short part is not added to the
            turn).
        decide_after_ms: a confirmed candidate is judged after this many ms
            of frames the gate did not pass, before the VAD's speech_stopped
            (``offset_ms``, 200); a gated frame after that is the user going
            on, and the judgement is dropped. At or above ``offset_ms``:
            judged at speech_stopped.
        resume_after_ms: a backchannel lets the paused reply go on no
            sooner than this long (ms) after its speech ended (and not while
            the gate is open): a shorter pause inside an utterance ("uh ...
            huh", "yeah ... but") then never plays the reply between its
            words. Issue 32 asks the reply back within 300 ms of the
            backchannel's end, as the caller hears it. In 40 WebRTC soak
            calls (bench/soak.py) ``decide_after_ms`` 60 and 150 here gave
            p50 204 / p95 285 ms after the end, none cancelled; 100 and 200
            gave 243 / 346 in 29 (the short decode's 70-100 ms and the way
            to the caller come on top).
        max_syllables: an utterance with more syllable nuclei than this
            (counted from the audio, :mod:`media.syllables`) is speech,
            whatever the recogniser made of it: a fast "can you tell me a
            story" fits in ``max_ms``, and a recogniser can hear nothing or
            "yeah" in it. Backchannels have one to three ("mm-hmm": 3).
        words: the word list.
    """

    enabled: bool = True
    max_ms: int = Field(1000, ge=100, le=3000)
    unrecognised_max_ms: int = Field(550, ge=0, le=3000)
    max_syllables: int = Field(3, ge=1, le=20)
    rejoin_ms: int = Field(600, ge=0, le=10_000)
    decide_after_ms: int = Field(60, ge=20, le=5000)
    resume_after_ms: int = Field(150, ge=0, le=5000)
    words: list[str] = Field(default_factory=lambda: list(DEFAULT_BACKCHANNELS))

    def matches(self, text: str) -> bool:
        """True if ``text`` (a transcript) is empty or made only of
        backchannel words and phrases ("uh-huh", "okay okay", "yeah right")
        and hums: a word of the letters m, h and u only, with an m or an h
        ("mm-m-hmm", "hmmm", "uhh", "mhm"), as Whisper spells a hum many
        ways, while enabled and ``words`` keeps "mm" (a deployment that drops
        the hums from ``words`` drops these too)."""
        words = normalise(text).split()
        phrases = {tuple(normalise(w).split()) for w in self.words} - {()}
        hums = ("mm",) in phrases
        i = 0
        while i < len(words):
            for n in sorted({len(p) for p in phrases}, reverse=True):
                if tuple(words[i : i + n]) in phrases:
                    i += n
                    break
            else:
                if hums and HUM.fullmatch(words[i]):
                    i += 1
                    continue
                return False
        return True


def normalise(text: str) -> str:
    """Lower case, hyphens as spaces, letters, digits and apostrophes only."""
    cleaned = "".join(c if c.isalnum() or c == "'" else " " for c in text.lower().replace("-", " "))
    return " ".join(cleaned.split())


def judge(config: BackchannelConfig, text: str | None, speech_ms: int, syllables: int) -> dict[str, Any] | None:
    """The verdict on a short utterance made while the agent spoke.

    Args:
        config: the thresholds and words.
        text: what the recogniser heard in it ("" for no word), or None if
            recognition failed (then it is taken as speech: a barge-in).
        speech_ms: its speech's length, ms (onset to speech_stopped).
        syllables: its syllable nuclei (:func:`media.syllables.count_syllable_nuclei`).

    Returns:
        ``{"text": text, "syllables": syllables}`` (the ``backchannel``
        event's payload) if it is a backchannel, else None.
    """
    if (
        text is not None
        and config.matches(text)
        and (text.strip() or speech_ms <= config.unrecognised_max_ms)
        and syllables <= config.max_syllables
    ):
        return {"text": text, "syllables": syllables}
    return None
