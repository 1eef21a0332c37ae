"""The phone path's own figures for bench/bargein.py ``--transport twilio``
(or ``telnyx``): tooling for bench/, not part of the product.

- ``clear`` after the fence: each committed barge-in's ``clear`` reached
  the simulated provider after the server's fence (its ``barge_in``
  event's time, same machine clock; 2 ms of rounding allowed) and no
  later than ``CLEAR_WITHIN_MS`` after it; old audio played after it;
- heard text against what the caller's simulator played: the words of the
  interrupted reply whose audio the simulated ear played before the
  ``clear``, told with the server's own rule (:func:`voice.heard.heard_text`)
  on the reply re-synthesised sentence by sentence with the server's TTS
  (espeak-ng, default voice: the same samples), against the ``heard`` text
  the server kept from the marks; within one word is the target.
"""

from __future__ import annotations

from typing import Any

from client.results import BargeInMeasure, CallResult
from media.frames import PLAYOUT_RATE
from voice.heard import heard_text
from voice.text import SentenceSplitter
from voice.tts import EspeakTTS

CLEAR_WITHIN_MS = 40.0  # the clear leaves in the same 20 ms tick as the fence (+ socket time)

_lengths: dict[str, int] = {}


async def _sentence_samples(tts: EspeakTTS, sentence: str) -> int:
    if sentence not in _lengths:
        total = 0

        def sink(pcm: bytes) -> None:
            nonlocal total
            total += len(pcm) // 2

        await tts.synthesize(sentence, sink)
        _lengths[sentence] = total
    return _lengths[sentence]


async def spoken_timeline(reply: str) -> list[tuple[int, int, str]]:
    """(first sample, end sample, sentence) of ``reply`` as the server's
    TTS speaks it (48 kHz samples; its sentence splitting)."""
    splitter = SentenceSplitter()
    pieces = splitter.feed(reply)
    rest = splitter.flush()
    if rest:
        pieces.append(rest)
    tts = EspeakTTS()
    out, at = [], 0
    for p in pieces:
        n = await _sentence_samples(tts, p)
        out.append((at, at + n, p))
        at += n
    return out


def replies(result: CallResult) -> dict[str, str]:
    """Each turn's generated reply text (its ``agent.delta`` events), by turn id."""
    out: dict[str, str] = {}
    for ev in result.events:
        if ev.get("type") == "agent.delta" and ev.get("turn_id"):
            out[ev["turn_id"]] = out.get(ev["turn_id"], "") + ev["text"]
    return out


async def judge_heard(m: BargeInMeasure, reply: str) -> dict[str, Any] | None:
    """The words the ear played of ``m``'s interrupted reply against the
    server's heard text; None when either is unknown."""
    if m.played_ms_at_ear is None or m.server_heard is None or not reply:
        return None
    timeline = await spoken_timeline(reply)
    at_ear = heard_text(timeline, int(m.played_ms_at_ear * PLAYOUT_RATE / 1000))
    by_server_ms = heard_text(timeline, int((m.server_played_ms or 0) * PLAYOUT_RATE / 1000))
    return {
        "label": m.label,
        "played_ms_at_ear": round(m.played_ms_at_ear, 1),
        "server_played_ms": m.server_played_ms,
        "words_at_ear": len(at_ear.split()),
        "words_server_heard": len(m.server_heard.split()),
        "word_diff": abs(len(at_ear.split()) - len(m.server_heard.split())),
        # the re-synthesis reproduces the server's own heard text from its played_ms
        "resynthesis_matches": by_server_ms == m.server_heard,
    }


def clear_figures(barged: list[BargeInMeasure]) -> dict[str, Any]:
    """``clear`` after the fence over committed barge-ins."""
    with_clear = [m for m in barged if m.clear_after_fence_ms is not None]
    after = [m for m in with_clear if -2.0 <= (m.clear_after_fence_ms or 0.0) <= CLEAR_WITHIN_MS]
    return {
        "barge_ins": len(barged),
        "with_clear": len(with_clear),
        "clear_after_fence": len(after),
        "clear_after_fence_pct": round(100 * len(after) / len(barged), 1) if barged else None,
        "clear_after_fence_ms": sorted(m.clear_after_fence_ms for m in with_clear if m.clear_after_fence_ms is not None),
        "old_audio_after_clear_ms": sum(m.old_audio_after_clear_ms or 0.0 for m in barged),
    }
