"""What the user actually heard of a reply: the sentences sent to TTS (with
their exact first and end samples) against how far playout got. Only that
part is kept as the turn's reply, told to the client when it is interrupted
and shown to every later model call (:mod:`voice.history`)."""

from __future__ import annotations

from turn.event_catalogue import AgentInterrupted
from voice.transport import OutputSink
from voice.turn_handle import TurnHandle


def heard_text(spoken: list[tuple[int, int, str]], played: int) -> str:
    """The text of the sentences in ``spoken`` whose audio had been played
    up to sample ``played``, cut to whole words.

    Each sentence's first and end sample are exact (each is synthesised on
    its own, so they are sentence marks). Inside the sentence being played,
    word boundaries are estimated: a word counts as heard when the share of
    the sentence's samples played reaches the share of its characters up to
    that word's end (speech time is close to proportional to letters; a half
    heard word is left out).

    Args:
        spoken: (first sample, end sample, text) per sentence, in order.
        played: samples of this generation's audio that left the buffer.
    """
    out: list[str] = []
    for start, end, text in spoken:
        if played >= end:
            out.append(text.strip())
            continue
        if played > start and end > start:
            share = (played - start) / (end - start)
            words = text.split()
            total = len(" ".join(words))
            kept: list[str] = []
            upto = 0
            for w in words:
                upto += len(w) + (1 if kept else 0)
                if upto / total > share:
                    break
                kept.append(w)
            if kept:
                out.append(" ".join(kept))
        break
    return " ".join(t for t in out if t)


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
        return heard_text(run.spoken, self.playout.played_samples(run.generation))

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
