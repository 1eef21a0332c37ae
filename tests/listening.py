"""Listening to a received reply as a caller does: silence a stimulus
inserted into the agent's speech, told apart from the reply's own pauses.

A reception is the client's list of received 20 ms frames, in order, each
``(arrival, dBFS, sound_end_ms)`` (see ``client.results.CallResult.received``):
RTP arrival in client-clock seconds, the frame's RMS level in dBFS, and where
in the frame its sound ends (ms from the frame's start, 0 when silent).

The reply itself pauses between words and sentences (espeak-ng, and up to
120 ms kept after each sentence by ``media/trim.py``), so a silent run of
100 ms or more is not by itself a gap. The measure aligns on **sound time**:
each silent run is placed by the amount of agent sound (ms of frames louder
than ``SILENCE_DBFS``) received since the reply's first sound, and compared
with the run at the same sound-time position of a *reference* reception of
the same reply without any stimulus (the story is deterministic, and its
reception is the same frame for frame from one undisturbed call to the
next). The inserted gap at that point is the received run minus the
reference's run there (0 when the reference has none: a cut in mid-word).

Alignment: runs are matched in order, each reference run at most once, to
the nearest reference run within ``tolerance_ms`` of sound time (default
60 ms: a pause adds a frame or two of codec tail and fade, which shifts later
sound time a little; the offset of each match is carried to the next, so
such shifts do not add up). A received run that a later run matches more
closely is left unmatched (a cut just before a natural pause). A final run
still silent when the reception ends is not a gap: it is a **stop** if it is
at least ``stop_ms`` longer than the reference's pause there, else the
reception merely ended inside a pause.

Inserted gaps under about 40 ms are measurement noise (Opus smear, one
frame); the verdicts use 100 ms.

Replays: a reply that paused for a noise or a backchannel goes on from the
start of the word it paused in (its ``false_interruption``/``backchannel``
event's ``replayed_ms``), so its first ``replayed_ms`` of sound after the
pause were heard before; :func:`without_replays` takes them out of the
reception so that sound time stays aligned with the reference (the silence
the caller heard is unchanged).

Everything here is pure (no I/O); times are client-clock seconds, lengths ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SILENCE_DBFS = -50.0  # as client/call.py: a received frame quieter than this is silence
FRAME_MS = 20.0
TOLERANCE_MS = 60.0
STOP_MS = 500.0  # as client/call.py's SILENT_RUN_MS
GAP_MS = 100.0  # an inserted silence this long or longer is audible

KEPT = "kept talking"
RESUMED = "paused and resumed"
STOPPED = "stopped"

Frame = tuple[float, float, float]


@dataclass(frozen=True)
class SilentRun:
    """A run of silent received frames inside the reply.

    Attributes:
        sound_ms: agent sound received before it, ms (sound frames x 20 ms,
            counted from the reply's first sound frame).
        length_ms: its silence, ms: its frames x 20 ms plus the silent end of
            the frame before it (20 ms minus where that frame's sound ends).
        start_at: where the sound before it ends, client seconds (arrival of
            the last sound frame plus its sound end).
        end_at: arrival of the first sound frame after it, client seconds;
            None if the reception ended inside it (an open run).
    """

    sound_ms: float
    length_ms: float
    start_at: float
    end_at: float | None = None

    @property
    def open(self) -> bool:
        return self.end_at is None


@dataclass(frozen=True)
class Gap:
    """One received silent run set against the reference.

    Attributes:
        run: the received run.
        reference_ms: the reference's silence at the same sound time, ms (0:
            none there).
        inserted_ms: ``run.length_ms - reference_ms``, at least 0.
    """

    run: SilentRun
    reference_ms: float
    inserted_ms: float


@dataclass
class Listening:
    """What a caller heard in a stretch of a reception.

    Attributes:
        gaps: each closed silent run of the stretch against the reference
            (natural pauses come out with ``inserted_ms`` about 0).
        stopped_at: client seconds where the agent's sound ended for good
            (the start of a final open run judged a stop), else None.
        open_run: the final open run, if the reception ended in silence.
        beyond_reference: ms of sound time in the reception that the
            reference does not cover; 0 is good.
        unjudged: closed runs of the stretch past the reference's cover (not
            in ``gaps``: their natural length is unknown).
    """

    gaps: list[Gap] = field(default_factory=list)
    stopped_at: float | None = None
    open_run: SilentRun | None = None
    beyond_reference: float = 0.0
    unjudged: int = 0

    @property
    def max_gap_ms(self) -> float:
        """The longest inserted silence, ms (0.0 if none)."""
        return max((g.inserted_ms for g in self.gaps), default=0.0)

    def inserted(self, at_least_ms: float = GAP_MS) -> list[float]:
        """The inserted silences at least ``at_least_ms`` long, ms, in order."""
        return [g.inserted_ms for g in self.gaps if g.inserted_ms >= at_least_ms]

    def outcome(self, gap_ms: float = GAP_MS) -> str:
        """``stopped`` (went silent and did not resume), ``paused and
        resumed`` (an inserted silence of ``gap_ms`` or more, then the reply
        went on) or ``kept talking``."""
        if self.stopped_at is not None:
            return STOPPED
        return RESUMED if self.max_gap_ms >= gap_ms else KEPT

    def as_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome(),
            "max_gap_ms": round(self.max_gap_ms, 1),
            "gaps_ms": [round(v, 1) for v in self.inserted(40.0)],
            "stopped": self.stopped_at is not None,
            "beyond_reference_ms": self.beyond_reference,
            "unjudged_runs": self.unjudged,
        }


def without_replays(frames: Sequence[Frame], replays: Sequence[tuple[float, float]]) -> list[Frame]:
    """The reception without the sound the agent played a second time.

    Args:
        frames: the reception (see the module doc).
        replays: ``(event arrival s, replayed ms)`` per resume that went back
            to the start of the word it paused in (the ``replayed_ms`` of a
            ``false_interruption`` or ``backchannel`` event).

    Returns:
        ``frames`` without, for each replay, the first ``replayed ms`` of
        sound frames from where the sound came back after a silent frame,
        at or after 50 ms before the event's arrival (the audio and the
        event leave the server together and may arrive in either order).
    """
    out = list(frames)
    for at, ms in sorted(replays):
        n = int(round(ms / FRAME_MS))
        if n <= 0:
            continue
        for i in range(1, len(out)):
            if out[i][0] >= at - 0.05 and out[i][1] > SILENCE_DBFS and out[i - 1][1] <= SILENCE_DBFS:
                j = i
                while j < len(out) and j - i < n and out[j][1] > SILENCE_DBFS:
                    j += 1
                del out[i:j]
                break
    return out


def replays_of(event_times: Sequence[tuple[float, dict[str, Any]]]) -> list[tuple[float, float]]:
    """``(arrival s, replayed ms)`` of each resume from the start of a word,
    from a call's ``event_times``."""
    return [(at, float(e["replayed_ms"])) for at, e in event_times
            if e.get("type") in ("false_interruption", "backchannel") and e.get("replayed_ms")]


