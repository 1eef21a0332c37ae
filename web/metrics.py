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
- ``turnkeeper_end_of_turn_total{by}`` (what decided the end of the user's
  turn: ``model``, ``silence``, ``incomplete_bound``, ``user_went_on``) and
  ``turnkeeper_speculative_turns_total{outcome}`` (replies started at a
  tentative end: ``confirmed`` and played, or ``withdrawn``);
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
  first worker drained (adopted) or died (taken_over);
- ``turnkeeper_audible_stop_seconds{transport}``: a barge-in's speech onset
  to the agent's audio pausing on the server (the first stage's pause, or
  the fence when nothing paused it first), s; only when reply audio was
  pending (``cleared_ms`` > 0). What the ear hears is measured by
  ``bench/bargein.py``;
- ``turnkeeper_late_events_fenced_total{type}``: output of an obsolete
  generation or a stopped turn that arrived late and was withheld;
- ``turnkeeper_abandoned_leases_total{action}``: turns whose worker died,
  found by the lease sweeper: ``taken_over`` (run on here) or ``stopped``;
- from ``tts.usage`` and ``tts.failover``: ``turnkeeper_tts_characters_total{provider}``,
  ``turnkeeper_tts_cents_total{provider}``,
  ``turnkeeper_tts_characters_unspoken_at_stop_total{provider,after_stop}``
  (sent but not all heard back when a reply stopped: still billable),
  ``turnkeeper_tts_stop_told_seconds{provider}`` (a reply's stop to its
  synthesiser told on the wire) and
  ``turnkeeper_tts_failovers_total{provider,error,action}``.

From every cancel scope (``manager.scope_observers``):

