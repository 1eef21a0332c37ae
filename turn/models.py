"""The turn record and its vocabulary (see DESIGN.md, "The words we use").

A :class:`Turn` is one user intention and everything done for it, from
acceptance to exactly one terminal state. Times are timezone-aware UTC.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TurnStatus(StrEnum):
    """States of DESIGN.md "Turn states". Terminal: COMPLETED, FAILED,
    CANCELLED, RECONCILE_REQUIRED."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    CANCEL_REQUESTED = "CANCEL_REQUESTED"
    CANCELLED = "CANCELLED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    RECONCILE_REQUIRED = "RECONCILE_REQUIRED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES

    @property
    def label(self) -> str:
        """What a user interface shows: CANCEL_REQUESTED is "stopping", never
        "cancelled", until the worker confirms (DESIGN.md invariant)."""
        return _LABELS[self]


TERMINAL_STATUSES = frozenset(
    {TurnStatus.COMPLETED, TurnStatus.FAILED, TurnStatus.CANCELLED, TurnStatus.RECONCILE_REQUIRED}
)

_LABELS = {
    TurnStatus.QUEUED: "queued",
    TurnStatus.RUNNING: "running",
    TurnStatus.CANCEL_REQUESTED: "stopping",
    TurnStatus.CANCELLED: "cancelled",
    TurnStatus.COMPLETED: "completed",
    TurnStatus.FAILED: "failed",
    TurnStatus.RECONCILE_REQUIRED: "reconcile_required",
}


class TurnKind(StrEnum):
    """How the user's request arrived: spoken (voice) or typed (text)."""

    VOICE = "voice"
    TEXT = "text"


class StopReasonKind(StrEnum):
    """Why a turn was stopped (DESIGN.md "stop reason")."""

    USER_CANCEL = "user_cancel"
    BARGE_IN = "barge_in"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    BUDGET_EXCEEDED = "budget_exceeded"
    MAX_STEPS = "max_steps"
    LOOP_DETECTED = "loop_detected"
    SAFETY_ABORT = "safety_abort"
    WORKER_SHUTDOWN = "worker_shutdown"
    TRANSPORT_DISCONNECTED = "transport_disconnected"
    #: a speculative turn (started on a tentative end of turn) taken back
    #: because the user went on: it must not have acted or been heard
    SPECULATION_WITHDRAWN = "speculation_withdrawn"


class StopReason(BaseModel):
    """A structured stop reason.

    Attributes:
        kind: what kind of stop.
        initiator: who asked, e.g. ``"user"``, ``"vad"``, ``"server"``.
        at: when it was asked (UTC).
        request_id: the stop request's id; repeats with the same id are one stop.
        detail: free text for humans.
    """

    model_config = ConfigDict(frozen=True)

    kind: StopReasonKind
    initiator: str
    at: datetime
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    detail: str | None = None


class Budget(BaseModel):
    """Spending limits of a turn; None means no limit.

    Attributes:
        cents: money, in US cents (fractions allowed: token prices are tiny).
        tokens: model tokens, prompt and completion together.
    """

    model_config = ConfigDict(frozen=True)

    cents: float | None = Field(default=None, ge=0)
    tokens: int | None = Field(default=None, ge=0)


class Spent(BaseModel):
    """What a turn has used so far (cents, tokens)."""

    model_config = ConfigDict(frozen=True)

    cents: float = Field(default=0.0, ge=0)
    tokens: int = Field(default=0, ge=0)