def silent_runs(frames: Sequence[Frame], *, until: float | None = None, threshold: float = SILENCE_DBFS) -> list[SilentRun]:
    """The silent runs of a reception after its first sound frame.

    Args:
        frames: the reception, ``(arrival s, dBFS, sound end ms)`` per 20 ms
            frame, in order.
        until: ignore frames arriving after this (client seconds), e.g. where
            a newer turn's reply may begin; a run silent at that point is open.
        threshold: a frame at or below this level (dBFS) is silent.

    Returns:
        The runs in order; only the last can be open. Silence before the
        first sound frame is not a run. Empty if there is no sound.
    """
    if until is not None:
        frames = [f for f in frames if f[0] <= until]
    runs: list[SilentRun] = []
    sound = 0.0
    i, n = 0, len(frames)
    while i < n and frames[i][1] <= threshold:
        i += 1
    while i < n:
        if frames[i][1] > threshold:
            sound += FRAME_MS
            i += 1
            continue
        j = i
        while j < n and frames[j][1] <= threshold:
            j += 1
        prev = frames[i - 1]
        length = (j - i) * FRAME_MS + (FRAME_MS - min(FRAME_MS, prev[2]))
        runs.append(SilentRun(sound, length, prev[0] + prev[2] / 1000, frames[j][0] if j < n else None))
        i = j
    return runs


