"""Control input of a voice session: push-to-talk, abort and DTMF keys, as
the transport delivers them (:class:`voice.transport.Control`).

:class:`SessionControls` is the part of :class:`voice.session.AgentSession`
that carries each control out; it declares what of the session it uses.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from clock import Clock
from turn.models import StopReason, StopReasonKind
from voice.transport import Control, ControlKind, Transport
from voice.turn_taking import Decision, TurnTaking

if TYPE_CHECKING:
    from voice.turn_handle import TurnHandle


class SessionControls:
    """Push-to-talk, abort and DTMF for :class:`voice.session.AgentSession`."""

    # what of the session the controls use (set by AgentSession.__init__/run)
    clock: Clock
    transport: Transport
    turn_taking: TurnTaking
    dtmf_digits: str
    _tg: asyncio.TaskGroup | None

    if TYPE_CHECKING:
        def _carry_out(self, decisions: list[Decision]) -> None: ...
        def _active_run(self) -> TurnHandle | None: ...
        def _silence(self, run: TurnHandle) -> None: ...

    async def _take_controls(self) -> None:
        """The transport's control input, each carried out as it comes."""
        async for control in self.transport.controls():
            self._on_control(control)

    def _on_control(self, control: Control) -> None:
        """Carry out one control (:class:`voice.transport.Control`); one
        the session refuses goes back to the transport with its error code."""
        error = None
        if control.kind in (ControlKind.PTT_START, ControlKind.PTT_END):
            error = self.ptt_start() if control.kind is ControlKind.PTT_START else self.ptt_end()
        elif control.kind is ControlKind.ABORT:
            self.abort()
        elif control.kind is ControlKind.DTMF:
            self.dtmf_digits = (self.dtmf_digits + (control.digit or ""))[-64:]  # the latest keys
        if error is not None:
            self.transport.refuse(control, error)

    def abort(self) -> None:
        """Stop the turn thinking or speaking (``user_cancel`` by the ``user``),
        silenced at once; nothing if there is none or it is stopping already."""
        if (run := self._active_run()) is not None and run.stop_task is None:
            self._silence(run)
            run.stop(StopReason(kind=StopReasonKind.USER_CANCEL, initiator="user", at=self.clock.now(), detail="abort"))

    def ptt_start(self) -> str | None:
        """Push-to-talk pressed: an immediate, committed barge-in with no VAD
        involved; everything heard until :meth:`ptt_end` is the user's turn.

        Returns:
            None, or an error code (``ptt_already_active``,
            ``session_not_ready``) for the client.
        """
        if self.turn_taking.ptt_active:
            return "ptt_already_active"
        if self._tg is None:
            return "session_not_ready"
        self._carry_out(self.turn_taking.ptt_start(self.clock.monotonic()))
        return None

    def ptt_end(self) -> str | None:
        """Push-to-talk released: the user's turn ends at once (no endpointing
        wait).

        Returns:
            None, or an error code (``ptt_not_active``) for the client.
        """
        if not self.turn_taking.ptt_active:
            return "ptt_not_active"
        self._carry_out(self.turn_taking.ptt_end(self.clock.monotonic()))
        return None
