"""Leases and the sweeper (DESIGN.md "Authority and scale").

Every running turn is leased to the process that runs it (``lease_owner``)
and carries that process's heartbeat (``heartbeat_at``), written by its
checkpoints' store round trips (:meth:`turn.checkpoint.Checkpoints.sync`,
whenever the cached stop flag is older than ``flag_staleness_s``) and every
third of the lease TTL (:meth:`Leases.keep_leases`). A turn whose
heartbeat is older than the TTL has lost its owner; the sweeper
(:meth:`Leases.sweep_abandoned`, and once at startup
:meth:`Leases.recover_abandoned`) stops such turns with a clear reason, so
none stays open forever, except text turns still RUNNING: those are taken
over (a compare-and-set on the lease as seen expired, so one sweeper wins
and a worker that was only slow keeps its turn) and run on here from their
ledger, what their worker had in flight settled first (see
:meth:`voice.text_turns.TextTurns.take_over`).

:class:`Leases` is a part of :class:`turn.manager.TurnManager`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

from clock import Clock
from turn.ledger import Ledger
from turn.models import StopReason, StopReasonKind, Turn, TurnStatus
from turn.states import TransitionResult
from turn.store import StopAnswer, StopResult, TurnStore

log = logging.getLogger(__name__)

T = TypeVar("T")


class TakeOver(StrEnum):
    """What became of an abandoned turn offered to be run on here."""

    #: leased here, it runs on from its ledger
    TAKEN = "taken"
    #: another worker won it, or its own worker was only slow: left alone
    LOST = "lost"
    #: it cannot go on (a voice turn, say): the sweeper stops it
    NOT_RESUMABLE = "not_resumable"


def default_owner() -> str:
    """This process's lease-owner id: host, pid and a random part (a
    restarted process never reuses one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Leases:
    """The leases of :class:`turn.manager.TurnManager` and its sweeper.

    It uses the manager's ``store_call``, its stop path's ``request_stop``
    (:class:`turn.stop_path.StopPath`) and its transitions
    (``confirm_stopped``, ``reconcile_required``).

    Attributes:
        store / clock / ledger: the manager's.
        owner: this process's lease-owner id (:func:`default_owner`).
        lease_ttl_s: a turn whose heartbeat is older than this (s) has lost
            its owner.
        _owned: the turns leased to this process.
    """

    store: TurnStore
    clock: Clock
    ledger: Ledger
    owner: str
    lease_ttl_s: float
    _owned: set[str]
    #: set by the text turns: run an abandoned RUNNING turn on here instead
    #: of stopping it (None: every abandoned turn is stopped)
    take_over_abandoned: Callable[[Turn], Awaitable[TakeOver]] | None = None

    if TYPE_CHECKING:  # the manager's methods this part calls (turn.manager.TurnManager, turn.stop_path.StopPath)

        async def store_call(self, fn: Callable[[], Awaitable[T]]) -> T: ...

        async def request_stop(
            self, turn_id: str, reason: StopReason, *, request_id: str | None = None, fingerprint: str = ""
        ) -> StopResult: ...

        async def confirm_stopped(self, turn_id: str) -> TransitionResult: ...

        async def reconcile_required(self, turn_id: str) -> TransitionResult: ...

    async def renew_leases(self) -> int:
        """Heartbeat every turn this process runs; returns how many."""
        owned = sorted(self._owned)
        if not owned:
            return 0
        return await self.store_call(lambda: self.store.heartbeat(self.owner, owned, at=self.clock.now()))

    async def keep_leases(self) -> None:
        """Run forever: renew this process's leases every third of the TTL, so
        a live worker never looks dead however long a turn runs."""
        while True:
            await self.clock.sleep(self.lease_ttl_s / 3)
            try:
                await self.renew_leases()
            except Exception:
                log.exception("lease renewal failed")

    def lease_expired(self, turn: Turn) -> bool:
        """True if ``turn`` is open and nobody has shown it is alive for
        ``lease_ttl_s``: its owner's last heartbeat, or for a turn never
        leased, its last update."""
        if turn.is_terminal:
            return False
        last = turn.heartbeat_at or turn.updated_at
        return (self.clock.now() - last).total_seconds() > self.lease_ttl_s

    async def recover_abandoned(self, reason: StopReason, *, all_open: bool) -> list[Turn]:
        """Stop the turns whose worker is gone (killed mid-turn), so none
        stays open forever (a turn released for another worker is left to
        be adopted, :mod:`turn.resume`): QUEUED ones are cancelled at once, the others go
        through CANCEL_REQUESTED to CANCELLED with ``reason`` (or to
        RECONCILE_REQUIRED when the ledger shows an effect remaining).

        Args:
            all_open: every open turn not run by this process is abandoned
                (true when one process serves the store, e.g. SQLite);
                otherwise only those whose lease expired.

        Returns:
            The turns as stopped.
        """
        stopped = []
        for turn in await self.store_call(self.store.list_open):
            if turn.id in self._owned or turn.released or not (all_open or self.lease_expired(turn)):
                continue  # a released turn waits to be adopted (turn.resume), not stopped
            if self.take_over_abandoned is not None and turn.status is TurnStatus.RUNNING:
                try:
                    taken = await self.take_over_abandoned(turn)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("turn %s: could not be taken over; it is stopped", turn.id)
                    taken = TakeOver.NOT_RESUMABLE
                if taken is not TakeOver.NOT_RESUMABLE:
                    continue  # runs on here, or another worker won it (or its own was only slow)
            res = await self.request_stop(turn.id, reason, request_id=f"recover:{turn.id}")
            if res.answer in (StopAnswer.ACCEPTED, StopAnswer.ALREADY_STOPPING) and not res.turn.is_terminal:
                stop = res.turn.stop_reason or reason
                remains = await self.ledger.resolve_on_stop(turn.id, stop.kind, stop.at)
                moved = await (self.reconcile_required(turn.id) if remains else self.confirm_stopped(turn.id))
                res = StopResult(answer=res.answer, first=res.first, repeat=res.repeat, turn=moved.turn)
            stopped.append(res.turn)
            log.warning("recovered turn %s left %s by %s", turn.id, turn.status, turn.lease_owner or "nobody")
        return stopped

    async def sweep_abandoned(self) -> None:
        """Run forever: every ``lease_ttl_s``, stop the turns whose worker
        stopped heartbeating (another instance crashed, or this one was
        restarted within the TTL), with reason ``worker_shutdown``: a turn
        never stays open because its owner died. A failed sweep is logged
        and the next one runs on time."""
        while True:
            await self.clock.sleep(self.lease_ttl_s)
            reason = StopReason(
                kind=StopReasonKind.WORKER_SHUTDOWN, initiator="server", at=self.clock.now(),
                detail="its worker stopped renewing its lease",
            )
            try:
                await self.recover_abandoned(reason, all_open=False)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("lease sweep failed")