def sound_ms(frames: Sequence[Frame], *, until: float | None = None, threshold: float = SILENCE_DBFS) -> float:
    """Agent sound in a reception, ms (sound frames x 20 ms)."""
    return sum(FRAME_MS for at, lv, _ in frames if lv > threshold and (until is None or at <= until))


def align(runs: Sequence[SilentRun], reference: Sequence[SilentRun], *, tolerance_ms: float = TOLERANCE_MS) -> list[Gap]:
    """Set each closed received run against the reference's run at the same
    sound time (see the module doc for the matching rule).

    Args:
        runs: received runs, in order (an open run is skipped).
        reference: the reference's closed runs, in order.
        tolerance_ms: how far apart in sound time (ms) two runs may be and
            still be the same pause.

    Returns:
        One :class:`Gap` per closed received run, in order.
    """
    ref = [r for r in reference if not r.open]
    closed = [r for r in runs if not r.open]
    out: list[Gap] = []
    drift = 0.0  # received sound time minus the reference's, at the last match
    j = 0
    for i, run in enumerate(closed):
        target = run.sound_ms - drift
        while j < len(ref) and ref[j].sound_ms < target - tolerance_ms:
            j += 1
        best: int | None = None
        k = j
        while k < len(ref) and ref[k].sound_ms <= target + tolerance_ms:
            if best is None or abs(ref[k].sound_ms - target) < abs(ref[best].sound_ms - target):
                best = k
            k += 1
        if best is not None and i + 1 < len(closed):
            nxt = closed[i + 1].sound_ms - drift
            if abs(ref[best].sound_ms - nxt) < abs(ref[best].sound_ms - target):
                best = None  # the next run is that pause; this one was inserted before it
        if best is None:
            out.append(Gap(run, 0.0, run.length_ms))
            continue
        drift = run.sound_ms - ref[best].sound_ms
        j = best + 1
        out.append(Gap(run, ref[best].length_ms, max(0.0, run.length_ms - ref[best].length_ms)))
    return out


def listen(
    frames: Sequence[Frame],
    reference: Sequence[Frame],
    *,
    since: float | None = None,
    until: float | None = None,
    tolerance_ms: float = TOLERANCE_MS,
    stop_ms: float = STOP_MS,
) -> Listening:
    """Judge the stretch ``[since, until]`` of a reception against a
    reference reception of the same reply.

    Args:
        frames: the reception (see the module doc).
        reference: a reception of the same reply with no stimulus; it must
            cover the sound time of the stretch (``beyond_reference`` tells
            how much it does not).
        since: client seconds; runs that end before it are left out (a run
            going on at ``since`` is in). None: from the first sound.
        until: client seconds; frames after it are ignored. None: all.
        tolerance_ms: see :func:`align`.
        stop_ms: a final open run this much longer than the reference's
            pause there is a stop, ms.

    Returns:
        The :class:`Listening`. A reception without any sound gives no gaps
        and no stop.
    """
    runs = silent_runs(frames, until=until)
    ref_runs = silent_runs(reference)
    extent = sound_ms(reference)
    if ref_runs and ref_runs[-1].open:
        extent = ref_runs[-1].sound_ms  # how long that last pause is, it does not tell
    covered = extent - tolerance_ms
    result = Listening()
    gaps = align(runs, ref_runs, tolerance_ms=tolerance_ms)
    result.beyond_reference = max(0.0, sound_ms(frames, until=until) - extent)
    for g in gaps:
        if since is not None and g.run.end_at is not None and g.run.end_at < since:
            continue
        if g.run.sound_ms > covered:
            result.unjudged += 1
            continue
        result.gaps.append(g)
    if runs and runs[-1].open:
        last = runs[-1]
        result.open_run = last
        # the reference's pause there, matched as if the run had closed
        as_closed = [*runs[:-1], SilentRun(last.sound_ms, last.length_ms, last.start_at, last.start_at)]
        natural = align(as_closed, ref_runs, tolerance_ms=tolerance_ms)[-1].reference_ms
        if last.length_ms - natural >= stop_ms:
            result.stopped_at = last.start_at
    return result