- ``turnkeeper_stt_seconds{transport}``: end of the user's utterance to
  its final transcript (the recogniser's finish), s;
- ``turnkeeper_model_time_to_first_token_seconds``: a model request's
  start to its first streamed chunk, s;
- ``turnkeeper_tts_time_to_first_audio_seconds``: the reply's first
  sentence handed to TTS to its first audio, s;
- ``turnkeeper_voice_to_voice_seconds{transport}``: the end of the user's
  speech (its last voiced frame, before the endpoint's silence) to the
  reply's first audio queued for playout (a speculative reply's: when its
  end of turn was confirmed, if later), s (the pacer sends it within one
  20 ms frame unless the playout is paused);
- ``turnkeeper_forced_terminations_total{child}``: children still running
  when a stop's grace ran out, cancelled again (``ignored_cancel``).

Read at each scrape: ``turnkeeper_voice_sessions{transport}``,
``turnkeeper_text_turns_running``, ``turnkeeper_send_lateness_seconds`` (a
histogram: how late each 20 ms tick of every session's paced outbound
audio ran, :mod:`media.pacing`; past 20-40 ms callers hear gaps), the load
and capacity (:func:`capacity_families`: ``turnkeeper_capacity_sessions``,
``turnkeeper_process_cpu_ratio``, ``turnkeeper_full``,
``turnkeeper_capacity_refusals_total{reason}``), ``turnkeeper_draining`` (0/1),
``turnkeeper_draining_seconds``, and from the ledger (one store read):
``turnkeeper_ledger_open_rows`` (pending, effect_unknown, retrying; calls
in flight included), ``turnkeeper_reconciliation_backlog`` (effect_unknown
and retrying rows and open compensations: what reconciliation still has to
settle, counted up to ``BACKLOG_SCAN``) and
``turnkeeper_reconciliation_oldest_seconds`` (the age of the oldest of
them, s; 0 when none); the ledger is read at most every ``LEDGER_EVERY_S``.

Nothing here is counted per 20 ms audio frame but the send lateness (a
bisect and two increments in the pacer's own monitor, exported at the
scrape): a voice session costs the metrics a few dictionary updates per turn. No label carries a tenant, session or turn
id (bounded cardinality, and nothing about who talks), so the endpoint needs
no credentials, like ``/healthz``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from media.pacing import LATENESS_BUCKETS_S, PacingMonitor
from turn.intents import IntentKind, IntentStatus
from turn.manager import TurnManager
from turn.models import ChildOutcome, EventRecord, StopReason, StopReport, TurnStatus
from turn.scope_observer import ChildRun
from web.capacity import Capacity
from web.drain import DRAIN
from web.state import CAPACITY, MANAGER, PACING, PEERS, SETTINGS, TEXT_TURNS

log = logging.getLogger(__name__)

#: the histogram's buckets, s: the stop targets (20 ms, 50 ms) fall on edges
STOP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
#: latency buckets of STT, model, TTS and voice-to-voice, s
LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
#: ledger rows read at most for the reconciliation backlog
BACKLOG_SCAN = 500
#: the ledger is read at most this often, s (scrapes in between get the last figures)
LEDGER_EVERY_S = 10.0
#: turns followed at most for their transport and moments
MAX_TURNS = 10_000
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
        self.audible_stop = Histogram(
            "turnkeeper_audible_stop_seconds", "A barge-in's speech onset to the agent's audio pausing on the server, s",
            ["transport"], buckets=STOP_BUCKETS, registry=r,
        )
        self.fenced = Counter("turnkeeper_late_events_fenced", "Late output withheld by the delivery gate", ["type"], registry=r)
        self.stt_failovers = Counter(
            "turnkeeper_stt_failovers", "Speech recognisers that failed mid-session, and what followed",
            ["provider", "error", "action"], registry=r,
        )
        self.stt_audio = Counter("turnkeeper_stt_audio_seconds", "Audio sent to each speech recogniser, s (replays included)",
                                 ["provider"], registry=r)
        self.stt_connection = Counter("turnkeeper_stt_connection_seconds",
                                      "How long sessions' connections to each speech recogniser were open, s", ["provider"], registry=r)
        self.stt_cents = Counter("turnkeeper_stt_cents", "What speech recognition cost by the settings' prices, US cents",
                                 ["provider"], registry=r)
        self.tts_failovers = Counter(
            "turnkeeper_tts_failovers", "Speech synthesisers that failed mid-reply, and what followed",
            ["provider", "error", "action"], registry=r,
        )
        self.tts_characters = Counter("turnkeeper_tts_characters", "Characters sent to each speech synthesiser",
                                      ["provider"], registry=r)
        self.tts_unspoken = Counter(
            "turnkeeper_tts_characters_unspoken_at_stop",
            "Characters sent to a synthesiser whose audio had not all arrived when the reply stopped (still billable)",
            ["provider", "after_stop"], registry=r,
        )
        self.tts_cents = Counter("turnkeeper_tts_cents", "What speech synthesis cost by the settings' prices, US cents",
                                 ["provider"], registry=r)
        self.tts_stop_told = Histogram(
            "turnkeeper_tts_stop_told_seconds", "A reply's stop to its synthesiser told on the wire, s",
            ["provider"], buckets=STOP_BUCKETS, registry=r,
        )
        self.abandoned = Counter("turnkeeper_abandoned_leases", "Turns whose worker died, found by the lease sweeper",
                                 ["action"], registry=r)
        self.stt = Histogram("turnkeeper_stt_seconds", "End of the utterance to its final transcript, s",
                             ["transport"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("turnkeeper_model_time_to_first_token_seconds",
                              "A model request's start to its first streamed chunk, s", buckets=LATENCY_BUCKETS, registry=r)
        self.tts_first_audio = Histogram("turnkeeper_tts_time_to_first_audio_seconds",
                                         "The reply's first sentence handed to TTS to its first audio, s",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.voice_to_voice = Histogram("turnkeeper_voice_to_voice_seconds",
                                        "End of the user's speech to the reply's first audio queued for playout, s",
                                        ["transport"], buckets=LATENCY_BUCKETS, registry=r)
        self.forced = Counter("turnkeeper_forced_terminations", "Children still running when a stop's grace ran out",
                              ["child"], registry=r)
        self.speculative = Counter("turnkeeper_speculative_turns",
                                   "Replies started at a tentative end of turn, by outcome (confirmed: played; withdrawn: "
                                   "taken back, the user went on)", ["outcome"], registry=r)
        self.end_of_turn = Counter("turnkeeper_end_of_turn", "Ends of the user's turn, by what decided them", ["by"],
                                   registry=r)
        #: the transport of a session open here ("" if none): set by add_routes
        self.transport_of: Callable[[str], str] = lambda _session_id: ""
        #: transport of each turn running here (resolved as it starts), and
        #: its moments noted: speech_end, stt_start (at most MAX_TURNS turns)
        self._transport_of_turn: OrderedDict[str, str] = OrderedDict()
        self._noted: dict[str, dict[str, datetime]] = {}
        #: the ledger's figures as last read: open rows, backlog, oldest age (s)
        self.ledger_figures: tuple[int, int, float] | None = None
        self.ledger_read_at: float | None = None

    def observe(self, ev: EventRecord) -> None:
        """Count one logged event (the tap on the event logs)."""
        p = ev.payload
        if ev.fenced:
            self.fenced.labels(type=ev.type).inc()
        if ev.type == "turn" and p.get("status") == TurnStatus.RUNNING.value and ev.turn_id:
            self._transport_of_turn[ev.turn_id] = self.transport_of(ev.session_id) or "text"
            while len(self._transport_of_turn) > MAX_TURNS:  # turns that ended elsewhere (taken over, lost)
                self._forget(next(iter(self._transport_of_turn)))
        elif ev.type == "turn" and p.get("status") == TurnStatus.QUEUED.value and ev.turn_id:
            self._forget(ev.turn_id)  # released in a drain: it runs on elsewhere
        elif ev.type == "turn" and p.get("status") in TERMINAL:
            reason = p.get("stop_reason") or {}
            kind = str(reason.get("kind", ""))
            self.turns_ended.labels(status=p["status"], reason=kind).inc()
            if str(reason.get("request_id", "")).startswith("recover:"):
                self.abandoned.labels(action="stopped").inc()
            if ev.turn_id:
                self._forget(ev.turn_id)
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
            transport = self.transport_of(ev.session_id)
            to_fence = float(p.get("onset_to_fence_ms") or 0)
            self.onset_to_fence.labels(transport=transport).observe(max(0.0, to_fence / 1000))
            if p.get("initiator") == "vad" and int(p.get("cleared_ms") or 0) > 0:
                # speech over a reply with audio pending (a press has no onset; a
                # barge-in while the agent only thought stopped nothing audible)
                # playout paused paused_ms before the fence (0: the fence paused it)
                to_pause = to_fence - float(p.get("paused_ms") or 0)
                self.audible_stop.labels(transport=transport).observe(max(0.0, to_pause / 1000))
        elif ev.type == "end_of_turn":
            if p.get("speculative"):
                self.speculative.labels(outcome=str(p.get("outcome", ""))).inc()
            self.end_of_turn.labels(by=str(p.get("by", ""))).inc()
        elif ev.type in ("false_interruption", "backchannel"):
            transport = self.transport_of(ev.session_id)
            (self.false_interruptions if ev.type == "false_interruption" else self.backchannels).labels(transport=transport).inc()
            self.noise_pause.labels(kind=ev.type, transport=transport).observe(max(0.0, float(p.get("paused_ms") or 0) / 1000))
        elif ev.type == "stt.failover":
            self.stt_failovers.labels(provider=str(p.get("provider", "")), error=str(p.get("error", "")),
                                      action=str(p.get("action", ""))).inc()
        elif ev.type == "stt.usage":
            provider = str(p.get("provider", ""))
            self.stt_audio.labels(provider=provider).inc(max(0.0, float(p.get("audio_s") or 0)))
            self.stt_connection.labels(provider=provider).inc(max(0.0, float(p.get("connection_s") or 0)))
            self.stt_cents.labels(provider=provider).inc(max(0.0, float(p.get("cents") or 0)))
        elif ev.type == "tts.failover":
            self.tts_failovers.labels(provider=str(p.get("provider", "")), error=str(p.get("error", "")),
                                      action=str(p.get("action", ""))).inc()
        elif ev.type == "tts.usage":
            provider = str(p.get("provider", ""))
            self.tts_characters.labels(provider=provider).inc(max(0, int(p.get("characters") or 0)))
            self.tts_cents.labels(provider=provider).inc(max(0.0, float(p.get("cents") or 0)))
            if p.get("after_stop"):
                self.tts_unspoken.labels(provider=provider, after_stop=str(p["after_stop"])).inc(
                    max(0, int(p.get("characters_unspoken_at_stop") or 0)))
            if p.get("stop_told_ms") is not None:
                self.tts_stop_told.labels(provider=provider).observe(max(0.0, float(p["stop_told_ms"]) / 1000))
        elif ev.type in EFFECT_OUTCOMES:
            self.effects.labels(outcome=EFFECT_OUTCOMES[ev.type]).inc()
        elif ev.type == "agent.restart":
            self.resumed.labels(how=str(p.get("reason", ""))).inc()
            if p.get("reason") == "taken_over":
                self.abandoned.labels(action="taken_over").inc()

    # -- the scope observer (turn.scope_observer.ScopeObserver) -------------------

    def child_started(self, child: ChildRun) -> None:
        """Nothing to count at a child's start."""

    def child_ended(self, child: ChildRun) -> None:
        """STT, the model's first token, TTS's first audio and voice-to-voice
        from a child that ended (only what it did before any stop)."""
        if child.ended_at is None:
            return
        noted = self._noted.get(child.turn_id, {})
        if child.name == "stt" and child.outcome is ChildOutcome.COMPLETED:
            began = noted.get("stt_start", child.started_at)  # the final may be under way before the turn's scope opens
            self.stt.labels(transport=self._transport(child.turn_id)).observe(
                max(0.0, (child.ended_at - began).total_seconds()))
        elif child.name == "model" and (first := child.mark_at("first_token")) is not None:
            self.ttft.observe((first - child.started_at).total_seconds())
        elif child.name == "tts" and (audio := child.mark_at("first_audio")) is not None:
            sentence = child.mark_at("first_sentence")
            if sentence is not None:
                self.tts_first_audio.observe(max(0.0, (audio - sentence).total_seconds()))
            ended = noted.pop("speech_end", None)
            queued = child.mark_at("first_queued") or audio  # a speculative reply's audio waits for its confirmed end
            if ended is not None:
                self.voice_to_voice.labels(transport=self._transport(child.turn_id)).observe(
                    max(0.0, (queued - ended).total_seconds()))

    def scope_stopped(self, turn_id: str, reason: StopReason | None, at: datetime) -> None:
        """Nothing to count at a stop (its latency is the terminal event's)."""

    def scope_settled(self, turn_id: str, report: StopReport, at: datetime) -> None:
        """Count the children that ignored their cancellation."""
        for c in report.children:
            if c.outcome is ChildOutcome.IGNORED_CANCEL:
                self.forced.labels(child=c.name.split(":", 1)[0]).inc()  # "tool:<name>" counts as "tool"

    def turn_noted(self, turn_id: str, name: str, at: datetime) -> None:
        """The user's speech ended (``speech_end``: voice-to-voice starts)
        or its recogniser's final began (``stt_start``)."""
        if turn_id in self._transport_of_turn:
            self._noted.setdefault(turn_id, {})[name] = at

    def _transport(self, turn_id: str) -> str:
        return self._transport_of_turn.get(turn_id, "text")

    def _forget(self, turn_id: str) -> None:
        self._transport_of_turn.pop(turn_id, None)
        self._noted.pop(turn_id, None)


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

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily | CounterMetricFamily]:
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
        yield send_lateness(self.app[PACING])
        yield from capacity_families(self.app[CAPACITY], self.app[SETTINGS].max_sessions)
        drain = self.app[DRAIN]
        yield GaugeMetricFamily("turnkeeper_draining", "1 while this instance drains", value=int(drain.draining))
        yield GaugeMetricFamily("turnkeeper_draining_seconds", "How long it has drained, s", value=drain.elapsed_s())
        figures = self.app[METRICS].ledger_figures
        if figures is not None:  # None: the store could not be read at this scrape
            open_rows, backlog, oldest = figures
            yield GaugeMetricFamily("turnkeeper_ledger_open_rows", "Ledger rows not resolved (calls in flight included)",
                                    value=open_rows)
            yield GaugeMetricFamily("turnkeeper_reconciliation_backlog",
                                    "effect_unknown and retrying rows and open compensations", value=backlog)
            yield GaugeMetricFamily("turnkeeper_reconciliation_oldest_seconds", "Age of the oldest of them, s", value=oldest)


def send_lateness(monitor: PacingMonitor) -> HistogramMetricFamily:
    """``turnkeeper_send_lateness_seconds``: how late (s) each 20 ms tick of
    every session's paced outbound audio ran after it was due, all
    transports (:mod:`media.pacing`)."""
    cumulative, buckets = 0, []
    for bound, count in zip((*LATENESS_BUCKETS_S, float("inf")), monitor.counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    family = HistogramMetricFamily("turnkeeper_send_lateness_seconds",
                                   "Lateness of the paced outbound audio ticks of every session, s")
    family.add_metric([], buckets, sum_value=monitor.total_s)
    return family


def capacity_families(capacity: Capacity, max_sessions: int) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The load and capacity (:mod:`web.capacity`):
    ``turnkeeper_capacity_sessions`` (the sessions the CPU budget holds at
    the measured cost a session, at most ``max_sessions``; ``max_sessions``
    until measured), ``turnkeeper_process_cpu_ratio`` (the server
    process's CPU over the window, share of one core),
    ``turnkeeper_full`` (1 while a new call would be refused) and
    ``turnkeeper_capacity_refusals_total`` by reason (``send_lateness``,
    ``cpu``)."""
    load = capacity.load()
    estimate = max_sessions if load.estimate is None else min(load.estimate, max_sessions)
    yield GaugeMetricFamily("turnkeeper_capacity_sessions", "Sessions this server carries at the measured cost",
                            value=estimate)
    if load.cpu is not None:
        yield GaugeMetricFamily("turnkeeper_process_cpu_ratio", "The server process's CPU, share of one core",
                                value=load.cpu)
    full = load.live >= max_sessions or capacity.full() is not None
    yield GaugeMetricFamily("turnkeeper_full", "1 while a new call would be refused", value=int(full))
    refusals = CounterMetricFamily("turnkeeper_capacity_refusals", "Calls refused because the server was full",
                                   labels=["reason"])
    for reason, n in capacity.refusals.items():
        refusals.add_metric([reason], n)
    yield refusals


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
    app[MANAGER].scope_observers.append(metrics)
    app.router.add_get("/metrics", _metrics)


async def ledger_figures(manager: TurnManager) -> tuple[int, int, float]:
    """The ledger as reconciliation sees it: (rows not resolved, rows
    reconciliation must still settle, age of the oldest of those in s),
    read from the store (at most ``BACKLOG_SCAN`` rows).

    Raises:
        turn.store.StoreUnavailable: the store could not be read.
    """
    store, now = manager.store, manager.clock.now()
    open_rows = await manager.store_call(store.ledger_open_count)
    rows = await manager.store_call(lambda: store.ledger_due(now + timedelta(days=3650), BACKLOG_SCAN))
    backlog = [r for r in rows if r.status in (IntentStatus.EFFECT_UNKNOWN, IntentStatus.RETRYING)
               or r.kind is IntentKind.COMPENSATION]
    oldest = max(((now - r.created_at).total_seconds() for r in backlog), default=0.0)
    return open_rows, len(backlog), max(0.0, oldest)


async def _metrics(request: web.Request) -> web.Response:
    metrics, manager = request.app[METRICS], request.app[MANAGER]
    now = manager.clock.monotonic()
    if metrics.ledger_read_at is None or now - metrics.ledger_read_at >= LEDGER_EVERY_S:
        metrics.ledger_read_at = now  # a flood of scrapes reads the store once per LEDGER_EVERY_S
        try:
            metrics.ledger_figures = await ledger_figures(manager)
        except Exception:
            metrics.ledger_figures = None  # the other metrics are still worth serving
            log.warning("metrics: the ledger could not be read", exc_info=True)
    body = generate_latest(metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