class UsageRecord(BaseModel):
    """The usage of one model request.

    Attributes:
        request: its number in the turn, 1, 2, ...
        prompt_tokens / completion_tokens: tokens billed for it.
        completion_tokens_after_stop: of those, streamed after the turn's
            stop was requested.
        partial: True if the request was aborted before its end (the figures
            are what was streamed up to the abort).
        source: ``"usage_chunk"`` when the provider reported the figures (the
            stream's usage chunk), ``"counted"`` when they were counted here
            (one streamed chunk = one token; the prompt estimated).
        started_after_stop: the request began after the stop request (a
            defect: it must never happen).
        max_tokens: the completion cap the request was sent with, tokens
            (None: the provider was given none).
        after_stop: for a request in flight when the turn was stopped:
            ``"confirmed"`` when the provider is known to have stopped
            generating (it ran in this process, or its stream ended and
            every token was seen), ``"unconfirmed"`` when turnkeeper only
            closed the connection and cannot see what the provider went on
            generating; None for a request no stop concerned.
        completion_tokens_after_stop_bound: at most this many completion
            tokens were generated after the stop, tokens: the ones seen
            (``completion_tokens_after_stop``), plus, when unconfirmed, the
            rest of ``max_tokens`` the provider may have spent unseen. None
            when unconfirmed and uncapped (no bound is known).
    """

    model_config = ConfigDict(frozen=True)

    request: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    completion_tokens_after_stop: int = 0
    partial: bool = False
    source: str = "counted"
    started_after_stop: bool = False
    max_tokens: int | None = None
    after_stop: Literal["confirmed", "unconfirmed"] | None = None
    completion_tokens_after_stop_bound: int | None = 0


class RecognitionRecord(BaseModel):
    """What recognising the user's words of a turn cost, per recogniser
    (a turn whose provider failed mid-utterance has one record for it and
    one for the recogniser that took over).

    Attributes:
        provider: the recogniser (``"deepgram"``, ``"pocketsphinx"``, ...).
        audio_s: audio of the turn's utterance sent to it, s (a replay
            after a reconnect counts again: it is sent again).
        input_tokens / output_tokens: tokens it reported for that audio
            (providers that bill by token), tokens.
        cents: its price by the settings (``stt.*_cents_*``), US cents.
    """

    model_config = ConfigDict(frozen=True)

    provider: str
    audio_s: float = Field(0.0, ge=0)
    input_tokens: int = Field(0, ge=0)
    output_tokens: int = Field(0, ge=0)
    cents: float = Field(0.0, ge=0)


class SynthesisRecord(BaseModel):
    """What speaking one reply cost, per provider (a turn's ``usage.synthesis``).

    Attributes:
        provider: ``"espeak-ng"``, ``"openai"``, ``"elevenlabs"``, ...
        characters: characters sent to it.
        characters_after_stop: characters sent after the stop (must stay 0).
        characters_unspoken_at_stop: characters sent whose audio had not all
            arrived when the reply was stopped: what it may still bill after
            the stop (0 if not stopped).
        after_stop: ``"confirmed"`` or ``"unconfirmed"`` if the reply was
            stopped with text in flight (see :class:`StopRecord`), else None.
        audio_s: audio received from it, s.
        cents: its price by the settings, US cents.
    """

    model_config = ConfigDict(frozen=True)

    provider: str
    characters: int = Field(0, ge=0)
    characters_after_stop: int = Field(0, ge=0)
    characters_unspoken_at_stop: int = Field(0, ge=0)
    after_stop: Literal["confirmed", "unconfirmed"] | None = None
    audio_s: float = Field(0.0, ge=0)
    cents: float = Field(0.0, ge=0)


