"""What the user actually heard of a reply: the clauses sent to TTS (with
their exact first and end samples, and the provider's word timings where
it gives them) against how far playout got. Only that
part is kept as the turn's reply, told to the client when it is interrupted
and shown to every later model call (:mod:`voice.history`)."""

from __future__ import annotations

from turn.event_catalogue import AgentInterrupted
from voice.transport import OutputSink
from voice.turn_handle import TurnHandle

#: an unfinished clause without word timings is taken to last this long
#: per character, samples at 48 kHz (about 165 words a minute)
SAMPLES_PER_CHAR = 48_000 // 14

Mark = tuple[int, int, str]


def heard_text(
    spoken: list[Mark], played: int, words: list[Mark] | None = None, open_segment: Mark | None = None,
) -> str:
    """The text of the reply whose audio had been played up to sample
    ``played`` (48 kHz, of this generation), cut to whole words.

    Each clause's first and end sample are exact (``spoken``: a
    synthesiser's :class:`voice.synthesis.SegmentDone` marks its end). A
    clause with provider word timings inside it (``words``: ElevenLabs'
    alignment, Cartesia's timestamps) is cut at the last word whose end was
    played. In a clause without them, word boundaries are estimated: a word
    counts as heard when the share of the clause's samples played reaches
    the share of its characters up to that word's end (speech time is close
    to proportional to letters; a half heard word is left out). The clause
    still arriving when the reply stopped (``open_segment``: its first
    sample, the last sample received, its text) is cut by its words if it
    has them, else estimated against the longer of what arrived and
    :data:`SAMPLES_PER_CHAR` per character.

    Args:
        spoken: (first sample, end sample, text) per finished clause, in order.
        played: samples of this generation's audio that left the buffer.
        words: (first sample, end sample, word) per timed word, any order.
        open_segment: the unfinished clause, or None.
    """
    timed = sorted(words or [])
    segments = list(spoken)
    if open_segment is not None:
        start, received, text = open_segment
        segments.append((start, max(received, start + SAMPLES_PER_CHAR * len(text)), text))
    out: list[str] = []
    for start, end, text in segments:
        inside = [w for w in timed if start <= w[0] < end]
        if inside:
            heard = [w[2] for w in inside if w[1] <= played]
            out.extend(heard)
            if len(heard) < len(inside):
                break
            continue
        if played >= end:
            out.append(text.strip())
            continue
        if played > start and end > start:
            out.extend(_estimate(text, (played - start) / (end - start)))
        break
    return " ".join(t for t in out if t)


def _estimate(text: str, share: float) -> list[str]:
    """The words of ``text`` heard when ``share`` (0..1) of its samples were
    played, by characters (see :func:`heard_text`)."""
    words = text.split()
    total = len(" ".join(words))
    kept: list[str] = []
    upto = 0
    for w in words:
        upto += len(w) + (1 if kept else 0)
        if upto / total > share:
            break
        kept.append(w)
    return kept


class Hearing:
    """What the user heard of each turn's reply, from one playout buffer.

    Args:
        playout: the session's playout buffer (its played position per
            generation, samples at ``playout.rate``).
    """

    def __init__(self, playout: OutputSink) -> None:
        self.playout = playout

    def heard(self, run: TurnHandle) -> str:
        """The part of ``run``'s reply whose audio actually left the playout
        buffer (see :func:`heard_text`)."""
        return heard_text(run.spoken, self.playout.played_samples(run.generation), run.spoken_words, run.spoken_open)

    def split(self, run: TurnHandle) -> tuple[str, str]:
        """``run``'s generated reply split into what was heard (its audio
        left the playout buffer, :meth:`heard`) and the rest, which nobody
        heard: (heard, unheard), each "" if empty. The heard part is a
        whole-word prefix of the reply."""
        words = "".join(run.reply).split()
        heard = self.heard(run)
        n = len(heard.split())
        return heard, " ".join(words[n:])

    def interrupted(self, run: TurnHandle) -> AgentInterrupted | None:
        """The ``agent.interrupted`` event (of ``run``'s turn and generation)
        that tells the client, once, how much of ``run``'s interrupted reply was heard
        (``heard``; ``played_ms``; ``reply_chars``, the whole reply's length),
        or None if there is nothing to tell (no transcript, told already, or
        merged into a later turn). That heard part, and only that, is what
        the store keeps as the reply and every later history shows."""
        if not run.transcript or run.told_interrupted or run.merged:
            return None
        run.told_interrupted = True
        played = self.playout.played_samples(run.generation)
        return AgentInterrupted(
            turn_id=run.turn_id, generation=run.generation, heard=self.heard(run),
            played_ms=round(played * 1000 / self.playout.rate), reply_chars=len("".join(run.reply).strip()),
        )
