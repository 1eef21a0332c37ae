"""Metrics: ``GET /metrics`` in the Prometheus text format
(prometheus-client), for what an operator must see of stops and spend.

From every event this process logs (a tap on :class:`turn.events.EventLogs`):

- ``turnkeeper_stop_to_terminal_seconds{reason,status}``: a stopped turn's
  stop request (its ``stop_reason.at``) to its terminal write, s (the
  "Stop request to CANCELLED written" target: p95 <= 20 ms in one process);
- ``turnkeeper_turns_ended_total{status,reason}``: turns that reached a
  terminal state here (``reason`` empty when none was stopped);
- ``turnkeeper_completion_tokens_after_stop_total``: completion tokens a
  model streamed after its turn's stop request (billed, wasted);
- ``turnkeeper_model_requests_after_stop_total``: model requests *started*
  after a stop (the target is 0);
- ``turnkeeper_barge_ins_total{initiator}``;
- ``turnkeeper_barge_in_onset_to_fence_seconds{transport}``: a committed
  barge-in's speech onset to the fence moving, s (the server's side of the
  audible stop; what the ear hears is measured by ``bench/bargein.py``);
- ``turnkeeper_false_interruptions_total{transport}`` and
  ``turnkeeper_backchannels_total{transport}``, and the time they held
  playout, ``turnkeeper_noise_pause_seconds{kind,transport}`` (0 when the
  agent did not pause: the target);
- ``turnkeeper_tokens_streamed_total{kind}``: prompt and completion tokens
  of every model request (billed);
- ``turnkeeper_effects_total{outcome}``: ledger outcomes (done,
  compensated, abandoned, effect_unknown, human_required);
- ``turnkeeper_turns_resumed_total{how}``: turns run on here after their
  first worker drained (adopted) or died (taken_over).

Read at each scrape: ``turnkeeper_voice_sessions{transport}``,
``turnkeeper_text_turns_running``, ``turnkeeper_draining`` (0/1) and
``turnkeeper_draining_seconds``. No label carries a tenant, session or turn
id (bounded cardinality, and nothing about who talks), so the endpoint needs
no credentials, like ``/healthz``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from turn.models import EventRecord, TurnStatus
from web.drain import DRAIN
from web.state import MANAGER, PEERS, TEXT_TURNS

#: the histogram's buckets, s: the stop targets (20 ms, 50 ms) fall on edges
STOP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
TERMINAL = frozenset(s.value for s in TurnStatus if s.is_terminal)
#: transport names of the voice session classes
TRANSPORTS = {"PeerSession": "webrtc", "PhoneCall": "phone", "DeviceCall": "device"}
#: the ledger's events of an effect's outcome, and the outcome they count
EFFECT_OUTCOMES = {"tool.done": "done", "tool.compensated": "compensated", "tool.abandoned": "abandoned",
                   "tool.effect_unknown": "effect_unknown", "tool.human_required": "human_required"}


class Metrics:
    """This process's metrics (a registry of its own: several apps in one
    process, as in tests, never share counters)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.stop_seconds = Histogram(
            "turnkeeper_stop_to_terminal_seconds", "A stopped turn's stop request to its terminal write, s",
            ["reason", "status"], buckets=STOP_BUCKETS, registry=r,
        )
        self.turns_ended = Counter("turnkeeper_turns_ended", "Turns that reached a terminal state here",
                                   ["status", "reason"], registry=r)
        self.tokens_after_stop = Counter(
            "turnkeeper_completion_tokens_after_stop", "Completion tokens streamed after the turn's stop request", registry=r,
        )
        self.requests_after_stop = Counter(
            "turnkeeper_model_requests_after_stop", "Model requests started after the turn's stop request", registry=r,
        )
        self.barge_ins = Counter("turnkeeper_barge_ins", "Committed barge-ins", ["initiator"], registry=r)
        self.onset_to_fence = Histogram(
            "turnkeeper_barge_in_onset_to_fence_seconds", "A barge-in's speech onset to the fence moving, s",
            ["transport"], buckets=STOP_BUCKETS, registry=r,
        )
        self.false_interruptions = Counter("turnkeeper_false_interruptions", "Sounds that paused the agent and were no speech",
                                           ["transport"], registry=r)
        self.backchannels = Counter("turnkeeper_backchannels", "Short replies the agent talked on through",
                                    ["transport"], registry=r)
        self.noise_pause = Histogram(
            "turnkeeper_noise_pause_seconds", "Playout held for a false interruption or a backchannel, s",
            ["kind", "transport"], buckets=(0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0), registry=r,
        )
        self.tokens = Counter("turnkeeper_tokens_streamed", "Tokens of every model request (billed)", ["kind"], registry=r)
        self.effects = Counter("turnkeeper_effects", "Side-effect outcomes in the ledger", ["outcome"], registry=r)
        self.resumed = Counter("turnkeeper_turns_resumed", "Turns run on here after their first worker drained or died",
                               ["how"], registry=r)
        #: the transport of a session open here ("" if none): set by add_routes
        self.transport_of: Callable[[str], str] = lambda _session_id: ""

    def observe(self, ev: EventRecord) -> None:
        """Count one logged event (the tap on the event logs)."""
        p = ev.payload
        if ev.type == "turn" and p.get("status") in TERMINAL:
            reason = p.get("stop_reason") or {}
            kind = str(reason.get("kind", ""))
            self.turns_ended.labels(status=p["status"], reason=kind).inc()
            stopped_at = _when(reason.get("at"))
            if stopped_at is not None:
                self.stop_seconds.labels(reason=kind, status=p["status"]).observe(
                    max(0.0, (ev.at - stopped_at).total_seconds())
                )
        elif ev.type == "usage":
            self.tokens_after_stop.inc(max(0, int(p.get("completion_tokens_after_stop") or 0)))
            self.tokens.labels(kind="prompt").inc(max(0, int(p.get("prompt_tokens") or 0)))
            self.tokens.labels(kind="completion").inc(max(0, int(p.get("completion_tokens") or 0)))
            if p.get("started_after_stop"):
                self.requests_after_stop.inc()
        elif ev.type == "barge_in":
            self.barge_ins.labels(initiator=str(p.get("initiator", ""))).inc()
            self.onset_to_fence.labels(transport=self.transport_of(ev.session_id)).observe(
                max(0.0, float(p.get("onset_to_fence_ms") or 0) / 1000))
        elif ev.type in ("false_interruption", "backchannel"):
            transport = self.transport_of(ev.session_id)
            (self.false_interruptions if ev.type == "false_interruption" else self.backchannels).labels(transport=transport).inc()
            self.noise_pause.labels(kind=ev.type, transport=transport).observe(max(0.0, float(p.get("paused_ms") or 0) / 1000))
        elif ev.type in EFFECT_OUTCOMES:
            self.effects.labels(outcome=EFFECT_OUTCOMES[ev.type]).inc()
        elif ev.type == "agent.restart":
            self.resumed.labels(how=str(p.get("reason", ""))).inc()


