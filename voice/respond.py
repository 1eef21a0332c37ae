"""The agent loop of one turn, the same for voice and text turns.

:func:`run_agent` alternates model calls and tool calls until the model
answers without calling a tool. Every model call and every tool call is a
child of the turn's :class:`turn.scope.TurnScope` and is bracketed by
checkpoints (``before_model`` / ``after_model``, ``before_tool`` /
``after_tool``); while a model streams, every chunk passes a checkpoint
too, which costs no store round trip unless the cached stop flag is older
than the manager's staleness bound. A stop, a passed deadline, a spent
budget, too many steps or a tool loop raises
:class:`turn.stopped.TurnStopped`; nothing after it starts a model request.

The delivery gate: a token that arrives once the stop is recorded (the
manager's flag is set in the same step as the stop's compare-and-set, or as
its signal from another instance arrives, before the worker wakes) or after
the turn was stopped (from a provider that ignores cancellation) is
withheld (``on_token(..., withheld=True)``), never delivered; its cost is
still metered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from turn.event_catalogue import ToolCancelled, ToolError, ToolNotStarted, ToolStarted, Usage
from turn.intents import IntentStatus, effect_key
from turn.ledger import EffectNotApplied
from turn.manager import TurnManager
from turn.scope import NotStarted, TurnScope, mark
from turn.shield import finish_anyway
from turn.stopped import TurnStopped
from turn.store import UnknownIntent
from turn.usage import RequestMeter, UsageMeter, estimate_tokens
from voice.providers import LanguageModel, Message, ToolCall
from voice.tools import Tool, ToolArgumentsError, Toolbox

#: a model request takes at most this long unless the model says otherwise, s
MODEL_MAX_S = 120.0


class TokenSink(Protocol):
    """Receives streamed text; ``withheld`` when the turn is already
    stopped (log it as fenced, never deliver it)."""

    def __call__(self, token: str, *, withheld: bool = False) -> None: ...


#: the agent loop's events (:mod:`turn.event_catalogue`)
AgentLoopEvent = ToolStarted | ToolError | ToolNotStarted | ToolCancelled | Usage


class EventSink(Protocol):
    """Receives the turn's tool and usage events (``tool.started``,
    ``tool.error``, ``tool.not_started``, ``tool.cancelled``, ``usage``) as
    catalogue models, their ``turn_id`` and ``generation`` set."""

    def __call__(self, event: AgentLoopEvent) -> None: ...


@dataclass
class AgentResult:
    """What the agent loop produced.

    Attributes:
        text: the final answer (the text of the last model call).
        messages: the history it added: assistant tool calls and tool
            results, in order (the caller adds the final answer).
    """

    text: str
    messages: list[Message] = field(default_factory=list)


async def run_agent(
    *,
    scope: TurnScope,
    manager: TurnManager,
    turn_id: str,
    generation: int,
    llm: LanguageModel,
    messages: list[Message],
    toolbox: Toolbox | None,
    on_token: TokenSink,
    on_event: EventSink,
    model_max_s: float = MODEL_MAX_S,
    before_effect: Callable[[], Awaitable[object]] | None = None,
) -> AgentResult:
    """Run model and tool calls until the model answers.

    Args:
        scope: the turn's cancel scope (must be entered); model and tool
            calls run as its children.
        turn_id / generation: the turn's id and generation (its events carry both).
        messages: the conversation so far, ending with the user's request.
        toolbox: the tools the model may call (None: none).
        model_max_s: a model request's own time limit, s (the turn's
            remaining time may cut it shorter).
        before_effect: awaited before a tool with a side effect is written
            or called (a speculative voice turn's confirmed end of turn;
            None: nothing to wait for).

    Raises:
        turn.stopped.TurnStopped: the turn must not go on (see module doc).
        Exception: what a provider raised.
    """
    rt = manager.runtime(turn_id)
    meter = rt.meter if rt is not None else UsageMeter(llm.pricing)
    specs = toolbox.specs() if toolbox else None
    history = list(messages)
    added: list[Message] = []
    count = getattr(llm, "count_prompt_tokens", None)  # a model that knows its own prompt size exactly
    while True:
        prompt = count(history, specs) if count is not None else prompt_estimate(history, specs)
        await manager.checkpoint(turn_id, "before_model", expected_tokens=prompt)
        req = meter.start_request(prompt)
        told: list[bool] = []

        def tell_usage(req: RequestMeter = req, told: list[bool] = told) -> None:
            # once per request, as it ends: an aborted request too (it is billed)
            if not told:
                told.append(True)
                on_event(Usage(turn_id=turn_id, generation=generation, **req.record().model_dump()))

        try:
            child = scope.spawn(
                "model", _model_call(scope, manager, turn_id, llm, history, specs, req, on_token, tell_usage), max_s=model_max_s
            )
        except BaseException:
            tell_usage()
            raise
        # The model child tells its usage as it ends, after its provider has
        # recorded how it stopped and before it reports done, so a stopped
        # turn's usage comes before its terminal state, however late this
        # task unwinds; a child cancelled before it ever ran tells it here.
        assert child.task is not None
        child.task.add_done_callback(functools.partial(_tell_when_done, tell_usage))
        text, calls = await scope.wait(child)
        await manager.checkpoint(turn_id, "after_model")
        if not calls:
            return AgentResult(text, added)
        step = [Message(role="assistant", content=text, tool_calls=calls)]
        for call in calls:
            step.append(await _tool_call(scope, manager, turn_id, generation, toolbox, call, on_event, before_effect))
        history += step
        added += step


def _tell_when_done(tell: Callable[[], None], _task: asyncio.Task[Any]) -> None:
    tell()


async def _model_call(
    scope: TurnScope,
    manager: TurnManager,
    turn_id: str,
    llm: LanguageModel,
    messages: list[Message],
    specs: list[Any] | None,
    req: RequestMeter,
    on_token: TokenSink,
    tell_usage: Callable[[], None],
) -> tuple[str, list[ToolCall]]:
    """Stream one model request into ``on_token``; returns its text and
    tool calls. Its usage is told (``tell_usage``) as it ends, however it
    ends.

    Raises:
        turn.stopped.TurnStopped: the turn was stopped while it streamed.
        Exception: what the provider raised.
    """
    parts: list[str] = []
    calls: list[ToolCall] = []
    try:
        async with contextlib.aclosing(llm.stream(messages, tools=specs, meter=req)) as stream:  # type: ignore[type-var]
            async for item in stream:
                if isinstance(item, ToolCall):  # a provider may yield these only once its stream is over
                    calls.append(item)
                    continue
                mark("first_token")  # the model's time to first (text) token
                if scope.stopped.is_set() or manager.stopping_now(turn_id):
                    # the stop is recorded (its gate closed in that step), even
                    # if the worker has not woken yet; or a provider ignored
                    # its cancellation: evidence of waste, never delivered
                    on_token(item, withheld=True)
                    raise scope.limit or TurnStopped(turn_id, "model_stream")
                parts.append(item)
                on_token(item)
                await manager.checkpoint(turn_id, "model_stream")
    finally:
        req.finish(partial=True)  # no-op if the provider finished it whole
        tell_usage()
    return "".join(parts), calls


async def _tool_call(
    scope: TurnScope,
    manager: TurnManager,
    turn_id: str,
    generation: int,
    toolbox: Toolbox | None,
    call: ToolCall,
    on_event: EventSink,
    before_effect: Callable[[], Awaitable[object]] | None = None,
) -> Message:
    """One tool call, checkpointed and written to the ledger; returns the
    tool message for the model. An unknown tool or bad arguments are told to
    the model, not raised. A tool with a side effect first awaits
    ``before_effect`` (a speculative turn's confirmed end of turn): until
    then nothing of it is written or sent; a read runs at once."""
    tool = toolbox.get(call.name) if toolbox else None
    if tool is not None and tool.effect != "none" and before_effect is not None:
        await before_effect()
    await manager.checkpoint(turn_id, "before_tool", tool_call=(call.name, call.arguments))
    rt = manager.runtime(turn_id)
    step = rt.steps if rt is not None else 0
    if tool is None:
        on_event(ToolError(turn_id=turn_id, generation=generation, call_id=call.id, name=call.name, error="unknown tool"))
        return Message(role="tool", tool_call_id=call.id, status="error", content=f"error: there is no tool {call.name!r}")
    try:
        arguments = tool.validate(call.arguments)
    except ToolArgumentsError as exc:
        on_event(ToolError(turn_id=turn_id, generation=generation, call_id=call.id, name=call.name, error=str(exc)))
        return Message(role="tool", tool_call_id=call.id, status="error", content=f"error: {exc}")
    expected = tool.expected_duration_ms / 1000 if tool.expected_duration_ms is not None else None
    limit = tool.max_duration_ms / 1000 if tool.max_duration_ms is not None else None
    done: list[bool] = []
    try:
        output = await scope.run(
            f"tool:{tool.name}",
            _invoke(scope, manager, turn_id, generation, step, tool, arguments, call, on_event, done),
            max_s=limit,
            expected_s=expected,
        )
    except NotStarted as exc:
        on_event(ToolNotStarted(
            turn_id=turn_id, generation=generation, call_id=call.id, name=call.name, reason="no_budget", detail=exc.detail or ""
        ))
        raise
    except TurnStopped:  # a subclass of Exception: a stop, never the tool's error (the call told tool.cancelled)
        raise
    except Exception as exc:
        on_event(ToolError(turn_id=turn_id, generation=generation, call_id=call.id, name=call.name, error=f"{type(exc).__name__}: {exc}"))
        await manager.checkpoint(turn_id, "after_tool")
        return Message(role="tool", tool_call_id=call.id, status="error", content=f"error: {exc}")
    await manager.checkpoint(turn_id, "after_tool")
    return Message(role="tool", tool_call_id=call.id, status="done", content=_as_text(output))


async def _invoke(
    scope: TurnScope,
    manager: TurnManager,
    turn_id: str,
    generation: int,
    step: int,
    tool: Tool,
    arguments: dict[str, Any],
    call: ToolCall,
    on_event: EventSink,
    done: list[bool],
) -> Any:
    """Write the intent, call the tool with its idempotency key, write the
    outcome. A must-complete tool does the call and its completion write in
    one must-complete section, so a stop lands before it or after its
    completion write, never between. A call cut off by a stop is recorded:
    a read abandoned, a write effect_unknown (its compensation, or a lookup,
    settles it). A step already done is never run again."""
    ledger = manager.ledger
    on_event(ToolStarted(turn_id=turn_id, generation=generation, call_id=call.id, name=call.name, arguments=arguments, effect=tool.effect))
    key = effect_key(turn_id, step)
    pending = frozenset({IntentStatus.PENDING})
    unsure = IntentStatus.ABANDONED if tool.effect == "none" else IntentStatus.EFFECT_UNKNOWN
    sent = False

    async def call_and_record() -> Any:
        nonlocal sent
        sent = True
        try:
            output = await tool(idempotency_key=key, turn_id=turn_id, **arguments)
        except EffectNotApplied as exc:
            await ledger.move(key, IntentStatus.ABANDONED, expect=pending, detail=f"not applied: {exc}", error=str(exc))
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            await ledger.move(key, unsure, expect=pending, detail=f"the call failed: {error}", error=error)
            raise
        # The call answered: that moment is when it was done (a stop after it
        # finds a committed step, however long the write takes), and the
        # write is finished even if a stop cancels this task meanwhile.
        answered_at = manager.clock.now()
        await finish_anyway(ledger.settle_late(key, IntentStatus.DONE, result=_as_text(output), done_at=answered_at))
        done.append(True)
        return output

    try:
        intent = await ledger.intent(turn_id, step, tool.name, arguments, tool.effect)
        if intent.status is IntentStatus.DONE:
            done.append(True)
            return intent.result
        # the last look before anything is sent: a stop known here starts nothing
        await manager.checkpoint(turn_id, "tool_call")
        if scope.stopped.is_set():
            raise scope.limit or TurnStopped(turn_id, "tool_call")
        if tool.effect == "complete":
            return await scope.commit(call_and_record())
        return await call_and_record()
    except (asyncio.CancelledError, TurnStopped):
        if not done:
            # never sent: abandoned; cut off mid-call: a read abandoned, a write unknown
            status = unsure if sent else IntentStatus.ABANDONED
            detail = "cut off by the stop" if sent else "stopped before it was sent"
            try:
                with contextlib.suppress(TurnStopped, UnknownIntent):
                    await scope.commit(ledger.move(key, status, expect=pending, detail=detail), effect=False)
            finally:
                if tool.effect != "complete":  # a must-complete call goes on: the ledger tells its end
                    # told by the call itself before it reports done, so before the turn's terminal state
                    on_event(ToolCancelled(turn_id=turn_id, generation=generation, call_id=call.id, name=call.name))
        raise


def prompt_estimate(messages: list[Message], tools: list[Any] | None) -> int:
    """A request's prompt size before the provider reports it, tokens: each
    message's text plus about 4 tokens of framing (OpenAI's rule for chat
    messages), and the tool specs' JSON."""
    tokens = sum(estimate_tokens(m.content) + 4 for m in messages)
    for m in messages:
        for c in m.tool_calls or []:
            tokens += estimate_tokens(c.name + json.dumps(c.arguments))
    if tools:
        tokens += estimate_tokens(json.dumps([t.model_dump() for t in tools]))
    return tokens


def _as_text(output: Any) -> str:
    return output if isinstance(output, str) else json.dumps(output, default=str)


def sink_to(on_delivered: Callable[[str], None], on_withheld: Callable[[str], None]) -> TokenSink:
    """A :class:`TokenSink` from two callbacks."""

    def sink(token: str, *, withheld: bool = False) -> None:
        (on_withheld if withheld else on_delivered)(token)

    return sink
