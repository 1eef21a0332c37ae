"""Text turns: a typed request runs through the same Turn Manager, agent
loop (:func:`voice.respond.run_agent`), checkpoints and event log as a
spoken one; only the transport differs (REST and SSE instead of WebRTC), and
there is no audio.

A new text turn in a session whose previous turn is still answering
supersedes it like a barge-in: the generation advances (the old turn's
output is fenced) and the old turn is stopped with reason ``barge_in``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from clock import Clock, timeout_after
from turn.event_catalogue import AgentDelta, AgentDone, AgentRestart, Transcript
from turn.events import SessionEventLog
from turn.generation import GenerationFence
from turn.lease import TakeOver
from turn.manager import TurnManager
from turn.models import Budget, Plan, StopReason, StopReasonKind, Turn, TurnKind
from turn.scope import Child, TurnScope
from turn.stopped import TurnStopped
from voice.history import HISTORY_MESSAGES, earlier_turns_wait_s, history_after, tool_messages
from voice.providers import LanguageModel
from voice.respond import run_agent, sink_to
from voice.tools import Toolbox
from voice.turn_lifecycle import fail, finish, open_scope, record_late_usage

log = logging.getLogger(__name__)


@dataclass
class _TextSession:
    fence: GenerationFence
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)


def _forget(running: dict[str, asyncio.Task[None]], turn_id: str, _task: asyncio.Task[None]) -> None:
    """Done-callback: a finished text turn leaves its session's running set."""
    running.pop(turn_id, None)


#: how a turn came to run here from another worker (``agent.restart``'s reason)
Resumed = Literal["adopted", "taken_over"]


