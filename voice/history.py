"""The conversation history a model is given, built in one place for voice
and text turns alike, from the store (the authority: any instance may have
run the earlier turns, over any transport).

For each earlier turn of the session, in order:

1. the user's words (``Turn.transcript``);
2. each tool call the turn made, as the ledger recorded it, with its
   outcome (:func:`tool_outcome_text`): the result of a call that was done
   (never run again), "cancelled: it was not done", or "cancelled: it was
   done, then reversed" only when the external system's effect was actually
   reversed ("it was done and is being reversed" while the stop's reversal
   is still under way);
3. the reply as far as the user heard it (``Turn.reply``; never
   ``reply_unheard``), marked interrupted when the turn did not complete.

A turn merged into a later one (``Turn.merged_into``: the user paused and
went on before any of its reply was heard) is left out whole, its
abandoned reads included: the later turn's words carry it. Ledger rows that
are not a tool call of the turn's own steps (the per-item rows of queued
downstream work) are not tool calls the model made, and are left out too.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable

from turn.intents import OPEN, Intent, IntentKind, IntentStatus, compensation_key, effect_key
from turn.manager import TurnManager
from turn.models import Turn, TurnStatus
from voice.providers import Message, ToolCall

#: messages of history a model sees at most (whole turns are kept or dropped)
HISTORY_MESSAGES = 40
#: a tool message's status while the stop's reversal of a done effect is
#: still under way (its compensation job is open)
REVERSING = "reversing"


def earlier_turns_wait_s(stop_grace_ms: int) -> float:
    """How long a new turn's history waits for the earlier turns of its
    session to record how they ended (their stop: heard text recorded,
    ledger resolved), s: four stop graces, at least one second. A slower
    stop (a compensation that goes on as a job) is told as it stands then
    ("outcome unknown: being checked"). The same for voice and text."""
    return max(1.0, 4 * stop_grace_ms / 1000)


def tool_outcome_text(intent: Intent) -> str:
    """What the model is told of an earlier tool call, from its ledger row
    (what the external system confirmed, see the module doc)."""
    status = intent.status
    if status is IntentStatus.DONE:
        # no result: the external system confirmed it by lookup, its own answer was lost
        return intent.result or "done (confirmed by the external system; its answer was lost)"
    if status is IntentStatus.COMPENSATED:
        return "cancelled: it was done, then reversed"
    if status is IntentStatus.ABANDONED:
        return "cancelled: it was not done"
    if status is IntentStatus.HUMAN_REQUIRED:
        return "outcome unknown: a person is checking it"
    return "outcome unknown: being checked with the external system"


def tool_messages(intents: list[Intent], *, resumed: bool = False) -> list[Message]:
    """A turn's tool calls as messages: for each of its own steps' effect
    rows (in step order), the assistant's call and the tool's outcome.

    ``resumed``: the rows are the turn's own steps so far, given to it as it
    runs on at another worker (released by a drain, or taken over after a
    crash). The calls its first worker's end cut off before they had any
    effect (abandoned: a read, or a call never sent) are left out. Nobody
    cancelled them, so "cancelled" would be untrue; the model decides again
    (a read is read again, under a new step's key)."""
    out: list[Message] = []
    own = [i for i in intents if i.kind is IntentKind.EFFECT and i.key == effect_key(i.turn_id, i.step)
           and not (resumed and i.status is IntentStatus.ABANDONED)]
    reversing = {i.key for i in intents if i.kind is IntentKind.COMPENSATION and i.status in OPEN}
    for i in sorted(own, key=lambda i: i.step):
        call = ToolCall(id=i.key, name=i.tool, arguments=i.args)
        out.append(Message(role="assistant", content="", tool_calls=[call]))
        if i.status is IntentStatus.DONE and compensation_key(i.key) in reversing:
            # its stop's reversal is still running (a slow shop): not "done"
            status, text = REVERSING, "cancelled: it was done and is being reversed"
        else:
            status, text = i.status.value, tool_outcome_text(i)
        out.append(Message(role="tool", tool_call_id=i.key, status=status, content=text))
    return out


def turn_messages(turn: Turn, intents: list[Intent]) -> list[Message]:
    """One earlier turn as history (see the module doc); [] for a merged
    turn."""
    if turn.merged_into:
        return []
    out: list[Message] = []
    if turn.transcript:
        out.append(Message(role="user", content=turn.transcript))
    out += tool_messages(intents)
    if turn.reply:
        out.append(Message(role="assistant", content=turn.reply, interrupted=turn.status is not TurnStatus.COMPLETED))
    return out


async def earlier_messages(
    manager: TurnManager, session_id: str, *, before: Turn | None = None, max_messages: int = HISTORY_MESSAGES
) -> list[Message]:
    """The session's history as the store holds it (module doc): its turns
    created before ``before`` (all of them if None), ``before`` excluded.

    Args:
        manager: the Turn Manager (its store is read).
        session_id: the session.
        before: the turn the history is for, or None.
        max_messages: at most this many messages; the oldest whole turns are
            dropped first, so a tool call is never separated from its
            outcome.

    Raises:
        turn.store.StoreUnavailable: the store could not be read.
    """
    store = manager.store
    turns = await manager.store_call(lambda: store.list_session(session_id))
    if before is not None:
        turns = [t for t in turns if t.id != before.id and t.created_at <= before.created_at]
    groups: list[list[Message]] = []
    total = 0
    for t in reversed(turns):
        if t.merged_into:
            continue
        intents = await manager.store_call(functools.partial(store.ledger_list, t.id))
        group = turn_messages(t, intents)
        if not group:
            continue
        if total + len(group) > max_messages:
            break
        groups.append(group)
        total += len(group)
    return [m for g in reversed(groups) for m in g]


async def session_history(
    manager: TurnManager, turn: Turn, *, max_messages: int = HISTORY_MESSAGES
) -> list[Message]:
    """The history for ``turn``'s model calls: :func:`earlier_messages`
    before it, then its own request (``turn.transcript``, which must be
    recorded already).

    Raises:
        turn.store.StoreUnavailable: the store could not be read.
    """
    earlier = await earlier_messages(manager, turn.session_id, before=turn, max_messages=max_messages)
    return [*earlier, Message(role="user", content=turn.transcript or "")]


async def history_after(
    manager: TurnManager,
    turn: Turn,
    earlier: Iterable[asyncio.Task[None]],
    *,
    wait_s: float,
    max_messages: int = HISTORY_MESSAGES,
) -> list[Message]:
    """:func:`session_history` for ``turn`` once the earlier turns of its
    session have recorded how they ended: their tasks still running
    (``earlier``: work and stop tasks) are waited for first, at most
    ``wait_s`` seconds (a stuck earlier turn costs this one that much at
    most; its history is then read as the store has it).

    Raises:
        turn.store.StoreUnavailable: the store could not be read.
    """
    pending = {task for task in earlier if not task.done()}
    if pending:
        await asyncio.wait(pending, timeout=wait_s)
    return await session_history(manager, turn, max_messages=max_messages)
