"""The barge-in decision: what a commit (the user taking the turn,
:class:`voice.turn_taking.Commit`) does to the turn the agent is answering.

- a reply heard in full (only the pause after its last word is queued) is no
  barge-in: that turn completes, the new one is just the next turn
  (:func:`interrupted_turn`);
- otherwise the old turn is stopped for ``barge_in`` (after its must-complete
  commit, if one is under way: ``stop_deferred``), its audio already
  silenced by the fence and the clear (:func:`barge_in`);
- a turn whose reply was not heard at all, that acted on nothing, and whose
  utterance ended within ``continue_window_ms`` of the new speech's onset is
  continued by the new turn: one reply answers both (:func:`continues`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from clock import Clock
from turn.event_catalogue import BargeIn, StopDeferred
from turn.events import EventSink
from turn.models import StopReason, StopReasonKind
from voice.transport import OutputSink
from voice.turn_handle import TurnHandle
from voice.turn_taking import Commit


@dataclass
class BargeInRecord:
    """One barge-in as the server saw it (clock seconds)."""

    old_turn_id: str
    old_generation: int
    new_generation: int
    onset_at: float
    fenced_at: float

    @property
    def onset_to_fence_ms(self) -> float:
        """Milliseconds from the first voiced frame's arrival to the fence."""
        return (self.fenced_at - self.onset_at) * 1000


def interrupted_turn(active: TurnHandle | None, playout: OutputSink) -> TurnHandle | None:
    """The turn a commit barges in on: ``active`` (the turn thinking or
    speaking), unless every frame of its reply is queued and none of those
    left has sound (the user heard it in full: it completes). A speculative
    turn whose end of turn is not confirmed is always returned (its reply is
    held, not heard: the commit takes it back)."""
    if active is not None and active.confirmed.is_set() and active.tts_done and not playout.audible_pending(active.generation):
        return None
    return active


def continues(old: TurnHandle, onset_at: float, played_samples: int, continue_window_ms: int) -> bool:
    """True if the new utterance (speech onset at clock seconds
    ``onset_at``) continues ``old``'s: nothing of ``old``'s reply was
    played (``played_samples`` 0), it was not merged already, it acted on
    nothing (no tool with an external effect), and its speech ended at most
    ``continue_window_ms`` before the onset."""
    return (
        played_samples == 0
        and not old.merged
        and not old.acted
        and old.speech_end_at is not None
        and onset_at - old.speech_end_at <= continue_window_ms / 1000
    )


def barge_in(
    old: TurnHandle,
    commit: Commit,
    *,
    old_generation: int,
    new_generation: int,
    fenced_at: float,
    cleared_frames: int,
    clock: Clock,
    send: EventSink,
) -> tuple[BargeInRecord, asyncio.Task[None]]:
    """Stop ``old`` for ``barge_in`` (its generation already fenced and its
    audio cleared) and tell the client: ``stop_deferred`` first if a
    must-complete commit of it is under way (it is stopped when the commit
    ends), then ``barge_in``.

    Args:
        old: the turn barged in on.
        commit: the turn-taking decision (initiator, onset, pause).
        old_generation / new_generation: the fence before and after.
        fenced_at: clock seconds of the fence.
        cleared_frames: 20 ms playout frames the clear dropped.
        clock: for the stop's time.
        send: the session's event sink.

    Returns:
        The record, and ``old``'s stop task (the new turn is written once it
        is done, so the log reads: old stopping, old cancelled, new running).
    """
    if old.committing:
        # A must-complete tool is committing: its audio is silenced (fenced,
        # cleared) now; the turn is stopped when the commit ends, and only
        # then does the new turn start.
        send(StopDeferred(turn_id=old.turn_id, generation=old_generation, why="must_complete"))
    after = old.stop(StopReason(kind=StopReasonKind.BARGE_IN, initiator=commit.initiator, at=clock.now()))
    rec = BargeInRecord(old.turn_id, old_generation, new_generation, commit.onset_at, fenced_at)
    send(BargeIn(
        generation=new_generation,
        old_turn_id=old.turn_id,
        old_generation=old_generation,
        initiator=commit.initiator,
        onset_to_fence_ms=round(rec.onset_to_fence_ms, 2),
        paused_ms=commit.paused_ms,
        cleared_ms=cleared_frames * 20,
    ))
    return rec, after
