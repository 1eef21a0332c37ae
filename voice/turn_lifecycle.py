"""One turn lifecycle for every transport (issue 12.3): the steps a spoken
turn (:class:`voice.turn_handle.TurnHandle`) and a typed one
(:class:`voice.text_turns.TextTurns`) share, written once so the two
cannot drift apart.

A turn, whatever it came in on, goes:

1. QUEUED -> RUNNING (``TurnManager.open_turn``), then its work runs in a
   cancel scope made by :func:`open_scope` (the turn's deadline from its
   runtime, the stop grace, the shutdown reserve);
2. the agent loop (:func:`voice.respond.run_agent`) on the history of
   :mod:`voice.history` (the same messages for both: heard text,
   interrupted marks, tool calls with their ledger outcomes);
3. one of three endings, each exactly once:

   - finished: :func:`finish`, one must-complete step that records the reply
     as far as the user received it and writes COMPLETED, then
     ``agent.done``;
   - stopped (barge-in, user cancel, a limit, shutdown): the stop path
     (``TurnManager.request_stop`` then ``settle_stop``: CANCELLED,
     RECONCILE_REQUIRED or FAILED from the children's reports), with the
     partial reply recorded as heard and unheard;
   - failed: :func:`fail`, FAILED with the error's description and an
     ``error`` event (code ``turn_failed``) to the client;

4. after a stop, :func:`record_late_usage`: a provider that ignored its
   cancellation may have billed more while the scope waited for it, and
   that spend is recorded, not lost.

What differs by transport is only how output reaches the user (audio
frames played, or text deltas delivered) and so what "heard" means.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from clock import Clock
from turn.event_catalogue import ErrorEvent
from turn.events import EventSink
from turn.log_content import error_text
from turn.manager import TurnManager
from turn.runtime import TurnRuntime
from turn.scope import TurnScope
from voice.errors import describe_error, first_error
from voice.recognition import SttError

log = logging.getLogger(__name__)

#: what a finished turn's reply is: (the part the user received, the part
#: generated but not received, or None for either)
Heard = tuple[str | None, str | None]


def open_scope(manager: TurnManager, turn_id: str, clock: Clock, *, grace_s: float, shutdown_reserve_s: float) -> TurnScope:
    """The cancel scope a turn's work runs in.

    Args:
        manager: the Turn Manager running the turn here (its runtime gives
            the deadline, monotonic clock seconds; none if the turn has no
            runtime here).
        turn_id: the turn.
        clock: time source.
        grace_s: how long stopped children may take to report, s.
        shutdown_reserve_s: time kept back from every child for its own
            wind-down, s (``turn.models.Plan.shutdown_reserve_ms`` / 1000).

    The scope tells ``manager.scope_observers`` of its children and stop.
    """
    rt = manager.runtime(turn_id)
    return TurnScope(
        turn_id,
        clock,
        grace_s=grace_s,
        deadline=rt.deadline if rt is not None else None,
        shutdown_reserve_s=shutdown_reserve_s,
        observer=manager.scope_observers,
    )


async def finish(
    scope: TurnScope,
    manager: TurnManager,
    turn_id: str,
    heard: Callable[[], Awaitable[Heard]],
    on_written: Callable[[bool, str], None],
) -> None:
    """The final step of a turn that did all its work, committed whole or
    not at all (a must-complete step without an external effect): the reply
    as ``heard()`` gives it is recorded (the unheard rest apart, for audit),
    then COMPLETED; ``on_written(applied, reply)`` runs inside the commit
    (``applied``: COMPLETED was written now, not found terminal already),
    where the transport announces ``agent.done``.

    Raises:
        turn.stopped.TurnStopped: the turn was stopped before the commit began.
        turn.store.StoreUnavailable: the store could not be written.
    """

    async def step() -> None:
        reply, rest = await heard()
        await manager.record(turn_id, reply=reply, **({"reply_unheard": rest} if rest else {}))
        applied = (await manager.complete(turn_id)).applied
        on_written(applied, reply or "")

    await scope.commit(step(), effect=False)


async def fail(manager: TurnManager, turn_id: str, generation: int, exc: BaseException, report: EventSink) -> bool:
    """A turn's work raised ``exc`` (not a stop): FAILED with its
    description, and the client is told (event ``error``, code
    ``turn_failed``, in ``generation``) even if the store refused the
    write. Returns whether the failure was recorded (False: the store
    refused it, logged; the caller's settle tries again)."""
    error = describe_error(exc)
    if isinstance(first_error(exc), SttError):
        # no recogniser could answer: told as it happened (stt.failover, one
        # warning each), an outcome of the service, not a fault of the code
        log.warning("turn %s failed: %s", turn_id, error_text(exc))
    else:
        log.error("turn %s failed: %s", turn_id, error_text(exc), exc_info=exc)  # the traceback without its message unless log_content
    recorded = True
    try:
        await manager.fail(turn_id, error)
    except Exception:
        recorded = False
        log.exception("turn %s: could not record its failure", turn_id)
    report(ErrorEvent(turn_id=turn_id, generation=generation, code="turn_failed", message=error))
    return recorded


async def record_late_usage(manager: TurnManager, turn_id: str, runtime: TurnRuntime | None) -> None:
    """After a stopped turn ended: write the usage its ``runtime``'s meter
    holds now (taken while the turn ran: the manager forgets it at the
    terminal write), so what a provider that ignored its cancellation billed
    during the grace is recorded. Shielded from cancellation; a failure is
    logged, not raised."""
    if runtime is None:
        return
    try:
        await asyncio.shield(manager.flush(turn_id, runtime.meter))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("turn %s: could not record its final usage", turn_id)
