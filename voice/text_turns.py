"""Text turns: a typed request runs through the same Turn Manager, model
call (:func:`voice.respond.stream_reply`), checkpoints and event log as a
spoken one; only the transport differs (REST and SSE instead of WebRTC), and
there is no audio.

A new text turn in a session whose previous turn is still answering
supersedes it like a barge-in: the generation advances (the old turn's
output is fenced) and the old turn is stopped with reason ``barge_in``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from turn.clock import Clock
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import Budget, StopReason, StopReasonKind, Turn, TurnKind, TurnStatus
from voice.providers import LanguageModel, Message
from voice.respond import stream_reply
from voice.session import describe_error, stopped_by

log = logging.getLogger(__name__)

#: past turns of a session the model sees at most
HISTORY_TURNS = 20


@dataclass
class _TextSession:
    fence: GenerationFence
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)


class TextTurns:
    """Runs text turns on this instance.

    Args:
        manager: the Turn Manager.
        llm: makes the model for a turn (the embedded local agent by default).
        clock: time source.
        stop_grace_s: how long a stopped turn's work may take to end before
            its terminal state is written anyway.
    """

    def __init__(
        self,
        manager: TurnManager,
        llm: Callable[[], LanguageModel],
        clock: Clock,
        *,
        stop_grace_s: float = 0.25,
    ) -> None:
        self.manager = manager
        self.llm = llm
        self.clock = clock
        self.stop_grace_s = stop_grace_s
        self._sessions: dict[str, _TextSession] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(
        self,
        *,
        tenant_id: str,
        text: str,
        session_id: str | None = None,
        deadline_s: float | None = None,
        budget: Budget | None = None,
    ) -> Turn:
        """Accept a typed request and start answering it in the background.

        Returns:
            The RUNNING turn (its progress is in the session's event log).

        Raises:
            PermissionError: ``session_id`` belongs to another tenant.
            RuntimeError: the server is shutting down.
        """
        if self._closing:
            raise RuntimeError("shutting down")
        session = await self.manager.ensure_session(
            session_id or uuid.uuid4().hex, tenant_id=tenant_id, kind=TurnKind.TEXT
        )
        ts = self._sessions.get(session.id)
        if ts is None:
            ts = self._sessions[session.id] = _TextSession(GenerationFence(self.clock, active=session.generation))
        turn = await self.manager.open_turn(
            session.id, kind=TurnKind.TEXT, tenant_id=tenant_id, transcript=text, deadline_s=deadline_s, budget=budget
        )
        ts.fence.active = max(ts.fence.active, turn.generation)  # the older turns' output is fenced now
        self.manager.events.log(session.id, gate=ts.fence)
        for older_id in list(ts.running):
            bg = asyncio.get_running_loop().create_task(self._supersede(older_id))
            self._background.add(bg)
            bg.add_done_callback(self._background.discard)
        task = asyncio.get_running_loop().create_task(self._run(turn, ts), name=f"text-turn-{turn.id}")
        ts.running[turn.id] = task
        task.add_done_callback(lambda _t, tid=turn.id: ts.running.pop(tid, None))
        return turn

    async def _supersede(self, turn_id: str) -> None:
        reason = StopReason(kind=StopReasonKind.BARGE_IN, initiator="text", at=self.clock.now(), detail="a newer message")
        try:
            await self.manager.request_stop(turn_id, reason)
        except Exception:
            log.exception("turn %s: could not stop it for a newer message", turn_id)

    async def _run(self, turn: Turn, ts: _TextSession) -> None:
        """Answer, or stop when asked (by signal, or a checkpoint that reads
        the store), and write exactly one terminal state."""
        work = asyncio.get_running_loop().create_task(self._answer(turn))
        stop = asyncio.get_running_loop().create_task(self.manager.stop_event(turn.id).wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                await asyncio.wait({work}, timeout=self.stop_grace_s)
            stopped = stop.done() or (work.done() and not work.cancelled() and stopped_by_result(work))
            if stopped:
                await self._finish_stop(turn.id)
            elif work.done() and not work.cancelled() and work.exception() is not None:
                log.error("text turn %s: %s", turn.id, describe_error(work.exception()))  # type: ignore[arg-type]
        except asyncio.CancelledError:
            # The server is shutting down: record that, then go on cancelling.
            work.cancel()
            await asyncio.shield(self._shutdown_stop(turn.id, work))
            raise
        except Exception:
            log.exception("text turn %s: stop handling failed", turn.id)
        finally:
            stop.cancel()
            self.manager.release(turn.id)

    async def _finish_stop(self, turn_id: str) -> None:
        """The work ended after a stop: CANCEL_REQUESTED becomes CANCELLED
        (a turn that completed first stays COMPLETED)."""
        current = await self.manager.get(turn_id)
        if current.status is TurnStatus.CANCEL_REQUESTED:
            await self.manager.confirm_stopped(turn_id)

    async def _shutdown_stop(self, turn_id: str, work: asyncio.Task[None]) -> None:
        reason = StopReason(kind=StopReasonKind.WORKER_SHUTDOWN, initiator="server", at=self.clock.now())
        try:
            await asyncio.wait({work}, timeout=self.stop_grace_s)
            res = await self.manager.request_stop(turn_id, reason)
            if not res.turn.is_terminal:
                await self.manager.confirm_stopped(turn_id)
        except Exception:
            log.exception("text turn %s: could not record the shutdown", turn_id)

    async def _answer(self, turn: Turn) -> None:
        """The work: history, one model call, reply recorded, COMPLETED."""
        events = self.manager.events.log(turn.session_id)
        parts: list[str] = []

        def on_token(token: str) -> None:
            parts.append(token)
            events.emit("agent.delta", generation=turn.generation, turn_id=turn.id, text=token)

        events.emit("transcript", generation=turn.generation, turn_id=turn.id, role="user", text=turn.transcript or "")
        try:
            messages = await self._history(turn)
            reply = await stream_reply(
                self.llm(), messages, manager=self.manager, turn_id=turn.id, on_token=on_token, clock=self.clock
            )
            await self.manager.record(turn.id, reply=reply.strip())
            await self.manager.complete(turn.id)
            events.emit("agent.done", generation=turn.generation, turn_id=turn.id, text=reply.strip())
        except asyncio.CancelledError:
            if parts:
                await asyncio.shield(self._record_partial(turn.id, "".join(parts)))
            raise
        except Exception as exc:
            if parts:
                await self._record_partial(turn.id, "".join(parts))
            if stopped_by(exc):
                raise
            log.exception("text turn %s failed", turn.id)
            await self.manager.fail(turn.id, describe_error(exc))

    async def _record_partial(self, turn_id: str, text: str) -> None:
        try:
            await self.manager.record(turn_id, reply=text.strip())
        except Exception:
            log.exception("turn %s: could not record its partial reply", turn_id)

    async def _history(self, turn: Turn) -> list[Message]:
        """The conversation so far, from the store (any instance may have run
        the earlier turns): each earlier turn's request and what was
        answered, an interrupted answer marked so."""
        earlier = [t for t in await self.manager.store_call(lambda: self.manager.store.list_session(turn.session_id)) if t.id != turn.id]
        messages: list[Message] = []
        for t in earlier[-HISTORY_TURNS:]:
            if t.transcript:
                messages.append(Message(role="user", content=t.transcript))
            if t.reply:
                messages.append(
                    Message(role="assistant", content=t.reply, interrupted=t.status is not TurnStatus.COMPLETED)
                )
        messages.append(Message(role="user", content=turn.transcript or ""))
        return messages

    async def aclose(self) -> None:
        """Stop every running text turn with ``worker_shutdown`` and wait."""
        self._closing = True
        tasks = [t for ts in self._sessions.values() for t in ts.running.values()] + list(self._background)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for session_id in list(self._sessions):
            await self.manager.events.close(session_id)
        self._sessions.clear()


def stopped_by_result(task: asyncio.Task[None]) -> bool:
    """True if the finished ``task`` ended because its turn was stopped."""
    exc = task.exception()
    return exc is not None and stopped_by(exc)