class Usage(BaseModel):
    """Model usage of a turn, honest about stops.

    Attributes:
        prompt_tokens / completion_tokens: billed tokens in all.
        completion_tokens_after_stop: tokens received from the provider
            after the stop was requested (waste that a stop could not
            prevent), as far as turnkeeper saw them.
        after_stop: ``"unconfirmed"`` if any request in flight at the stop
            may have gone on generating unseen (its connection was closed,
            the provider did not confirm), ``"confirmed"`` if every such
            request is known to have stopped, None if no request was in
            flight at a stop. Never read an unconfirmed 0 as "nothing was
            spent".
        completion_tokens_after_stop_bound: an upper bound of the completion
            tokens generated after the stop, seen or not (the per-request
            bounds added up); None when some request was unconfirmed and
            uncapped.
        requests_after_stop: model requests started after the stop request
            (must stay 0).
        model_requests: model requests started in all.
        records: one record per model request, in order.
        recognition: what recognising the user's words cost, one record
            per recogniser that heard them (its cents count against the
            turn's money budget; its tokens are not model tokens and do not
            count against ``budget_tokens``).
        synthesis: what speaking the reply cost, one record per synthesiser
            stream it used (a provider, its reconnect, espeak-ng); its cents
            count against the money budget.
    """

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int = 0
    completion_tokens: int = 0
    completion_tokens_after_stop: int = 0
    after_stop: Literal["confirmed", "unconfirmed"] | None = None
    completion_tokens_after_stop_bound: int | None = 0
    requests_after_stop: int = 0
    model_requests: int = 0
    records: list[UsageRecord] = Field(default_factory=list)
    recognition: list[RecognitionRecord] = Field(default_factory=list)
    synthesis: list[SynthesisRecord] = Field(default_factory=list)


class ChildOutcome(StrEnum):
    """How one piece of a turn's work ended (its report to the turn's cancel
    scope)."""

    #: it finished its work before any stop
    COMPLETED = "completed"
    #: it ended because of the stop (cancelled, or a checkpoint raised)
    STOPPED = "stopped"
    #: it was in a must-complete section when the stop came and finished it
    COMMITTING = "committing"
    #: it was still running when the stop grace ran out
    IGNORED_CANCEL = "ignored_cancel"
    #: it raised an error
    FAILED = "failed"


class ChildReport(BaseModel):
    """One child's report.

    Attributes:
        name: e.g. ``"model"``, ``"tool:lookup_weather"``, ``"tts"``.
        outcome: how it ended.
        ms: from the stop request to its end, ms (None if it ended before
            the stop or had not ended when the report was written).
        detail: an error, or what it was doing.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    outcome: ChildOutcome
    ms: float | None = None
    detail: str | None = None


class StopReport(BaseModel):
    """What a stop found: each child's report, and how long they took.

    Attributes:
        children: the reports, in the order the children started.
        settled_ms: from the stop request to the last report (or to the end
            of the grace), ms.
        grace_ms: the grace the children had, ms.
    """

    model_config = ConfigDict(frozen=True)

    children: list[ChildReport] = Field(default_factory=list)
    settled_ms: float = 0.0
    grace_ms: float = 0.0


class Plan(BaseModel):
    """A tenant's limits for every turn (settings ``plans``); the worker
    never hard-codes them.

    Attributes:
        deadline_s: a turn's absolute deadline, s after it is accepted.
        budget_cents: money per turn, US cents (None: no limit).
        budget_tokens: model tokens per turn, prompt and completion
            together (None: no limit).
        max_steps: model and tool calls per turn at most.
        shutdown_reserve_ms: the part of the remaining time kept back from
            every child for the turn's own wind-down, ms.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    deadline_s: float = Field(300.0, gt=0, le=24 * 3600)
    budget_cents: float | None = Field(100.0, ge=0)
    budget_tokens: int | None = Field(100_000, ge=0)
    max_steps: int = Field(16, ge=1, le=10_000)
    shutdown_reserve_ms: int = Field(250, ge=0, le=60_000)

    @model_validator(mode="after")
    def _reserve_fits(self) -> Plan:
        if self.shutdown_reserve_ms / 1000 >= self.deadline_s:
            raise ValueError("shutdown_reserve_ms must be shorter than deadline_s, or no child could ever run")
        return self

    @property
    def budget(self) -> Budget:
        """The plan's :class:`Budget`."""
        return Budget(cents=self.budget_cents, tokens=self.budget_tokens)


