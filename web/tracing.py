"""Traces (OpenTelemetry): one span per turn as this process ran it, with
what an operator asks of a stop, and a child span for each piece of its
work and for the stop's propagation.

Two feeds, neither of which makes a turn wait on telemetry: every event
this process logs (a tap on :class:`turn.events.EventLogs`, as
:mod:`web.metrics`) and every cancel scope's children
(:class:`turn.scope_observer.ScopeObserver`, ``manager.scope_observers``).

- span ``turn`` from the turn's first event here to its terminal one (or,
  in a drain, to its release: ``turnkeeper.turn.released`` true; the
  instance that resumes it opens its own span with the same
  ``turnkeeper.turn.id``). Attributes: ``turnkeeper.turn.id``,
  ``turnkeeper.session.id``, ``turnkeeper.turn.generation``,
  ``turnkeeper.turn.status``, ``turnkeeper.turn.deadline_ms`` (its time
  limit), ``turnkeeper.stop.reason``, ``turnkeeper.stop.initiator``,
  ``turnkeeper.stop.to_terminal_ms`` (stop request to the terminal write),
  ``turnkeeper.tokens_after_stop`` and ``turnkeeper.requests_after_stop``
  (a model's spend after the stop: the target for the second is 0),
  ``gen_ai.usage.input_tokens`` / ``output_tokens`` (the turn's sums).
  Span events: ``stop requested``, ``barge-in``, ``end of speech``,
  ``model request``. A FAILED turn's span has status ERROR.
- children: ``stt`` (the endpoint firing to the final transcript), ``chat
  <model>`` per model request (OpenTelemetry GenAI conventions:
  ``gen_ai.operation.name``, ``gen_ai.provider.name``,
  ``gen_ai.request.model``, ``gen_ai.request.max_tokens``,
  ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``; and
  ``turnkeeper.model.time_to_first_token_ms``, ``partial``, tokens after
  the stop), ``tool <name>`` (``tool.started`` to its outcome, with
  ``turnkeeper.tool.idempotency_key``), ``tts`` (with
  ``turnkeeper.tts.time_to_first_audio_ms``), ``playout``; each with
  ``turnkeeper.child.outcome`` (completed, stopped, committing, failed)
  and ``turnkeeper.child.after_stop``.
- ``cancel``: the stop's propagation, from the scope being stopped to its
  children's reports (``turnkeeper.stop.settled_ms``; an event per child
  with its outcome and ms after the stop).
- ``replay``: a resumed turn (``agent.restart``) from its restart to its
  first model request: its ledger's open steps settled, its done steps
  given back to the model (``turnkeeper.resume.reason``).

No transcript, reply, prompt or tool arguments are put in spans unless
``traces.include_content`` is set. Export: OTLP over HTTP to
``traces.otlp_endpoint`` when set, else as the standard ``OTEL_*``
environment variables say (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``, with ``OTEL_EXPORTER_OTLP_HEADERS`` and the
rest; ``OTEL_TRACES_EXPORTER=none`` turns it off; ``OTEL_SERVICE_NAME``
names the service), batched; neither: spans are made and dropped (tests
add their own processor). Cleanup ends the spans still open
(``turnkeeper.turn.unfinished``) and flushes the exporter.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from datetime import datetime
from typing import Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Status, StatusCode

from clock import Clock
from turn.manager import TurnManager
from turn.models import ChildOutcome, EventRecord, StopReason, StopReport, TurnStatus
from turn.scope_observer import ChildRun
from web.settings import Settings
from web.state import MANAGER

log = logging.getLogger(__name__)

#: one export to the collector at most, s (the last flush runs at cleanup, inside shutdown.grace_s)
EXPORT_TIMEOUT_S = 5
TERMINAL = frozenset(s.value for s in TurnStatus if s.is_terminal)
#: turn spans kept open at most (a turn that ends on another worker never
#: sends its terminal event here): the oldest is ended, marked unfinished
MAX_OPEN = 10_000
#: outcomes of a tool call (the ledger's events and the call's own)
TOOL_ENDS = frozenset({
    "tool.done", "tool.error", "tool.cancelled", "tool.not_started", "tool.compensated", "tool.abandoned",
    "tool.effect_unknown", "tool.human_required",
})
#: scope children with a span of their own from the scope observer (tools
#: have theirs from the ledger's events; a text turn's ``agent`` child only
#: wraps the model and tool children, which are its siblings in the scope)
SCOPE_SPANS = frozenset({"stt", "model", "tts", "playout"})


def _ns(at: datetime) -> int:
    return int(at.timestamp() * 1e9)


def _env_list(name: str, default: str) -> list[str]:
    """A comma-separated OTEL_* variable's items (empty or unset: ``default``)."""
    value = os.environ.get(name, "").strip() or default
    return [item.strip().lower() for item in value.split(",") if item.strip()]