def _when(value: object) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            return None
    return None


class _AppState(Collector):
    """What is read at each scrape: sessions, running text turns, the drain."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sessions = GaugeMetricFamily("turnkeeper_voice_sessions", "Voice sessions open here", labels=["transport"])
        counts = dict.fromkeys(TRANSPORTS.values(), 0)
        for peer in self.app[PEERS].values():
            name = TRANSPORTS.get(type(peer).__name__, "other")
            counts[name] = counts.get(name, 0) + 1
        for name, n in counts.items():
            sessions.add_metric([name], n)
        yield sessions
        yield GaugeMetricFamily("turnkeeper_text_turns_running", "Text turns running here",
                                value=self.app[TEXT_TURNS].running_count())
        drain = self.app[DRAIN]
        yield GaugeMetricFamily("turnkeeper_draining", "1 while this instance drains", value=int(drain.draining))
        yield GaugeMetricFamily("turnkeeper_draining_seconds", "How long it has drained, s", value=drain.elapsed_s())


#: this app's metrics
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")


def add_routes(app: web.Application, metrics: Metrics) -> None:
    """``GET /metrics``, and the tap that feeds it from ``app``'s event logs."""
    app[METRICS] = metrics
    peers = app[PEERS]

    def transport_of(session_id: str) -> str:
        peer = peers.get(session_id)
        return "" if peer is None else TRANSPORTS.get(type(peer).__name__, "other")

    metrics.transport_of = transport_of
    metrics.registry.register(_AppState(app))
    app[MANAGER].events.taps.append(metrics.observe)
    app.router.add_get("/metrics", _metrics)


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
