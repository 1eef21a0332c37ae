"""Control input of a voice session: push-to-talk, abort and DTMF keys, as
the transport delivers them (:class:`voice.transport.Control`). Keys are the
user's input (:mod:`voice.dtmf`): the first opens a keypad turn like
push-to-talk does (a committed barge-in, initiator ``dtmf``), the
terminator or a pause ends it, and its transcript is the digits.

:class:`SessionControls` is the part of :class:`voice.session.AgentSession`
that carries each control out; it declares what of the session it uses.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from clock import Clock
from turn.log_content import content
from turn.models import StopReason, StopReasonKind
from voice.dtmf import DigitStream
from voice.session_config import SessionConfig
from voice.transport import Control, ControlKind, Transport
from voice.turn_taking import Decision, TurnTaking

if TYPE_CHECKING:
    from voice.turn_handle import TurnHandle

log = logging.getLogger(__name__)


class SessionControls:
    """Push-to-talk, abort and DTMF for :class:`voice.session.AgentSession`."""

    # what of the session the controls use (set by AgentSession.__init__/run)
    clock: Clock
    transport: Transport
    turn_taking: TurnTaking
    dtmf_digits: str
    config: SessionConfig
    _tg: asyncio.TaskGroup | None
    #: the keys being collected as the user's input (None: none are)
    _keypad: DigitStream | None = None
    _keypad_timer: asyncio.Task[None] | None = None

    if TYPE_CHECKING:
        _listening: TurnHandle | None

        def _carry_out(self, decisions: list[Decision]) -> None: ...
        def _active_run(self) -> TurnHandle | None: ...
        def _silence(self, run: TurnHandle) -> None: ...

    async def _take_controls(self) -> None:
        """The transport's control input, each carried out as it comes
        (the keys' timeout ends with it)."""
        try:
            async for control in self.transport.controls():
                self._on_control(control)
        finally:
            if self._keypad_timer is not None:
                self._keypad_timer.cancel()

    def _on_control(self, control: Control) -> None:
        """Carry out one control (:class:`voice.transport.Control`); one
        the session refuses goes back to the transport with its error code."""
        error = None
        if control.kind in (ControlKind.PTT_START, ControlKind.PTT_END):
            error = self.ptt_start() if control.kind is ControlKind.PTT_START else self.ptt_end()
        elif control.kind is ControlKind.ABORT:
            self.abort(control.initiator or "user")
        elif control.kind is ControlKind.DETECT:
            self.detect(control.text or "", control.at)
        elif control.kind is ControlKind.DTMF:
            self.dtmf_digits = (self.dtmf_digits + (control.digit or ""))[-64:]  # the latest keys
            self.keypad(control.digit or "", control.at)
        if error is not None:
            self.transport.refuse(control, error)

    def abort(self, initiator: str = "user") -> None:
        """Stop the turn thinking or speaking (``user_cancel`` by ``initiator``),
        silenced at once; nothing if there is none or it is stopping already."""
        if (run := self._active_run()) is not None and run.stop_task is None:
            self._silence(run)
            run.stop(StopReason(kind=StopReasonKind.USER_CANCEL, initiator=initiator, at=self.clock.now(), detail="abort"))

    def detect(self, text: str, at: float) -> None:
        """A wake word's ``text`` at clock seconds ``at`` (xiaozhi ``listen
        detect``): a turn whose transcript is the text, opened like
        push-to-talk (a committed barge-in, initiator ``wake_word``, if the
        agent is replying) and ended at once. Ignored (logged) while an
        utterance is being listened to or the text is empty."""
        tt = self.turn_taking
        if not text.strip() or tt.listening or tt.ptt_active or self._tg is None:
            log.info("wake word %s while listening (or empty): ignored", content(text[:40]))
            return
        self._carry_out(tt.ptt_start(at, initiator="wake_word"))
        run = self._listening
        if run is not None and isinstance(run.stt, DigitStream):
            run.stt.digits = text.strip()
        self._carry_out(tt.ptt_end(at))

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

    def keypad(self, digit: str, at: float) -> None:
        """A telephone key at clock seconds ``at`` (:mod:`voice.dtmf`): the
        first opens a keypad turn (a committed barge-in if the agent is
        replying), the terminator ends it at once, any other key is added
        and restarts the timeout. While a spoken utterance is being listened
        to, a key is only recorded (``dtmf_digits``)."""
        tt = self.turn_taking
        entry = self._keypad if tt.ptt_active else None  # held too long: let go by turn-taking
        if entry is None:
            if tt.listening or tt.ptt_active or self._tg is None:
                log.info("key %s while an utterance is being listened to: recorded only", content(digit))
                return
            self._carry_out(tt.ptt_start(at, initiator="dtmf"))
            run = self._listening
            if run is None or not isinstance(run.stt, DigitStream):
                return
            self._keypad = entry = run.stt
        cfg = self.config.dtmf
        if cfg.terminator and digit == cfg.terminator:
            entry.digits = entry.digits or digit
            self._keypad_end(at)
            return
        entry.digits = (entry.digits + digit)[:256]
        if self._keypad_timer is not None:
            self._keypad_timer.cancel()
        assert self._tg is not None
        self._keypad_timer = self._tg.create_task(self._keypad_timeout(entry, cfg.timeout_ms / 1000))

    async def _keypad_timeout(self, entry: DigitStream, timeout_s: float) -> None:
        """No key for ``timeout_s``: the keys are the input."""
        await self.clock.sleep(timeout_s)
        if self._keypad is entry:
            self._keypad_timer = None
            self._keypad_end(self.clock.monotonic())

    def _keypad_end(self, at: float) -> None:
        """The keys are complete: the keypad turn's utterance ends."""
        self._keypad = None
        timer, self._keypad_timer = self._keypad_timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
        self._carry_out(self.turn_taking.ptt_end(at))
