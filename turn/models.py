"""The turn record and its vocabulary (see DESIGN.md, "The words we use").

A :class:`Turn` is one user intention and everything done for it, from
acceptance to exactly one terminal state. Times are timezone-aware UTC.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum

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


class Turn(BaseModel):
    """One turn, as the store holds it (the authority).

    Attributes:
        id: uuid4 hex string.
        session_id: the session (peer connection, call, device) it belongs to.
        kind: voice or text.
        status: current state.
        generation: the session generation this turn's output is tagged with.
        stop_reason: set once a stop was requested.
        error: why a FAILED turn failed, if not a stop reason.
        transcript: the user's words (STT final, or the typed text).
        reply: the agent's reply text as generated so far.
        created_at / terminal_at: UTC; terminal_at is set exactly once.
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
    created_at: datetime
    updated_at: datetime
    terminal_at: datetime | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal
