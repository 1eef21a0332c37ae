"""Fault injector and fuzzer for the side-effect ledger.

Each iteration runs one scripted turn through the real text-turn worker
(cancel scope, agent loop, checkpoints, ledger, demo tools on the
in-process :class:`demo_shop.service.DemoService`) on a virtual clock and
the SQLite store, with random faults in the external system, and usually
stops it: at a random checkpoint (the injector requests the stop as that
checkpoint begins) or at a random moment (mid-call included), with a random
stop reason, or supersedes it with a newer message in its session at a
random moment (a real barge-in: the newer turn's history is read once the
old one has ended). The downstream (message) worker runs all along, so a stop may
land while it sends. Then the reconciliation and downstream workers run
until nothing is left for them, and the invariants are checked:

1. no ledger row is left pending (pending, effect_unknown, retrying);
2. every external effect is applied at most once, under its intent's key,
   and nothing is applied that the ledger does not know of (each queued
   message has its own row); a queued message of a stopped turn applied
   after its stop is in the ledger as done and its turn is
   RECONCILE_REQUIRED, never CANCELLED;
3. every turn has exactly one terminal state, consistent with its ledger:
   a CANCELLED (or limit-FAILED) turn keeps no effect after its stop; a
   compensated effect is reversed in the external system; a done one is
   applied there;
4. a stop never reverses an effect that was done before it unless its
   policy reverses committed steps (only a safety abort does): no
   compensation is even attempted for one (a barge-in means "I want to
   speak now", not "undo"; a stop after a step committed is a no-op for
   that step, :mod:`turn.stop_policy`);
5. what the next model request is actually sent (a follow-up turn in the
   same session, read from the model's own input) matches the external
   system and what the client was shown: each tool call of the turn with
   its outcome ("done" only if the effect stands there, "done, then
   reversed" only if it was reversed there, "not done" only if it never
   happened), and as the turn's reply exactly the text the client received
   (its ``agent.delta`` events logged deliverable), nothing withheld.

``python -m testkit.fuzz --iterations N [--seed S] [--json]`` runs it by hand
(exit status 0: every invariant held; 1: one broke; 2: bad arguments). A seed fixes
the scripts, the stops and the faults; the interleaving with the store's
thread is real, so two runs of one seed may take slightly different paths.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import random
import sys
import tempfile
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from clock import VirtualClock
from demo_shop.service import DemoService
from demo_shop.tools import MESSAGES_QUEUE, demo_handlers, demo_tools, message_sender
from testkit.fuzz_report import FuzzReport, print_report
from testkit.scripted_model import ScriptedModel
from turn.downstream import turn_stopped
from turn.intents import RESOLVED, IntentKind, IntentStatus, compensation_key
from turn.manager import TurnManager
from turn.models import Plan, StopReason, StopReasonKind, Turn, TurnStatus
from turn.sqlite_store import SqliteStore
from turn.stop_policy import Stage, policy_for, stage_at_stop
from turn.stopped import LIMIT_KINDS
from voice.history import REVERSING
from voice.providers import Message, ToolCall
from voice.text_turns import TextTurns

log = logging.getLogger(__name__)

TOOLS = ("lookup_weather", "create_order", "charge_payment", "send_messages")
REASONS = (
    StopReasonKind.USER_CANCEL,
    StopReasonKind.BARGE_IN,
    StopReasonKind.SAFETY_ABORT,
    StopReasonKind.WORKER_SHUTDOWN,
)
FAULTS = ("fail_before", "fail_after", "slow")
#: the words of the turn that follows each fuzzed one in its session
FOLLOW_UP = "what happened"


class _Injector:
    """Requests a stop as the n-th checkpoint of the armed turn begins."""

    def __init__(self, manager: TurnManager) -> None:
        self.manager = manager
        self.turn_id: str | None = None
        self.at = -1
        self.seen = 0
        self.reason: StopReason | None = None
        self.fired = False
        original = manager.checkpoint

        async def checkpoint(turn_id: str, phase: str, **kw: Any) -> None:
            if turn_id == self.turn_id and not self.fired:
                self.seen += 1
                if self.seen == self.at and self.reason is not None:
                    self.fired = True
                    # stamped as it is requested, as a real caller does
                    await manager.request_stop(turn_id, self.reason.model_copy(update={"at": manager.clock.now()}))
            await original(turn_id, phase, **kw)

        manager.checkpoint = checkpoint  # type: ignore[method-assign]

    def arm(self, turn_id: str, at: int, reason: StopReason | None) -> None:
        self.turn_id, self.at, self.seen, self.reason, self.fired = turn_id, at, 0, reason, False


async def _drive(clock: VirtualClock, done: Callable[[], bool], *, step: float = 0.02, limit_s: float = 3600) -> None:
    """Advance virtual time until ``done()``, letting the store's thread
    finish between steps."""
    waited = 0.0
    while not done():
        if waited > limit_s:
            raise TimeoutError("the fuzzed turn did not settle")
        await clock.advance(step)
        await asyncio.sleep(0.0002)
        waited += step


async def fuzz(iterations: int, seed: int = 1, *, folder: Path | None = None) -> FuzzReport:
    """Run ``iterations`` scripted turns with injected stops and faults and
    check the invariants (module doc).

    Raises:
        ValueError: ``iterations`` < 1.
    """
    if iterations < 1:
        raise ValueError("iterations must be at least 1")
    rng = random.Random(seed)
    report = FuzzReport(iterations, seed)
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="turnkeeper-fuzz-")))
        clock = VirtualClock()
        store = SqliteStore(folder / "fuzz.db")
        await store.open()
        service = DemoService(clock, latency_s=0.02)
        manager = TurnManager(store, clock, owner="fuzz")
        toolbox = demo_tools(clock, service, store)
        manager.ledger.handlers = demo_handlers(lambda: toolbox, service)
        injector = _Injector(manager)
        script: list[list[ToolCall]] = []
        requests: list[list[Message]] = []
        turns = TextTurns(
            manager,
            lambda: ScriptedModel(list(script), clock, requests=requests),  # each turn its own script
            clock,
            plans=lambda _t: Plan(deadline_s=60, max_steps=32),
            tools=lambda: toolbox,
        )
        skipped: list[dict[str, Any]] = []
        sender = message_sender(service, store, clock, consumer="fuzz", on_skip=skipped.append)
        worker = manager.reconciliation_worker()
        # the message worker runs all along, so a stop can land while it sends
        sending = asyncio.ensure_future(sender.run(poll_s=0.01))
        try:
            for n in range(iterations):
                script[:] = _random_script(rng)
                _random_faults(rng, service)
                session = f"fuzz-{n}-{uuid.uuid4().hex[:6]}"
                turn = await turns.start(tenant_id="fuzz", text="do the scripted things", session_id=session)
                mode = rng.choices(("checkpoint", "moment", "supersede", "none"), weights=(5, 4, 2, 1))[0]
                reason = StopReason(kind=rng.choice(REASONS), initiator="fuzz", at=clock.now())
                report.stops[mode] += 1
                if mode == "checkpoint":
                    injector.arm(turn.id, rng.randint(1, 2 + 3 * len(script)), reason)
                else:
                    injector.arm(turn.id, -1, None)
                if mode == "moment":
                    delay = rng.uniform(0, 0.2 + 0.1 * len(script))
                    asyncio.get_running_loop().call_soon(_start_stop_later, manager, clock, turn.id, delay, reason)
                follow: Turn | None = None
                sent_before = len(requests)
                if mode == "supersede":  # a newer message in the session: a real barge-in
                    t0, delay = clock.monotonic(), rng.uniform(0, 0.2 + 0.1 * len(script))
                    await _drive(clock, functools.partial(_elapsed, clock, t0, delay))
                    script[:] = []
                    follow = await turns.start(tenant_id="fuzz", text=FOLLOW_UP, session_id=session)
                await _drive(clock, functools.partial(_finished, turns, turn.id))
                service.clear_faults()
                await _settle_workers(clock, store, sender, worker)
                await _check(manager, store, service, turn.id, report)
                # invariant 5: what the next request of this session is sent
                if follow is None:
                    script[:] = []
                    sent_before = len(requests)
                    follow = await turns.start(tenant_id="fuzz", text=FOLLOW_UP, session_id=session)
                await _drive(clock, functools.partial(_finished, turns, follow.id))
                await _check_history(manager, store, service, turn.id, requests[sent_before:], report)
            report.messages_sent = sender.done
            report.messages_skipped = len(skipped)
            report.effects_applied = len(await service.applied())
        finally:
            sending.cancel()
            await asyncio.wait([sending])
            await turns.aclose()
            await manager.events.aclose()
            await store.close()
            await service.aclose()
    return report


def _running(turns: TextTurns, turn_id: str) -> bool:
    return any(turn_id in s.running for s in turns._sessions.values())


def _finished(turns: TextTurns, turn_id: str) -> bool:
    """The text turn has no scope and no task left."""
    return turn_id not in turns.scopes and not _running(turns, turn_id)


def _elapsed(clock: VirtualClock, t0: float, delay_s: float) -> bool:
    """``delay_s`` of virtual time passed since ``t0``."""
    return clock.monotonic() - t0 >= delay_s


def _start_stop_later(manager: TurnManager, clock: VirtualClock, turn_id: str, delay_s: float, reason: StopReason) -> None:
    """Loop callback: request the stop ``delay_s`` from now (fire and forget, as a client would)."""
    asyncio.ensure_future(_stop_later(manager, clock, turn_id, delay_s, reason))


async def _stop_later(manager: TurnManager, clock: VirtualClock, turn_id: str, delay: float, reason: StopReason) -> None:
    await clock.sleep(delay)
    with contextlib.suppress(Exception):
        await manager.request_stop(turn_id, reason.model_copy(update={"at": clock.now()}))


def _random_script(rng: random.Random) -> list[list[ToolCall]]:
    steps = []
    for s in range(rng.randint(1, 4)):
        calls = []
        for c in range(rng.choice((1, 1, 1, 2))):
            name = rng.choice(TOOLS)
            args: dict[str, Any] = {"n": rng.randint(1, 4)} if name == "send_messages" else {}
            calls.append(ToolCall(id=f"c{s}{c}", name=name, arguments=args))
        steps.append(calls)
    return steps


def _random_faults(rng: random.Random, service: DemoService) -> None:
    for op in ("order", "payment", "batch", "reverse", "lookup"):
        if rng.random() < 0.15:
            fault = "lookup_unknown" if op == "lookup" else rng.choice(FAULTS)
            service.inject(op, fault)


async def _settle_workers(clock: VirtualClock, store: SqliteStore, sender: Any, worker: Any) -> None:
    """Run the downstream and reconciliation workers until nothing is left
    for them (backoffs are waited out on the virtual clock)."""
    for _ in range(200):
        claimed = await _run_on(clock, sender.run_once(100))
        acted = await _run_on(clock, worker.run_once())
        if not claimed and not acted:
            if await store.ledger_open_count() == 0 and await store.queue_pending("outbound_messages") == 0:
                return
            await clock.advance(60)  # wait out a backoff
    raise TimeoutError("workers did not settle")


async def _run_on(clock: VirtualClock, coro: Any) -> Any:
    task = asyncio.ensure_future(coro)
    await _drive(clock, task.done)
    return task.result()


async def _check(manager: TurnManager, store: SqliteStore, service: DemoService, turn_id: str, report: FuzzReport) -> None:
    turn: Turn = await manager.get(turn_id)
    intents = await store.ledger_list(turn_id)
    bad = report.violations.append
    report.terminal[turn.status.value] += 1
    for i in intents:
        report.intents[f"{i.kind.value}:{i.status.value}"] += 1
    # 3a. exactly one terminal state
    await manager.events.log(turn.session_id).flush()
    events = await store.read_events(turn.session_id, 0, 10_000)
    terminal_events = [e for e in events if e.type == "turn" and e.turn_id == turn_id and TurnStatus(e.payload["status"]).is_terminal]
    if not turn.is_terminal or len(terminal_events) != 1:
        bad(f"one_terminal_state_consistent_with_ledger: turn {turn_id} is {turn.status} with {len(terminal_events)} terminal writes")
    # 1. nothing left pending
    for i in intents:
        if i.status not in RESOLVED and i.status is not IntentStatus.HUMAN_REQUIRED:
            bad(f"no_row_left_pending: {i.key} ({i.kind.value}) is {i.status.value}")
    # 2. effects: each under its own key, at most once, none unknown to the ledger
    applied = await service.applied(turn_id)
    keys = {i.key for i in intents if i.kind is IntentKind.EFFECT}
    rows = {i.key: i for i in intents}
    for key, eff in applied.items():
        base = key if eff["op"] != "message" else key.rsplit(":", 1)[0]
        if base not in keys or key not in keys:
            bad(f"effect_at_most_once: {key} was applied but the ledger has no intent {key if base in keys else base}")
        times = await service.times_applied(key)
        if times > 1:
            bad(f"effect_at_most_once: {key} applied {times} times")
        if await service.repeats(key):
            bad(f"effect_at_most_once: {key} was sent again after it had been applied (a blind retry)")
        if eff["op"] == "message" and turn.stop_reason is not None and turn_stopped(turn):
            row = rows.get(key)
            stop_at = turn.stop_reason.at
            if datetime.fromisoformat(eff["applied_at"]) > stop_at:
                # only an item already on its way at the stop (its intent
                # written before it) may land after it, and then the ledger
                # and the terminal state must say so
                if row is None or row.created_at > stop_at:
                    bad(f"effect_at_most_once: message {key} of a stopped turn was sent after the stop, "
                        "though it was not yet on its way when the stop was recorded")
                elif turn.status is not TurnStatus.RECONCILE_REQUIRED or row.status is not IntentStatus.DONE:
                    bad(f"effect_at_most_once: message {key} of a stopped turn was sent after the stop, "
                        f"and the turn is {turn.status} with its row {row.status}")
    # 3b. consistency of terminal state and ledger
    stop = turn.stop_reason
    policy = policy_for(stop.kind if stop else None)
    for i in intents:
        if i.kind is not IntentKind.EFFECT or i.effect == "none":
            continue
        found = applied.get(i.key)
        if i.status is IntentStatus.DONE and (found is None or found["reversed"]):
            bad(f"one_terminal_state_consistent_with_ledger: {i.key} is done but not applied")
        if i.status is IntentStatus.COMPENSATED and found is not None and not found["reversed"]:
            bad(f"one_terminal_state_consistent_with_ledger: {i.key} is compensated but still applied")
        if i.status is IntentStatus.ABANDONED and found is not None and not found["reversed"]:
            bad(f"one_terminal_state_consistent_with_ledger: {i.key} is abandoned but was applied")
    cancelled_like = turn.status is TurnStatus.CANCELLED or (
        turn.status is TurnStatus.FAILED and stop is not None and stop.kind in LIMIT_KINDS
    )
    if cancelled_like and stop is not None:
        for i in intents:
            if i.kind is not IntentKind.EFFECT or i.effect == "none":
                continue
            queued_work_goes_on = i.tool == MESSAGES_QUEUE and policy.finish_queued  # by policy (worker_shutdown)
            if i.status is IntentStatus.DONE and i.done_at is not None and i.done_at > stop.at and not queued_work_goes_on:
                bad(f"one_terminal_state_consistent_with_ledger: {turn.status} turn {turn_id} has {i.key} done after its stop")
            if i.status is IntentStatus.DONE and policy.compensates(i, stop.at):
                bad(f"one_terminal_state_consistent_with_ledger: {turn.status} turn {turn_id} kept {i.key}, which its stop reverses")
            if i.status is IntentStatus.HUMAN_REQUIRED:
                bad(f"one_terminal_state_consistent_with_ledger: {turn.status} turn {turn_id} has {i.key} unresolved")
    if turn.status is TurnStatus.COMPLETED and any(i.status is IntentStatus.COMPENSATED for i in intents):
        bad(f"one_terminal_state_consistent_with_ledger: completed turn {turn_id} had an effect reversed")
    # 4. a stop keeps what was done before it (unless it is a safety abort)
    if stop is not None and not policy.compensate_done:
        jobs = {i.key for i in intents if i.kind is IntentKind.COMPENSATION}
        for i in intents:
            if i.kind is not IntentKind.EFFECT or stage_at_stop(i, stop.at) is not Stage.DONE_BEFORE_STOP:
                continue
            report.kept_through_stop += 1
            found = applied.get(i.key)
            if i.status is IntentStatus.COMPENSATED or compensation_key(i.key) in jobs or (found is not None and found["reversed"]):
                bad(
                    f"stop_keeps_done_effects: {i.key} was done before the {stop.kind.value} of turn {turn_id}"
                    f" and was reversed ({i.status.value})"
                )


async def _check_history(
    manager: TurnManager, store: SqliteStore, service: DemoService, turn_id: str,
    sent: list[list[Message]], report: FuzzReport,
) -> None:
    """Invariant 5 (module doc): the follow-up turn's first model request,
    against the external system and the event log of ``turn_id``."""
    bad = report.violations.append
    name = "history_matches_ledger_and_heard"
    turn: Turn = await manager.get(turn_id)
    ours = [r for r in sent if r and r[-1].role == "user" and r[-1].content == FOLLOW_UP]
    if not ours:
        bad(f"{name}: the turn after {turn_id} sent the model nothing that ends with its own words")
        return
    first = ours[0]
    earlier = first[:-1]
    report.histories_checked += 1
    if not earlier or earlier[0].role != "user" or earlier[0].content != turn.transcript:
        bad(f"{name}: the request after {turn_id} does not start with that turn's words")
        return
    rows = {i.key: i for i in await store.ledger_list(turn_id) if i.kind is IntentKind.EFFECT}
    applied = await service.applied(turn_id)
    calls = {c.id: c for m in earlier if m.tool_calls for c in m.tool_calls}
    for m in (m for m in earlier if m.role == "tool"):
        call = calls.get(m.tool_call_id or "")
        row = rows.get(m.tool_call_id or "")
        if call is None or row is None:
            bad(f"{name}: a tool result {m.tool_call_id} with no call or no ledger row")
            continue
        unsettled = m.status in (IntentStatus.EFFECT_UNKNOWN.value, IntentStatus.HUMAN_REQUIRED.value, REVERSING)
        if m.status != row.status.value and not unsettled:  # "being checked" is true until it is settled
            bad(f"{name}: {row.key} told as {m.status}, the ledger says {row.status.value}")
        eff = applied.get(row.key)
        if row.effect == "none":
            continue
        stands = eff is not None and not eff["reversed"]
        if m.status == IntentStatus.DONE.value and not stands:
            bad(f"{name}: {row.key} told done, but it does not stand in the external system")
        if m.status == IntentStatus.COMPENSATED.value and not (eff is not None and eff["reversed"]):
            bad(f"{name}: {row.key} told done, then reversed, but nothing was reversed there")
        if m.status == IntentStatus.ABANDONED.value and stands:
            bad(f"{name}: {row.key} told not done, but it stands in the external system")
    told = {m.tool_call_id for m in earlier if m.role == "tool"}
    for key, row in rows.items():
        if key == f"{turn_id}:{row.step}" and key not in told:
            bad(f"{name}: {key} ({row.tool}) is in the ledger but the model was not told of it")
    events = await store.read_events(turn.session_id, 0, 100_000)
    heard = "".join(
        str(e.payload.get("text", "")) for e in events
        if e.turn_id == turn_id and e.type == "agent.delta" and not e.fenced and not e.payload.get("withheld")
    ).strip()
    replies = [m for m in earlier if m.role == "assistant" and not m.tool_calls]
    said = replies[-1].content if replies else ""
    if said != heard:
        bad(f"{name}: the model is told {turn_id} said {said[:60]!r}, the client received {heard[:60]!r}")
    if replies and turn.status is not TurnStatus.COMPLETED and not replies[-1].interrupted:
        bad(f"{name}: {turn_id}'s reply is not marked interrupted though the turn was {turn.status}")


def main(argv: list[str] | None = None) -> int:
    """``python -m testkit.fuzz [--iterations N] [--seed S] [--json]``:
    run :func:`fuzz` and print its report (one JSON object with ``--json``).

    Returns:
        the exit status: 0 every invariant held, 1 one broke, 2 bad
        arguments.
    """
    parser = argparse.ArgumentParser(
        prog="python -m testkit.fuzz",
        description="cancel scripted turns at random checkpoints and check the ledger's invariants",
    )
    parser.add_argument("--iterations", type=int, default=1000, help="scripted turns to run (default 1000)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1): fixes scripts, stops and faults")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the counts")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        print("testkit.fuzz: --iterations must be at least 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    report = asyncio.run(fuzz(args.iterations, args.seed))
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print_report(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
