"""Traces (OpenTelemetry): one span per turn as this process ran it, with
what an operator asks of a stop, and a child span per tool call.

Built from every event this process logs (a tap on
:class:`turn.events.EventLogs`, as :mod:`web.metrics`), so no part of the
turn's work waits on telemetry:

- span ``turn`` from the turn's first event here to its terminal one (or,
  in a drain, to its release: ``turnkeeper.turn.released`` true; the
  instance that resumes it opens its own span with the same
  ``turnkeeper.turn.id``). Attributes: ``turnkeeper.turn.id``,
  ``turnkeeper.session.id``, ``turnkeeper.turn.generation``, ``turnkeeper.turn.status``,
  ``turnkeeper.stop.reason``, ``turnkeeper.stop.initiator``,
  ``turnkeeper.stop.to_terminal_ms`` (stop request to the terminal write),
  ``turnkeeper.tokens_after_stop`` and ``turnkeeper.requests_after_stop``
  (a model's spend after the stop: the target for the second is 0). Span
  events: ``stop requested``, ``barge-in``, ``model request`` (each
  request's tokens). A FAILED turn's span has status ERROR.
- span ``tool <name>`` (child of its turn) from ``tool.started`` to its
  outcome (done, error, cancelled, compensated, abandoned ...).

Export: OTLP over HTTP to ``traces.otlp_endpoint`` (e.g.
``http://collector:4318/v1/traces``), batched; empty: spans are made and
dropped (tests add their own processor). Cleanup ends the spans still
open (``turnkeeper.turn.unfinished``) and flushes the exporter.
"""

from __future__ import annotations

import asyncio
import logging
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
from turn.models import EventRecord, TurnStatus
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


def _ns(at: datetime) -> int:
    return int(at.timestamp() * 1e9)


class Tracing:
    """This process's tracer and the spans open now.

    Args:
        settings: ``traces.otlp_endpoint`` and ``traces.service_name``.
        clock: the time a span still open at shutdown ends at.
    """

    def __init__(self, settings: Settings, clock: Clock) -> None:
        self.clock = clock
        t = settings.traces
        self.provider = TracerProvider(resource=Resource.create({"service.name": t.service_name}))
        if t.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=t.otlp_endpoint, timeout=EXPORT_TIMEOUT_S)
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("turnkeeper")
        self._turns: OrderedDict[str, Span] = OrderedDict()
        self._tools: dict[str, list[tuple[str, Span]]] = {}
        self._ran: set[str] = set()  # turns seen RUNNING in their open span
        self._spend: dict[str, list[int]] = {}  # [tokens, requests] after the stop, per open span

    def observe(self, ev: EventRecord) -> None:
        """Turn one logged event into span changes (never raises: telemetry
        must not break a turn)."""
        try:
            self._observe(ev)
        except Exception:
            log.exception("tracing: event %s not recorded", ev.type)

    def _observe(self, ev: EventRecord) -> None:
        p, turn_id = ev.payload, ev.turn_id
        if not turn_id:
            return
        if ev.type == "turn":
            self._turn_event(ev, turn_id, p)
            return
        span = self._turns.get(turn_id)
        if span is None:
            return
        if ev.type == "tool.started":
            child = self.tracer.start_span(f"tool {p.get('name', '?')}", context=trace.set_span_in_context(span),
                                           start_time=_ns(ev.at))
            child.set_attribute("turnkeeper.tool.effect", str(p.get("effect", "")))
            self._tools.setdefault(turn_id, []).append((str(p.get("name", "")), child))
        elif ev.type in TOOL_ENDS:
            self._tool_end(ev, turn_id, p)
        elif ev.type == "usage":
            spend = self._spend.setdefault(turn_id, [0, 0])
            spend[0] += int(p.get("completion_tokens_after_stop") or 0)
            spend[1] += bool(p.get("started_after_stop"))
            span.set_attribute("turnkeeper.tokens_after_stop", spend[0])
            span.set_attribute("turnkeeper.requests_after_stop", spend[1])
            span.add_event("model request", {
                "prompt_tokens": int(p.get("prompt_tokens") or 0), "completion_tokens": int(p.get("completion_tokens") or 0),
                "completion_tokens_after_stop": int(p.get("completion_tokens_after_stop") or 0),
                "started_after_stop": bool(p.get("started_after_stop")),
            }, timestamp=_ns(ev.at))
        elif ev.type == "barge_in":
            span.add_event("barge-in", {"initiator": str(p.get("initiator", ""))}, timestamp=_ns(ev.at))

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
            self._spend[turn_id] = [0, 0]
            self._turns[turn_id] = span
            while len(self._turns) > MAX_OPEN:
                oldest = next(iter(self._turns))
                self._turns[oldest].set_attribute("turnkeeper.turn.unfinished", True)
                self._end(oldest, ev.at)
        span.set_attribute("turnkeeper.turn.status", status)
        reason = p.get("stop_reason") or {}
        if status == TurnStatus.CANCEL_REQUESTED.value:
            span.add_event("stop requested", {"reason": str(reason.get("kind", "")),
                                              "initiator": str(reason.get("initiator", ""))}, timestamp=_ns(ev.at))
        elif status == TurnStatus.QUEUED.value and turn_id in self._ran:
            span.set_attribute("turnkeeper.turn.released", True)  # QUEUED after RUNNING: a drain handed it on
            self._end(turn_id, ev.at)
        elif status == TurnStatus.RUNNING.value:
            self._ran.add(turn_id)
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
                if ev.type == "tool.error":
                    child.set_status(Status(StatusCode.ERROR, str(p.get("error", ""))))
                child.end(end_time=_ns(ev.at))
                del open_tools[i]
                return

    def _end(self, turn_id: str, at: datetime) -> None:
        for _, child in self._tools.pop(turn_id, []):
            child.set_attribute("turnkeeper.tool.outcome", "unknown")
            child.end(end_time=_ns(at))
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


#: this app's tracing
TRACING: web.AppKey[Tracing] = web.AppKey("tracing")


def add_tracing(app: web.Application, tracing: Tracing) -> None:
    """The tap that feeds ``tracing`` from ``app``'s event logs; cleanup
    flushes it."""
    app[TRACING] = tracing
    app[MANAGER].events.taps.append(tracing.observe)

    async def flushed(app: web.Application) -> None:
        await asyncio.to_thread(tracing.shutdown)  # the exporter's last flush is blocking HTTP

    app.on_cleanup.append(flushed)