class TextTurns:
    """Runs text turns on this instance.

    Args:
        manager: the Turn Manager.
        llm: makes the model for a turn (the embedded local agent by default).
        clock: time source.
        stop_grace_s: how long a stopped turn's children may take to report
            before its terminal state is written anyway, s.
        plans: the tenant's plan (deadline, budget, max steps) for each new
            turn.
        tools: makes the toolbox for a turn (None: no tools).
        history_messages: messages of history a model sees at most
            (``session.history_messages``, as for voice).
    """

    def __init__(
        self,
        manager: TurnManager,
        llm: Callable[[], LanguageModel],
        clock: Clock,
        *,
        stop_grace_s: float = 0.25,
        plans: Callable[[str], Plan] | None = None,
        tools: Callable[[], Toolbox] | None = None,
        history_messages: int = HISTORY_MESSAGES,
    ) -> None:
        self.manager = manager
        self.llm = llm
        self.clock = clock
        self.stop_grace_s = stop_grace_s
        self.plans = plans or (lambda _tenant: Plan())
        self.tools = tools
        self.history_messages = history_messages
        self._sessions: dict[str, _TextSession] = {}
        #: the cancel scopes of the turns running here, by turn id
        self.scopes: dict[str, TurnScope] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False
        #: a drain halts the running turns for another worker instead of stopping them
        self._releasing = False
        #: turns another worker took over from here (this one stalled): end without writes
        self._lost: set[str] = set()
        #: turns whose stop is being settled here (their ledger resolved, a
        #: reversal perhaps under way): a shutdown waits for them, never cuts them
        self._settling: set[str] = set()

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

        Args:
            deadline_s / budget: tighter limits than the tenant's plan (the
                plan's apply where these are None; a request can never
                raise them above the plan).

        Returns:
            The RUNNING turn (its progress is in the session's event log).

        Raises:
            PermissionError: ``session_id`` belongs to another tenant.
            turn.store.WrongSessionKind: ``session_id`` is a voice session.
            RuntimeError: the server is shutting down.
        """
        if self._closing:
            raise RuntimeError("shutting down")
        plan = self.plans(tenant_id)
        session = await self.manager.ensure_session(
            session_id or uuid.uuid4().hex, tenant_id=tenant_id, kind=TurnKind.TEXT
        )
        ts = self._sessions.get(session.id)
        if ts is None:
            ts = self._sessions[session.id] = _TextSession(GenerationFence(self.clock, active=session.generation))
        llm = self.llm()
        turn = await self.manager.open_turn(
            session.id,
            kind=TurnKind.TEXT,
            tenant_id=tenant_id,
            transcript=text,
            deadline_s=min(deadline_s, plan.deadline_s) if deadline_s is not None else None,
            budget=_tighter(budget, plan.budget),
            plan=plan,
            pricing=llm.pricing,
        )
        ts.fence.active = max(ts.fence.active, turn.generation)  # the older turns' output is fenced now
        self.manager.events.log(session.id, gate=ts.fence)
        older = list(ts.running.values())
        for older_id in list(ts.running):
            bg = asyncio.get_running_loop().create_task(self._supersede(older_id))
            self._background.add(bg)
            bg.add_done_callback(self._background.discard)
        task = asyncio.get_running_loop().create_task(self._run(turn, llm, plan, older), name=f"text-turn-{turn.id}")
        ts.running[turn.id] = task
        task.add_done_callback(functools.partial(_forget, ts.running, turn.id))
        return turn

    async def _supersede(self, turn_id: str) -> None:
        reason = StopReason(kind=StopReasonKind.BARGE_IN, initiator="text", at=self.clock.now(), detail="a newer message")
        try:
            await self.manager.request_stop(turn_id, reason)
        except Exception:
            log.exception("turn %s: could not stop it for a newer message", turn_id)

    async def _run(
        self, turn: Turn, llm: LanguageModel, plan: Plan, older: list[asyncio.Task[None]], resumed: Resumed | None = None
    ) -> None:
        """Answer in the turn's cancel scope, or stop when asked (signal, a
        checkpoint that read the store, or a limit) and write exactly one
        terminal state from the children's reports. ``older``: the tasks of
        the turns this one superseded (see :func:`voice.history.earlier_turns_wait_s`)."""
        rt = self.manager.runtime(turn.id)
        scope = open_scope(
            self.manager, turn.id, self.clock, grace_s=self.stop_grace_s, shutdown_reserve_s=plan.shutdown_reserve_ms / 1000
        )
        self.scopes[turn.id] = scope
        try:
            async with scope:
                try:
                    await self._work(turn, llm, scope, older, resumed=resumed)
                except asyncio.CancelledError:
                    if turn.id in self._lost:
                        scope.stop(None)  # the children end; the turn is another worker's now
                        raise
                    reason = StopReason(kind=StopReasonKind.WORKER_SHUTDOWN, initiator="server", at=self.clock.now())
                    if self._releasing:
                        # A drain: halt at the next checkpoint, for another
                        # worker to go on (turn.resume); no stop is recorded.
                        if rt is not None:
                            rt.meter.mark_stopped()  # what streams from now on is waste
                        scope.stop(reason)
                        raise
                    # The server is shutting down. The stop is recorded now,
                    # before the children wind down (a must-complete call
                    # may still commit, and that is after this stop).
                    scope.stop(reason)
                    await asyncio.shield(self._request_stop(turn.id, reason))
                    raise
        except asyncio.CancelledError:
            if turn.id in self._lost:
                raise  # nothing is written from here: the worker that took it over settles it
            # every child has ended: resolve the ledger and write the terminal
            # state, or (a drain) release the turn with its last checkpoint
            settle = self._release if self._releasing else self._settle_shutdown
            await asyncio.shield(settle(turn.id, scope))
            raise
        except Exception:
            log.exception("text turn %s: stop handling failed", turn.id)
        finally:
            self.manager.release(turn.id)
            if scope.stopped.is_set() and turn.id not in self._lost:
                await record_late_usage(self.manager, turn.id, rt)
            self._lost.discard(turn.id)
            self.scopes.pop(turn.id, None)

    def lease_lost(self, turn_id: str) -> None:
        """:attr:`turn.checkpoint.Checkpoints.on_lease_lost`: the manager
        found ``turn_id`` leased to another worker (this one stalled past
        the lease TTL and the other took it over): cancel its work here,
        which then ends without writing anything."""
        for ts in self._sessions.values():
            task = ts.running.get(turn_id)
            if task is not None and not task.done():
                self._lost.add(turn_id)
                task.cancel()

    async def _work(
        self, turn: Turn, llm: LanguageModel, scope: TurnScope, older: list[asyncio.Task[None]], *, resumed: Resumed | None = None
    ) -> None:
        """Inside the scope: run the agent child until it ends or a stop
        comes, then write the terminal state."""
        try:
            agent: Child | None = scope.spawn("agent", self._answer(turn, llm, scope, older, resumed=resumed))
        except TurnStopped:
            agent = None  # no time left at all: the scope stopped itself (deadline_exceeded)
        if agent is not None:
            stop = asyncio.ensure_future(self.manager.stop_event(turn.id).wait())
            ended = asyncio.ensure_future(agent.done.wait())
            try:
                await asyncio.wait({stop, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                ended.cancel()
            if not agent.done.is_set() and not scope.stopped.is_set():
                scope.stop(None)  # asked from outside: the reason is in the store
        if scope.stopped.is_set():
            self._settling.add(turn.id)
            try:
                await self.manager.settle_stop(turn.id, scope)
            finally:
                self._settling.discard(turn.id)
        elif agent is not None and agent.error is not None:
            ts = self._sessions.get(turn.session_id)
            generation = ts.fence.active if ts is not None else turn.generation  # as voice: in the active generation
            await fail(self.manager, turn.id, generation, agent.error, self.manager.events.log(turn.session_id).emit_event)

    async def _request_stop(self, turn_id: str, reason: StopReason) -> None:
        try:
            await self.manager.request_stop(turn_id, reason)
        except Exception:
            log.exception("text turn %s: could not record the shutdown's stop request", turn_id)

    async def _release(self, turn_id: str, scope: TurnScope) -> None:
        """After a drain halted the turn: its in-flight effects settled by
        the ``worker_shutdown`` policy (as for a stop), then released with
        its last checkpoint (:meth:`turn.manager.TurnManager.release_for_resume`)."""
        try:
            await self.manager.ledger.resolve_on_stop(turn_id, StopReasonKind.WORKER_SHUTDOWN, self.clock.now())
            res = await self.manager.release_for_resume(turn_id)
            if not res.applied:  # stopped or ended meanwhile: that stands
                await self.manager.settle_stop(turn_id, scope)
        except Exception:
            log.exception("text turn %s: could not release it", turn_id)

    async def _settle_shutdown(self, turn_id: str, scope: TurnScope) -> None:
        """After a shutdown stopped the turn: the ledger is resolved and the
        terminal state written from the children's reports, as for any stop."""
        try:
            await self.manager.settle_stop(turn_id, scope)
        except Exception:
            log.exception("text turn %s: could not record the shutdown", turn_id)

    async def _answer(
        self, turn: Turn, llm: LanguageModel, scope: TurnScope, older: list[asyncio.Task[None]], *, resumed: Resumed | None = None
    ) -> None:
        """The work: history, the agent loop, reply recorded, COMPLETED. The
        history is read once the turns this one superseded have ended (at
        most :func:`voice.history.earlier_turns_wait_s`), so it holds what they delivered and
        how their tool calls ended, not a snapshot from mid-stop."""
        events = self.manager.events.log(turn.session_id)
        events.track_delivery(turn.id)
        parts: list[str] = []
        unheard: list[str] = []

        def delivered(token: str) -> None:
            parts.append(token)
            events.emit_event(AgentDelta(generation=turn.generation, turn_id=turn.id, text=token))

        def withheld(token: str) -> None:
            unheard.append(token)
            events.emit_event(AgentDelta(generation=turn.generation, turn_id=turn.id, text=token), withheld=True)

        if not resumed:  # a resumed turn's request was logged by its first worker
            events.emit_event(Transcript(generation=turn.generation, turn_id=turn.id, role="user", text=turn.transcript or ""))
        else:  # what its first worker streamed is void: the reply comes again from its start
            events.emit_event(AgentRestart(generation=turn.generation, turn_id=turn.id, reason=resumed))
        final = False
        try:
            messages = await history_after(
                self.manager,
                turn,
                older,
                wait_s=earlier_turns_wait_s(int(self.stop_grace_s * 1000)),
                max_messages=self.history_messages,
            )
            if resumed:  # its own steps so far, as the ledger holds them: done ones are never run again
                if not await self.manager.settle_cut_off(turn.id):
                    await self.manager.request_stop(turn.id, StopReason(
                        kind=StopReasonKind.WORKER_SHUTDOWN, initiator="server", at=self.clock.now(),
                        detail="an effect its first worker had in flight could not be confirmed",
                    ))
                    scope.stop(None)  # recorded in the store just now; the ledger then decides the end
                    raise TurnStopped(turn.id, "resume")
                intents = await self.manager.store_call(lambda: self.manager.store.ledger_list(turn.id))
                messages += tool_messages(intents, resumed=True)
            result = await run_agent(
                scope=scope,
                manager=self.manager,
                turn_id=turn.id,
                generation=turn.generation,
                llm=llm,
                messages=messages,
                toolbox=self.tools() if self.tools else None,
                on_token=sink_to(delivered, withheld),
                on_event=events.emit_event,
            )
            generated = result.text.strip()

            def done(applied: bool, reply: str) -> None:
                if applied:
                    events.emit_event(AgentDone(generation=turn.generation, turn_id=turn.id, text=reply))

            final = True
            # what the client was shown (a newer message may have fenced the end), then COMPLETED
            await finish(scope, self.manager, turn.id, lambda: self._heard(events, turn.id, generated), done)
        except BaseException:
            if (parts or unheard) and not final:  # what was delivered before the stop (waited for, then the stop goes on)
                with contextlib.suppress(TurnStopped):  # the stop already under way is re-raised below
                    await scope.commit(self._record_partial(turn.id, "".join(parts), "".join(unheard)), effect=False)
            else:
                events.take_delivered(turn.id)  # nothing to record: stop tracking it (no entry left per turn)
            raise

    async def _heard(self, events: SessionEventLog, turn_id: str, generated: str) -> tuple[str | None, str | None]:
        """(the part of ``generated`` the client can have received: the text
        of the turn's deltas the log stored deliverable; the rest), once the
        log has written what was emitted. A delta emitted before a stop (or a
        newer message) but written after it is stored fenced: nobody saw
        it, so it is not part of the reply."""
        await events.flush()
        shown = events.take_delivered(turn_id)
        rest = generated[len(shown):] if generated.startswith(shown) else ""
        return shown.strip() or None, rest.strip() or None

    async def _record_partial(self, turn_id: str, delivered: str, withheld: str) -> None:
        """A stopped turn's reply: what reached the client, and apart (for
        audit, never for a model) what was generated but not shown."""
        try:
            events = self.manager.events.log((await self.manager.get(turn_id)).session_id)
            shown, rest = await self._heard(events, turn_id, delivered + withheld)
            await self.manager.record(turn_id, reply=shown, reply_unheard=rest)
        except Exception:
            log.exception("turn %s: could not record its partial reply", turn_id)

    def _running(self) -> list[asyncio.Task[None]]:
        return [t for ts in self._sessions.values() for t in ts.running.values() if not t.done()]

    def running_count(self) -> int:
        """Text turns running here now."""
        return len(self._running())

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no text turn runs here, at most ``timeout_s`` of the
        clock; True if none runs (turns that start meanwhile count too)."""
        try:
            async with timeout_after(self.clock, timeout_s):
                while running := self._running():
                    await asyncio.wait(running)
        except TimeoutError:
            return False
        return True

    async def release_all(self) -> None:
        """A drain: halt every running text turn at its next checkpoint and
        release it for another worker (:mod:`turn.resume`); new turns are
        refused from now on. Waits for them (at most 10 s)."""
        self._releasing = True
        await self.aclose()

    async def resume(self, turn_id: str) -> bool:
        """Adopt the released text turn ``turn_id`` and run it on from its
        ledger here. False if it was not ours to take (not released,
        another worker took it, this instance is closing)."""
        if self._closing:
            return False
        llm = self.llm()
        turn = await self.manager.adopt(turn_id, pricing=llm.pricing)
        if turn is None:
            return False
        await self._run_on(turn, llm, "adopted")
        return True

    async def take_over(self, seen: Turn) -> TakeOver:
        """The sweeper's offer (:attr:`turn.lease.Leases.take_over_abandoned`):
        run on here the text turn ``seen``, RUNNING with its worker gone
        (killed, crashed; a restart finds its own). A voice turn cannot go
        on without its call: NOT_RESUMABLE, the sweeper stops it. A draining
        instance leaves it to one that serves (LOST)."""
        if seen.kind is not TurnKind.TEXT:
            return TakeOver.NOT_RESUMABLE
        if self._closing or self._releasing:
            return TakeOver.LOST
        llm = self.llm()
        turn = await self.manager.take_over(seen, pricing=llm.pricing)
        if turn is None:
            return TakeOver.LOST
        if self._closing:  # the shutdown began while it was being taken: hand it on untouched
            res = await self.manager.release_for_resume(turn.id)
            self.manager.release(turn.id)
            return TakeOver.TAKEN if res.applied else TakeOver.NOT_RESUMABLE
        await self._run_on(turn, llm, "taken_over")
        return TakeOver.TAKEN

    async def _run_on(self, turn: Turn, llm: LanguageModel, how: Resumed) -> None:
        """Run a turn leased here from another worker (adopted or taken
        over) on from its ledger, in its session's fence and event log."""
        session = await self.manager.store_call(lambda: self.manager.store.get_session(turn.session_id))
        ts = self._sessions.get(session.id)
        if ts is None:
            ts = self._sessions[session.id] = _TextSession(GenerationFence(self.clock, active=session.generation))
        self.manager.events.log(session.id, gate=ts.fence)
        task = asyncio.get_running_loop().create_task(
            self._run(turn, llm, self.plans(turn.tenant_id), [], resumed=how), name=f"text-turn-{turn.id}"
        )
        ts.running[turn.id] = task
        task.add_done_callback(functools.partial(_forget, ts.running, turn.id))
        if session.generation > turn.generation:  # a newer message came meanwhile: it supersedes this one
            await self._supersede(turn.id)

    async def resume_released(self) -> int:
        """Adopt every released text turn of the store (at startup, and
        from the sweeper); returns how many were taken here."""
        taken = 0
        for turn in await self.manager.store_call(self.manager.store.list_open):
            if turn.released and turn.kind is TurnKind.TEXT:
                try:
                    taken += await self.resume(turn.id)
                except Exception:
                    log.exception("turn %s: could not be resumed here", turn.id)
        return taken

    async def aclose(self) -> None:
        """Stop every running text turn with ``worker_shutdown`` and wait
        (at most 10 s; the server's grace bounds it too). A turn whose stop
        is being settled (a user's cancel reversing an order) is not cut:
        it is waited for, so its reversal finishes and its terminal state is
        written here."""
        self._closing = True
        running = [(tid, t) for ts in self._sessions.values() for tid, t in ts.running.items()]
        tasks = [t for _, t in running] + list(self._background)
        settling = [tid for tid, _ in running if tid in self._settling]
        if settling:
            log.info("text turns %s: their stops are being settled; waiting for them", ", ".join(settling))
        for tid, t in running:
            if tid not in self._settling:
                t.cancel()
        for t in self._background:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for session_id in list(self._sessions):
            await self.manager.events.close(session_id)
        self._sessions.clear()


def _tighter(asked: Budget | None, plan: Budget) -> Budget:
    """The smaller of a request's budget and the plan's, field by field."""
    if asked is None:
        return plan

    def low(a: Any, b: Any) -> Any:
        return b if a is None else a if b is None else min(a, b)

    return Budget(cents=low(asked.cents, plan.cents), tokens=low(asked.tokens, plan.tokens))
