"""Scope observers: what telemetry (traces, metrics) sees of a turn's
cancellation tree, as it happens.

A :class:`turn.scope.TurnScope` tells its observer when each child (STT
finalization, the model stream, a tool call, TTS, playout) starts and how
it ended, when the scope was stopped, and the stop's report once the
children settled. Children may also *mark* moments of their own work
(:func:`turn.scope.mark`: the model's first token, TTS's first audio), which
the observer receives with the child's end. Everything is wall-clock time
from the scope's injected clock (``Clock.now()``, UTC).

Observers are called synchronously on the turn's own task and must be
cheap; one that raises is logged and ignored (:class:`ScopeObservers`):
telemetry never changes how a turn runs or stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from turn.models import ChildOutcome, StopReason, StopReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChildRun:
    """One child of a turn's scope, as it ran.

    Attributes:
        turn_id: the turn whose scope it belongs to.
        name: the child's name: ``stt``, ``model``, ``tool:<name>``,
            ``tts``, ``playout``, ``agent`` (a text turn's whole answer).
        started_at: when it was started (UTC).
        ended_at: when it ended (UTC; None while it runs).
        outcome: how it ended (None while it runs).
        after_stop: it ended after its scope was stopped.
        marks: moments it marked, in order: ``(name, when)``.
        error: what it raised, ``"Type: message"`` (None: nothing).
    """

    turn_id: str
    name: str
    started_at: datetime
    ended_at: datetime | None = None
    outcome: ChildOutcome | None = None
    after_stop: bool = False
    marks: tuple[tuple[str, datetime], ...] = ()
    error: str | None = None

    def mark_at(self, name: str) -> datetime | None:
        """When it first marked ``name`` (None: never)."""
        return next((at for n, at in self.marks if n == name), None)


class ScopeObserver(Protocol):
    """Receives a turn scope's moments (see the module doc)."""

    def child_started(self, child: ChildRun) -> None:
        """``child`` was started (``ended_at`` and ``outcome`` None)."""

    def child_ended(self, child: ChildRun) -> None:
        """``child`` ended; ``outcome``, ``ended_at`` and ``marks`` are set."""

    def scope_stopped(self, turn_id: str, reason: StopReason | None, at: datetime) -> None:
        """The scope was stopped at ``at`` with ``reason`` (None: asked from
        outside and recorded in the store)."""

    def scope_settled(self, turn_id: str, report: StopReport, at: datetime) -> None:
        """A stop's children settled (or its grace ran out) at ``at``:
        ``report`` says how each ended."""

    def turn_noted(self, turn_id: str, name: str, at: datetime) -> None:
        """A moment of the turn itself, not of one child: ``speech_end``
        (the user's speech ended, before the endpoint's silence),
        ``stt_start`` (the endpoint fired: the recogniser's final began)."""


class ScopeObservers:
    """Several observers as one; a failing observer is logged, never
    raised into the turn. Empty by default: a scope with no observer costs
    one attribute check per child."""

    def __init__(self) -> None:
        self.observers: list[ScopeObserver] = []

    def __bool__(self) -> bool:
        return bool(self.observers)

    def append(self, observer: ScopeObserver) -> None:
        """Add ``observer`` (called after those added before it)."""
        self.observers.append(observer)

    def child_started(self, child: ChildRun) -> None:
        """See :meth:`ScopeObserver.child_started`."""
        for o in self.observers:
            _safely(o.child_started, child)

    def child_ended(self, child: ChildRun) -> None:
        """See :meth:`ScopeObserver.child_ended`."""
        for o in self.observers:
            _safely(o.child_ended, child)

    def scope_stopped(self, turn_id: str, reason: StopReason | None, at: datetime) -> None:
        """See :meth:`ScopeObserver.scope_stopped`."""
        for o in self.observers:
            _safely(o.scope_stopped, turn_id, reason, at)

    def scope_settled(self, turn_id: str, report: StopReport, at: datetime) -> None:
        """See :meth:`ScopeObserver.scope_settled`."""
        for o in self.observers:
            _safely(o.scope_settled, turn_id, report, at)

    def turn_noted(self, turn_id: str, name: str, at: datetime) -> None:
        """See :meth:`ScopeObserver.turn_noted`."""
        for o in self.observers:
            _safely(o.turn_noted, turn_id, name, at)


def _safely(fn: Callable[..., None], *args: object) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("scope observer failed")