class Turn(BaseModel):
    """One turn, as the store holds it (the authority).

    Attributes:
        id: uuid4 hex string.
        tenant_id: the tenant that owns it (API token's tenant; "default" for
            browser and phone sessions).
        session_id: the session (peer connection, call, device, REST session).
        kind: voice or text.
        status: current state.
        generation: the session generation this turn's output is tagged with.
        stop_reason: set by the first stop request (later ones never replace it).
        error: why a FAILED turn failed, if not a stop reason.
        transcript: the user's words (STT final, or the typed text).
        reply: the agent's reply as far as the user received it: for a
            voice turn, the words whose audio left the playout buffer; for a
            text turn, the tokens delivered to the client. Every history a
            model is given is built from this.
        reply_unheard: the rest of what the model generated but nobody
            heard (cut off by a stop, or fenced), kept for audit only and
            never shown to a model; None if everything was heard.
        merged_into: the id of a later turn of the session that answered
            this turn's words together with its own (the user paused, then
            went on before any of this turn's reply was heard); such a turn
            is left out of every history: the later one carries its words.
        deadline_at: absolute deadline (UTC), None if none.
        budget / spent: limits and use (cents, tokens).
        step_count: steps started (model and tool calls).
        max_steps: the most steps it may take.
        usage: model token accounting.
        stop_report: how each child of its work ended after a stop.
        lease_owner / heartbeat_at: the worker running it and when it last
            proved it is alive.
        created_at / updated_at / terminal_at: UTC; terminal_at is set
            exactly once.
    """

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    tenant_id: str = "default"
    session_id: str
    kind: TurnKind = TurnKind.VOICE
    status: TurnStatus = TurnStatus.QUEUED
    generation: int
    stop_reason: StopReason | None = None
    error: str | None = None
    transcript: str | None = None
    reply: str | None = None
    reply_unheard: str | None = None
    merged_into: str | None = None
    deadline_at: datetime | None = None
    budget: Budget = Budget()
    spent: Spent = Spent()
    step_count: int = 0
    max_steps: int = 16
    usage: Usage = Usage()
    stop_report: StopReport | None = None
    lease_owner: str | None = None
    heartbeat_at: datetime | None = None
    created_at: datetime
    updated_at: datetime
    terminal_at: datetime | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal

    @property
    def released(self) -> bool:
        """A worker gave it up at a checkpoint for another to resume
        (:mod:`turn.resume`): QUEUED with no lease owner but a heartbeat (a
        turn never started has neither)."""
        return self.status is TurnStatus.QUEUED and self.lease_owner is None and self.heartbeat_at is not None


class Session(BaseModel):
    """A connected client, or a REST conversation, that holds turns.

    Attributes:
        id: session id.
        tenant_id: owner.
        kind: voice (WebRTC, phone, device) or text (REST).
        generation: last generation handed out (0: none yet).
        created_at: UTC.
    """

    id: str
    tenant_id: str = "default"
    kind: TurnKind = TurnKind.VOICE
    generation: int = 0
    created_at: datetime


class EventRecord(BaseModel):
    """One event a client sees, as the log keeps it.

    Attributes:
        session_id: whose log.
        seq: position in the session's log, 1, 2, 3, ... (assigned by the store).
        turn_id: the turn it is about, if any.
        generation: the generation that produced it.
        type: e.g. "turn", "transcript", "agent.delta", "audio.start".
        at: when it happened (UTC).
        payload: the event's own fields.
        fenced: True if the delivery gate withheld it (an obsolete
            generation's output, kept as audit evidence).
    """

    session_id: str
    seq: int = 0
    turn_id: str | None = None
    generation: int = 0
    type: str
    at: datetime
    payload: dict[str, Any] = Field(default_factory=dict)
    fenced: bool = False


class InstanceInfo(BaseModel):
    """One server instance as it registers itself in the store (with a
    heartbeat), for operators, load balancers and clients to see the fleet.

    Attributes:
        id: the instance's id (its lease-owner id).
        url: where it is reached (``advertise_url``).
        state: ``serving`` or ``draining`` (send new sessions to serving ones).
        voice_sessions: voice sessions open on it.
        text_turns: text turns running on it.
        started_at / heartbeat_at: UTC.
    """

    id: str
    url: str
    state: Literal["serving", "draining"]
    voice_sessions: int = 0
    text_turns: int = 0
    started_at: datetime
    heartbeat_at: datetime
