"""What a stop does with a turn's side effects: the policy per stop reason
and per stage (DESIGN.md "stop reason", "side effect").

Stopping is domain policy. What happens to an effect depends on

- the stop's reason (:class:`turn.models.StopReasonKind`): a barge-in means
  "I want to speak now", not "undo what you did"; a user who stops a turn
  in flight may want what it was in the middle of undone, but a stop after
  a step committed is a no-op for that step, not a rollback; a safety abort
  means the turn should not have acted at all; a server that shuts down
  was not asked to undo anything;
- the tool's class (its declared effect): ``none`` (a read: safe to
  abandon), ``complete`` (must finish once started) or ``compensate``
  (reversible by its compensation);
- the effect's stage at the stop (:class:`Stage`, :func:`stage_at_stop`):
  confirmed done before the stop's time (its call had answered), in flight
  at the stop (pending, effect_unknown, or answered only after the stop),
  or not started (never sent: nothing is sent after a known stop).

The table, as :data:`POLICIES` encodes it (``none`` effects are abandoned
when cut off and kept when done, and ``complete`` ones finish, whatever the
reason; "reversed" means compensated once the external system confirms the
effect happened, see :meth:`turn.ledger.Ledger.resolve_on_stop`):

============================  =====================  =====================
stop reason                   ``compensate``, done   ``compensate``, in
                              before the stop        flight at the stop
============================  =====================  =====================
user_cancel                   kept                   reversed
barge_in                      kept                   reversed
safety_abort                  reversed               reversed (no retry)
deadline/budget/max_steps/    kept                   reversed
loop_detected
worker_shutdown               kept                   looked up: kept, or
                                                     retried (same key)
transport_disconnected        kept                   looked up: kept, or
                                                     abandoned
speculation_withdrawn         reversed               reversed (no retry)
============================  =====================  =====================

A stop that arrives after the turn completed changes nothing (the turn is
terminal; no policy is applied). Only a safety abort reverses a step that
had committed: it says the step should never have been taken.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from datetime import datetime
from enum import StrEnum
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from turn.intents import Intent, IntentKind, IntentStatus
from turn.models import StopReasonKind


class Stage(StrEnum):
    """Where an effect stood when its turn was asked to stop."""

    #: confirmed done at or before the stop's time (``done_at <= stop_at``)
    DONE_BEFORE_STOP = "done_before_stop"
    #: pending, effect_unknown, or confirmed only after the stop's time
    IN_FLIGHT = "in_flight"
    #: never took effect: never sent, or confirmed not applied (abandoned)
    NOT_STARTED = "not_started"


def stage_at_stop(intent: Intent, stop_at: datetime) -> Stage:
    """The :class:`Stage` of an effect row for a stop requested at
    ``stop_at`` (UTC). A compensated row keeps the stage of its effect
    (its ``done_at``); a done row without ``done_at`` counts as done
    before the stop."""
    if intent.done_at is not None:
        return Stage.DONE_BEFORE_STOP if intent.done_at <= stop_at else Stage.IN_FLIGHT
    if intent.status is IntentStatus.DONE:
        return Stage.DONE_BEFORE_STOP
    if intent.status is IntentStatus.ABANDONED:
        return Stage.NOT_STARTED
    return Stage.IN_FLIGHT


class EffectPolicy(BaseModel):
    """What a stop of a given reason does with a turn's effects.

    Attributes:
        compensate_done: reverse compensable effects confirmed done before
            the stop.
        compensate_in_flight: reverse compensable effects in flight at the
            stop (once the external system confirms they happened, or
            cannot say).
        retry_absent: an effect_unknown found absent may be retried (with
            the same key).
        new_effects: effects may still be started (a retry is one).
        finish_queued: work the turn queued before the stop (downstream
            items) still goes out; otherwise it is skipped.
    """

    model_config = ConfigDict(frozen=True)

    compensate_done: bool
    compensate_in_flight: bool
    retry_absent: bool
    new_effects: bool = True
    finish_queued: bool = False

    def compensates(self, intent: Intent, stop_at: datetime) -> bool:
        """Whether this policy wants ``intent`` (an effect row) reversed,
        for a stop requested at ``stop_at`` (UTC): only compensable
        effects, by their :func:`stage_at_stop`."""
        if intent.kind is not IntentKind.EFFECT or intent.effect != "compensate":
            return False
        stage = stage_at_stop(intent, stop_at)
        if stage is Stage.DONE_BEFORE_STOP:
            return self.compensate_done
        return stage is Stage.IN_FLIGHT and self.compensate_in_flight


#: keep what committed, reverse what the stop cut off, retry nothing
_CUT_OFF = EffectPolicy(compensate_done=False, compensate_in_flight=True, retry_absent=False)

#: The policy per stop reason (see the module doc). A user's cancel, a
#: barge-in and a turn's own limits keep what committed, reverse what they
#: cut off and retry nothing; a safety abort reverses what it can, committed
#: steps included, and starts nothing new; a worker that shut down was not
#: asked to stop, so an effect found absent is retried and what was queued
#: goes out; a dropped call keeps what was done but retries nothing (the
#: user cannot be told); a withdrawn speculative turn should never have acted.
POLICIES: dict[StopReasonKind | None, EffectPolicy] = {
    StopReasonKind.USER_CANCEL: _CUT_OFF,
    StopReasonKind.BARGE_IN: _CUT_OFF,
    StopReasonKind.SAFETY_ABORT: EffectPolicy(
        compensate_done=True, compensate_in_flight=True, retry_absent=False, new_effects=False
    ),
    StopReasonKind.WORKER_SHUTDOWN: EffectPolicy(
        compensate_done=False, compensate_in_flight=False, retry_absent=True, finish_queued=True
    ),
    StopReasonKind.TRANSPORT_DISCONNECTED: EffectPolicy(compensate_done=False, compensate_in_flight=False, retry_absent=False),
    StopReasonKind.DEADLINE_EXCEEDED: _CUT_OFF,
    StopReasonKind.BUDGET_EXCEEDED: _CUT_OFF,
    StopReasonKind.MAX_STEPS: _CUT_OFF,
    StopReasonKind.LOOP_DETECTED: _CUT_OFF,
    #: a speculative turn runs no side effect before its end of turn is
    #: confirmed (voice.turn_handle), so there is nothing to keep: should one
    #: have run anyway, it is reversed like a safety abort's, and nothing new starts
    StopReasonKind.SPECULATION_WITHDRAWN: EffectPolicy(
        compensate_done=True, compensate_in_flight=True, retry_absent=False, new_effects=False
    ),
    #: no stop: the turn completed or failed on an error; keep what was done
    None: EffectPolicy(compensate_done=False, compensate_in_flight=False, retry_absent=True, finish_queued=True),
}


def policy_for(kind: StopReasonKind | None) -> EffectPolicy:
    """The :class:`EffectPolicy` for a stop of ``kind`` (None: no stop).

    Raises:
        KeyError: an unknown kind.
    """
    return POLICIES[kind]


#: whether a stop's policy reverses an effect row at the stage its times give it
Reverses = Callable[[Intent], bool]


class TurnStop(NamedTuple):
    """The stop in force for a turn, as the ledger and the reconciliation
    worker see it after the stop (a call's late answer, a job's attempt).

    Attributes:
        kind: the stop's reason; None if the turn was not stopped, or
            completed before its stop (a stop after the final step changes
            nothing).
        at: when the stop was requested (UTC); None with ``kind`` None, or
            where it is not known (then no stage can be told).
        terminal: the turn has reached its terminal state.
    """

    kind: StopReasonKind | None
    at: datetime | None
    terminal: bool

    def reverses(self) -> Reverses | None:
        """:func:`reverses_at` this stop."""
        return reverses_at(self.kind, self.at)


def reverses_at(kind: StopReasonKind | None, stop_at: datetime | None) -> Reverses | None:
    """The policy of a stop of ``kind`` requested at ``stop_at`` (UTC), as
    a predicate on effect rows (:meth:`EffectPolicy.compensates`); None
    when there is no stop time to judge a stage by."""
    if stop_at is None:
        return None
    return functools.partial(policy_for(kind).compensates, stop_at=stop_at)


#: ``async (turn_id) -> TurnStop`` (the turn manager's reads the turn)
TurnStopOf = Callable[[str], Awaitable[TurnStop]]


def effect_remains(intents: list[Intent], stop_at: datetime, policy: EffectPolicy) -> bool:
    """True if the ledger shows an external effect that stays after the stop
    requested at ``stop_at`` (UTC): one confirmed after it, one the policy
    wants reversed whose compensation has not succeeded (yet), or one still
    unresolved (pending, effect_unknown, or one a person must settle). The
    turn is then RECONCILE_REQUIRED, never CANCELLED (DESIGN.md). An effect
    done before the stop that the policy keeps (a barge-in's placed order)
    is not one: nothing happened after the stop."""
    for i in intents:
        if i.kind is not IntentKind.EFFECT or i.effect == "none":
            continue
        if i.status in (IntentStatus.PENDING, IntentStatus.EFFECT_UNKNOWN, IntentStatus.HUMAN_REQUIRED):
            return True
        if i.status is IntentStatus.DONE:
            if stage_at_stop(i, stop_at) is Stage.IN_FLIGHT:
                return True  # confirmed after the stop
            if policy.compensates(i, stop_at):
                return True  # its compensation has not succeeded (yet)
    return False
