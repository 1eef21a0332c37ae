"""The turn record and its vocabulary (see DESIGN.md, "The words we use").

A :class:`Turn` is one user intention and everything done for it, from
acceptance to exactly one terminal state. Times are timezone-aware UTC.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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


class Usage(BaseModel):
    """Model usage of a turn, honest about stops.

    Attributes:
        prompt_tokens / completion_tokens: billed tokens in all.
        completion_tokens_after_stop: tokens the provider produced after the
            stop was requested (waste that a stop could not prevent).
        requests_after_stop: model requests started after the stop request
            (must stay 0).
        model_requests: model requests started in all.
    """

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int = 0
    completion_tokens: int = 0
    completion_tokens_after_stop: int = 0
    requests_after_stop: int = 0
    model_requests: int = 0


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
        reply: the agent's reply text.
        deadline_at: absolute deadline (UTC), None if none.
        budget / spent: limits and use (cents, tokens).
        step_count: checkpoints passed (model and tool calls).
        usage: model token accounting.
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
    deadline_at: datetime | None = None
    budget: Budget = Budget()
    spent: Spent = Spent()
    step_count: int = 0
    usage: Usage = Usage()
    lease_owner: str | None = None
    heartbeat_at: datetime | None = None
    created_at: datetime
    updated_at: datetime
    terminal_at: datetime | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal


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