def _exporter(settings: Settings) -> Any:
    """The span exporter the settings or the standard ``OTEL_*`` variables
    ask for (None: no export). Per the OpenTelemetry SDK configuration
    spec: ``OTEL_SDK_DISABLED=true`` and ``OTEL_TRACES_EXPORTER=none`` turn
    it off, an empty variable counts as unset; only the ``http/protobuf``
    protocol is spoken (another is refused with a warning)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint = settings.traces.otlp_endpoint
    from_env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint and (not from_env or "otlp" not in _env_list("OTEL_TRACES_EXPORTER", "otlp")):
        return None
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if not endpoint and protocol != "http/protobuf":
        log.warning("traces: OTEL_EXPORTER_OTLP_PROTOCOL=%s is not spoken here (http/protobuf only): no export", protocol)
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if endpoint:
        return OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
    # the exporter reads OTEL_EXPORTER_OTLP_* itself (endpoint, headers, compression, timeout)
    has_timeout = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT" in os.environ or "OTEL_EXPORTER_OTLP_TIMEOUT" in os.environ
    return OTLPSpanExporter() if has_timeout else OTLPSpanExporter(timeout=EXPORT_TIMEOUT_S)


def _service_named_by_env() -> bool:
    if os.environ.get("OTEL_SERVICE_NAME", "").strip():
        return True
    attrs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return any(pair.split("=", 1)[0].strip() == "service.name" for pair in attrs.split(",") if "=" in pair)


class Tracing:
    """This process's tracer and the spans open now; an event tap and a
    scope observer (see the module doc).

    Args:
        settings: ``traces.*`` (export, content) and ``llm`` (the model
            spans' provider and model names).
        clock: the time a span still open at shutdown ends at.
        manager: read for a turn's deadline when it starts running here
            (None: no deadline attribute).
    """

    def __init__(self, settings: Settings, clock: Clock, manager: TurnManager | None = None) -> None:
        self.clock = clock
        self.manager = manager
        t = settings.traces
        self.content = t.include_content
        self.provider_name = "openai" if settings.llm.provider == "openai" else "turnkeeper.local"
        self.model = settings.llm.model if settings.llm.provider == "openai" else "local-agent"
        self.max_tokens = settings.llm.max_tokens
        named = {} if _service_named_by_env() else {"service.name": t.service_name}
        self.provider = TracerProvider(resource=Resource.create(named))
        exporter = _exporter(settings)
        if exporter is not None:
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("turnkeeper")
        self._turns: OrderedDict[str, Span] = OrderedDict()
        self._tools: dict[str, list[tuple[str, Span]]] = {}
        self._ran: set[str] = set()  # turns seen RUNNING in their open span
        self._spend: dict[str, list[int]] = {}  # [tokens, requests] after the stop, [input, output], per open span
        self._children: dict[tuple[str, str], Span] = {}  # (turn, child name) -> open span
        self._model_ended: dict[str, tuple[Span, int]] = {}  # a model span waiting for its usage event
        self._model_told: set[str] = set()  # turns whose open model span has its usage already
        self._cancel: dict[str, Span] = {}
        self._replay: dict[str, Span] = {}
        self._stt_start: dict[str, datetime] = {}
        self._cancel_unnamed: set[str] = set()
        self._stop_asked: dict[str, tuple[str, str]] = {}  # (kind, initiator) of a stop recorded in the store

    # -- the event tap ---------------------------------------------------------

    def observe(self, ev: EventRecord) -> None:
        """Turn one logged event into span changes (never raises: telemetry
        must not break a turn)."""
        try:
            self._observe(ev)
        except Exception:
            log.exception("tracing: event %s not recorded", ev.type)

    def _observe(self, ev: EventRecord) -> None:
        p, turn_id = ev.payload, ev.turn_id
        if ev.type == "barge_in":  # a session's event: it stopped the turn it names
            turn_id = str(p.get("old_turn_id") or "")
        if not turn_id:
            return
        if ev.type == "turn":
            self._turn_event(ev, turn_id, p)
            return
        span = self._turns.get(turn_id)
        if span is None:
            return
        if ev.type == "tool.started":
            child = self._child_span(span, f"tool {p.get('name', '?')}", ev.at)
            child.set_attribute("turnkeeper.tool.effect", str(p.get("effect", "")))
            if self.content:
                child.set_attribute("turnkeeper.tool.arguments", str(p.get("arguments", "")))
            self._tools.setdefault(turn_id, []).append((str(p.get("name", "")), child))
        elif ev.type == "tool.intent":
            for name, child in self._tools.get(turn_id, []):
                if name == p.get("name"):
                    child.set_attribute("turnkeeper.tool.idempotency_key", str(p.get("key", "")))
        elif ev.type in TOOL_ENDS:
            self._tool_end(ev, turn_id, p)
        elif ev.type == "usage":
            self._usage(ev, turn_id, span, p)
        elif ev.type == "barge_in":
            span.add_event("barge-in", {"initiator": str(p.get("initiator", ""))}, timestamp=_ns(ev.at))
        elif ev.type == "agent.restart":
            replay = self._child_span(span, "replay", ev.at)
            replay.set_attribute("turnkeeper.resume.reason", str(p.get("reason", "")))
            self._replay[turn_id] = replay

    def _usage(self, ev: EventRecord, turn_id: str, span: Span, p: dict[str, Any]) -> None:
        spend = self._spend.setdefault(turn_id, [0, 0, 0, 0])
        prompt, completion = int(p.get("prompt_tokens") or 0), int(p.get("completion_tokens") or 0)
        spend[0] += int(p.get("completion_tokens_after_stop") or 0)
        spend[1] += bool(p.get("started_after_stop"))
        spend[2] += prompt
        spend[3] += completion
        span.set_attributes({
            "turnkeeper.tokens_after_stop": spend[0], "turnkeeper.requests_after_stop": spend[1],
            "gen_ai.usage.input_tokens": spend[2], "gen_ai.usage.output_tokens": spend[3],
        })
        span.add_event("model request", {
            "prompt_tokens": prompt, "completion_tokens": completion,
            "completion_tokens_after_stop": int(p.get("completion_tokens_after_stop") or 0),
            "started_after_stop": bool(p.get("started_after_stop")),
        }, timestamp=_ns(ev.at))
        # a request tells its usage as it ends, before its child reports done
        # (its span still open); one cancelled before it ran, just after
        ended = None
        model = self._children.get((turn_id, "model"))
        if model is not None:
            self._model_told.add(turn_id)
        else:
            ended = self._model_ended.pop(turn_id, None)
            if ended is None:
                return
            model = ended[0]
        model.set_attributes({
            "gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": completion,
            "turnkeeper.model.request": int(p.get("request") or 0), "turnkeeper.model.partial": bool(p.get("partial")),
            "turnkeeper.model.usage_source": str(p.get("source", "")),
            "turnkeeper.model.tokens_after_stop": int(p.get("completion_tokens_after_stop") or 0),
            "turnkeeper.model.started_after_stop": bool(p.get("started_after_stop")),
        })
        if p.get("max_tokens") is not None:
            model.set_attribute("gen_ai.request.max_tokens", int(p["max_tokens"]))
        if p.get("after_stop"):
            model.set_attribute("turnkeeper.model.after_stop", str(p["after_stop"]))
        if ended is not None:
            model.end(end_time=ended[1])

    def _turn_event(self, ev: EventRecord, turn_id: str, p: dict[str, Any]) -> None:
        status = str(p.get("status", ""))
        span = self._turns.get(turn_id)
        if span is None:
            if status in TERMINAL:
                return  # ended before this process saw it run
            span = self.tracer.start_span("turn", start_time=_ns(ev.at), attributes={
                "turnkeeper.turn.id": turn_id, "turnkeeper.session.id": ev.session_id,
                "turnkeeper.turn.generation": int(ev.generation or 0),
                "turnkeeper.tokens_after_stop": 0, "turnkeeper.requests_after_stop": 0,
            })
            self._spend[turn_id] = [0, 0, 0, 0]
            self._turns[turn_id] = span
            while len(self._turns) > MAX_OPEN:
                oldest = next(iter(self._turns))
                self._turns[oldest].set_attribute("turnkeeper.turn.unfinished", True)
                self._end(oldest, ev.at)
        span.set_attribute("turnkeeper.turn.status", status)
        if self.content:  # the turn as recorded: the user's words, the reply as heard
            for field in ("transcript", "reply"):
                if p.get(field):
                    span.set_attribute(f"turnkeeper.{field}", str(p[field]))
        reason = p.get("stop_reason") or {}
        if status == TurnStatus.CANCEL_REQUESTED.value:
            self._stop_asked[turn_id] = (str(reason.get("kind", "")), str(reason.get("initiator", "")))
            cancel = self._cancel.get(turn_id)
            if cancel is not None and turn_id in self._cancel_unnamed:  # the scope stopped before this event came
                self._cancel_unnamed.discard(turn_id)
                cancel.set_attributes({"turnkeeper.stop.reason": self._stop_asked[turn_id][0],
                                       "turnkeeper.stop.initiator": self._stop_asked[turn_id][1]})
            span.add_event("stop requested", {"reason": str(reason.get("kind", "")),
                                              "initiator": str(reason.get("initiator", ""))}, timestamp=_ns(ev.at))
        elif status == TurnStatus.QUEUED.value and turn_id in self._ran:
            span.set_attribute("turnkeeper.turn.released", True)  # QUEUED after RUNNING: a drain handed it on
            self._end(turn_id, ev.at)
        elif status == TurnStatus.RUNNING.value:
            self._ran.add(turn_id)
            rt = self.manager.runtime(turn_id) if self.manager is not None else None
            if rt is not None and rt.deadline is not None:
                span.set_attribute("turnkeeper.turn.deadline_ms", round((rt.deadline - self.clock.monotonic()) * 1000))
        elif status in TERMINAL:
            if reason:
                span.set_attribute("turnkeeper.stop.reason", str(reason.get("kind", "")))
                span.set_attribute("turnkeeper.stop.initiator", str(reason.get("initiator", "")))
                stopped_at = reason.get("at")
                if isinstance(stopped_at, str):
                    ms = (ev.at - datetime.fromisoformat(stopped_at)).total_seconds() * 1000
                    span.set_attribute("turnkeeper.stop.to_terminal_ms", round(max(0.0, ms), 3))
            if status == TurnStatus.FAILED.value:
                span.set_status(Status(StatusCode.ERROR, str(p.get("error") or "failed")))
            self._end(turn_id, ev.at)

    def _tool_end(self, ev: EventRecord, turn_id: str, p: dict[str, Any]) -> None:
        open_tools = self._tools.get(turn_id, [])
        name = str(p.get("name", ""))
        for i, (tool, child) in enumerate(open_tools):
            if tool == name:
                child.set_attribute("turnkeeper.tool.outcome", ev.type.removeprefix("tool."))
                if p.get("key"):
                    child.set_attribute("turnkeeper.tool.idempotency_key", str(p["key"]))
                if ev.type == "tool.error":
                    child.set_status(Status(StatusCode.ERROR, self._error_text(str(p.get("error", "")), "tool error")))
                child.end(end_time=_ns(ev.at))
                del open_tools[i]
                return

    def _error_text(self, text: str, bare: str | None = None) -> str:
        """An error for a span's status: whole with content on, else only
        its type (``"Type: message"``) or ``bare`` (a message may quote
        what the user said)."""
        if self.content:
            return text
        return bare if bare is not None else text.split(":", 1)[0]

    # -- the scope observer ----------------------------------------------------

    def _child_span(self, turn: Span, name: str, at: datetime) -> Span:
        return self.tracer.start_span(name, context=trace.set_span_in_context(turn), start_time=_ns(at))

    def child_started(self, child: ChildRun) -> None:
        """A scope child started: its span opens (``stt``, ``model``, ``tts``,
        ``playout``); a resumed turn's ``replay`` ends at its first model request."""
        if child.name not in SCOPE_SPANS or child.turn_id not in self._turns:
            return
        turn = self._turns[child.turn_id]
        if child.name == "model":
            replay = self._replay.pop(child.turn_id, None)
            if replay is not None:
                replay.end(end_time=_ns(child.started_at))
            span = self._child_span(turn, f"chat {self.model}", child.started_at)
            span.set_attributes({"gen_ai.operation.name": "chat", "gen_ai.provider.name": self.provider_name,
                                 "gen_ai.request.model": self.model})
        else:
            began = self._stt_start.pop(child.turn_id, child.started_at) if child.name == "stt" else child.started_at
            span = self._child_span(turn, child.name, began)  # STT's final may begin before the turn's scope
        self._children[(child.turn_id, child.name)] = span

    def child_ended(self, child: ChildRun) -> None:
        """A scope child ended: its outcome and marks go on its span, which
        ends (a model's once its usage event came)."""
        span = self._children.pop((child.turn_id, child.name), None)
        if span is None or child.ended_at is None:
            return
        outcome = child.outcome.value if child.outcome is not None else "unknown"
        span.set_attributes({"turnkeeper.child.outcome": outcome, "turnkeeper.child.after_stop": child.after_stop})
        for name, at in child.marks:
            span.add_event(name.replace("_", " "), timestamp=_ns(at))
        first_token = child.mark_at("first_token")
        if first_token is not None:
            span.set_attribute("turnkeeper.model.time_to_first_token_ms", _ms(child.started_at, first_token))
        first_sentence, first_audio = child.mark_at("first_sentence"), child.mark_at("first_audio")
        if first_sentence is not None and first_audio is not None:
            span.set_attribute("turnkeeper.tts.time_to_first_audio_ms", _ms(first_sentence, first_audio))
        if child.outcome is ChildOutcome.FAILED:
            span.set_status(Status(StatusCode.ERROR, self._error_text(child.error or "failed")))
        if child.name == "model" and child.turn_id not in self._model_told:
            self._model_ended[child.turn_id] = (span, _ns(child.ended_at))  # its usage event follows at once
        else:
            self._model_told.discard(child.turn_id)
            span.end(end_time=_ns(child.ended_at))

    def scope_stopped(self, turn_id: str, reason: StopReason | None, at: datetime) -> None:
        """The scope was stopped: the ``cancel`` span opens."""
        turn = self._turns.get(turn_id)
        if turn is None or turn_id in self._cancel:
            return
        span = self._child_span(turn, "cancel", at)
        # None: asked from outside and recorded in the store (its CANCEL_REQUESTED event says why)
        kind, initiator = (reason.kind.value, reason.initiator) if reason is not None else self._stop_asked.get(turn_id, ("", ""))
        if kind:
            span.set_attributes({"turnkeeper.stop.reason": kind, "turnkeeper.stop.initiator": initiator})
        else:
            self._cancel_unnamed.add(turn_id)
        self._cancel[turn_id] = span

    def scope_settled(self, turn_id: str, report: StopReport, at: datetime) -> None:
        """The stop's children reported: each as an event on ``cancel``, which ends."""
        span = self._cancel.pop(turn_id, None)
        if span is None:
            return
        span.set_attributes({"turnkeeper.stop.settled_ms": report.settled_ms, "turnkeeper.stop.grace_ms": report.grace_ms})
        for c in report.children:
            attrs: dict[str, Any] = {"child": c.name, "outcome": c.outcome.value}
            if c.ms is not None:
                attrs["ms_after_stop"] = c.ms
            span.add_event(f"child {c.outcome.value}", attrs, timestamp=_ns(at))
        if any(c.outcome is ChildOutcome.IGNORED_CANCEL for c in report.children):
            span.set_attribute("turnkeeper.stop.forced", True)
        span.end(end_time=_ns(at))

    def turn_noted(self, turn_id: str, name: str, at: datetime) -> None:
        """A moment of the turn itself: ``speech_end`` an event on its span,
        ``stt_start`` the start of its ``stt`` span."""
        turn = self._turns.get(turn_id)
        if turn is not None and name == "stt_start":
            self._stt_start[turn_id] = at
        elif turn is not None:
            turn.add_event(name.replace("_", " ").replace("speech end", "end of speech"), timestamp=_ns(at))

    # -- ending ----------------------------------------------------------------

    def _end(self, turn_id: str, at: datetime) -> None:
        for _, child in self._tools.pop(turn_id, []):
            child.set_attribute("turnkeeper.tool.outcome", "unknown")
            child.end(end_time=_ns(at))
        for key in [k for k in self._children if k[0] == turn_id]:
            self._children.pop(key).end(end_time=_ns(at))
        self._stt_start.pop(turn_id, None)
        self._stop_asked.pop(turn_id, None)
        self._cancel_unnamed.discard(turn_id)
        for pending in (self._cancel, self._replay):
            span = pending.pop(turn_id, None)
            if span is not None:
                span.end(end_time=_ns(at))
        model = self._model_ended.pop(turn_id, None)
        if model is not None:
            model[0].end(end_time=model[1])
        self._model_told.discard(turn_id)
        self._ran.discard(turn_id)
        self._spend.pop(turn_id, None)
        span = self._turns.pop(turn_id, None)
        if span is not None:
            span.end(end_time=_ns(at))

    def shutdown(self) -> None:
        """End the spans still open (unfinished here) and flush the exporter."""
        for turn_id in list(self._turns):
            self._turns[turn_id].set_attribute("turnkeeper.turn.unfinished", True)
            self._end(turn_id, self.clock.now())
        self.provider.shutdown()


def _ms(start: datetime, end: datetime) -> float:
    return round((end - start).total_seconds() * 1000, 3)


#: this app's tracing
TRACING: web.AppKey[Tracing] = web.AppKey("tracing")


def add_tracing(app: web.Application, tracing: Tracing) -> None:
    """The tap and the scope observer that feed ``tracing`` from ``app``'s
    Turn Manager; cleanup flushes it."""
    app[TRACING] = tracing
    app[MANAGER].events.taps.append(tracing.observe)
    app[MANAGER].scope_observers.append(tracing)

    async def flushed(app: web.Application) -> None:
        await asyncio.to_thread(tracing.shutdown)  # the exporter's last flush is blocking HTTP

    app.on_cleanup.append(flushed)