def reply_starts(event_times: Sequence[tuple[float, dict[str, Any]]]) -> list[tuple[float, int, str | None]]:
    """Where each turn's reply may begin: per generation after the call's
    first, the arrival (client seconds) of its first transcript or reply
    text, with the generation and its transcript (None if not known then).
    Audio after it may be that turn's reply. In order of arrival."""
    first: int | None = None
    seen: dict[int, int] = {}
    out: list[tuple[float, int, str | None]] = []
    for at, ev in event_times:
        gen = ev.get("generation")
        kind = ev.get("type")
        if not isinstance(gen, int) or kind not in ("turn", "transcript", "agent.delta"):
            continue
        text = ev.get("text") if kind == "transcript" else ev.get("transcript")
        if first is None:
            first = gen
        elif gen > first and gen not in seen and (kind != "turn" or text):
            seen[gen] = len(out)
            out.append((at, gen, text))
            continue
        if gen in seen and text and out[seen[gen]][2] is None:
            out[seen[gen]] = (out[seen[gen]][0], gen, text)
    return out


def newer_turn_at(event_times: Sequence[tuple[float, dict[str, Any]]]) -> float | None:
    """Where a reply to a turn newer than the call's first may begin
    (:func:`reply_starts`), client seconds, or None."""
    starts = reply_starts(event_times)
    return starts[0][0] if starts else None


def judge_call(
    result: Any, reference: Sequence[Frame], *, whole_reply: bool = False, same_reply: Any = None, **kw: Any
) -> list[Listening | None]:
    """Judge each measured stimulus of a call against a reference reception,
    and fill its ``gap_ms`` and ``outcome``.

    Args:
        result: a ``client.results.CallResult`` (its ``received``, ``event_times``,
            ``turns`` and ``barge_ins`` are read; each ``BargeInMeasure``'s
            ``gap_ms`` (ms, the longest inserted silence) and ``outcome`` are
            set).
        reference: a reception of the call's first reply with no stimulus.
        whole_reply: judge the first stimulus from the reply's first sound,
            not from when it started (a speakerphone's echo is there all
            along).
        same_reply: ``f(transcript) -> bool``: a newer turn with this
            transcript gets the same reply as the first (its reception is
            judged against the same reference, sound time counted from its
            own first sound). Default: the same transcript as the first turn.
        kw: passed to :func:`listen` (``tolerance_ms``, ``stop_ms``).

    Returns:
        One :class:`Listening` per measure, in order, or None (left
        unjudged: ``gap_ms`` and ``outcome`` stay None) for one that was not
        sent, or that was sent over another reply. A stimulus is judged from
        its first sample sent up to the next one's, or to where a newer
        turn's reply may begin (:func:`reply_starts`): a reply superseded by
        a newer turn is ``stopped`` (it never resumes).
    """
    first_text = result.turns[0].transcript if getattr(result, "turns", None) else None
    if same_reply is None:
        same_reply = lambda text: text == first_text  # noqa: E731
    starts = reply_starts(result.event_times)
    out: list[Listening | None] = []
    measures = list(result.barge_ins)
    for k, m in enumerate(measures):
        since = None if whole_reply and k == 0 else m.sent_from
        if m.sent_from is None:
            out.append(None)
            continue
        # the reply the stimulus was played over: the first, or the newest begun before it
        began = [s for s in starts if since is not None and s[0] <= since]
        seg_from = began[-1][0] if began else None
        if began and not same_reply(began[-1][2]):
            out.append(None)
            continue
        cut = next((s[0] for s in starts if seg_from is None or s[0] > seg_from), None)
        received = without_replays(result.received, replays_of(result.event_times))
        frames = received if seg_from is None else [f for f in received if f[0] > seg_from]
        until = measures[k + 1].sent_from if k + 1 < len(measures) else None
        superseded = cut is not None and (until is None or cut <= until)
        if superseded:
            until = cut
        heard = listen(frames, reference, since=since, until=until, **kw)
        if superseded and heard.stopped_at is None:
            heard.stopped_at = heard.open_run.start_at if heard.open_run is not None else until
        if heard.unjudged:  # part of the stretch is past the reference: no figure to vouch for
            m.gap_ms, m.outcome = None, STOPPED if heard.stopped_at is not None else None
        else:
            m.gap_ms = round(heard.max_gap_ms, 1)
            m.outcome = heard.outcome()
        out.append(heard)
    return out
