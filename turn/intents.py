"""The ledger's rows (DESIGN.md "side effect"): an :class:`Intent` per
external effect (or compensation of one), keyed by its idempotency key, the
:class:`AuditRow` left by every change, and what an external system can say
about a key (:class:`LookupAnswer`).

The service that writes and resolves them is :mod:`turn.ledger`; what a
stop does with them, :mod:`turn.stop_policy`.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class IntentStatus(StrEnum):
    """Where an intent (or a compensation job) stands."""

    #: written before the external call; the call may be running
    PENDING = "pending"
    #: the effect happened (confirmed by the call's answer or a lookup)
    DONE = "done"
    #: the effect was reversed by its compensation
    COMPENSATED = "compensated"
    #: never sent, safe to drop (effect "none"), or confirmed not applied by
    #: the external system (a lookup, or a compensation that found nothing)
    ABANDONED = "abandoned"
    #: sent, outcome not known: reconciliation asks the external system
    EFFECT_UNKNOWN = "effect_unknown"
    #: a compensation job waiting for (another) attempt
    RETRYING = "retrying"
    #: reconciliation or compensation gave up: a person must decide
    HUMAN_REQUIRED = "human_required"


#: statuses that need no more work
RESOLVED = frozenset({IntentStatus.DONE, IntentStatus.COMPENSATED, IntentStatus.ABANDONED})
#: statuses a worker must still act on
OPEN = frozenset({IntentStatus.PENDING, IntentStatus.EFFECT_UNKNOWN, IntentStatus.RETRYING})


class IntentKind(StrEnum):
    """A tool's effect, or a compensation of one."""

    EFFECT = "effect"
    COMPENSATION = "compensation"


class Intent(BaseModel):
    """One row of the ledger.

    Attributes:
        key: the idempotency key: ``"<turn_id>:<step>"`` for a tool call's
            effect, ``"<effect key>:compensate"`` for its compensation, the
            item's own key (``"<batch key>:<i>"``) for one item of queued
            downstream work. The external system receives it and must apply
            each key at most once.
        turn_id: the turn.
        step: the step index within the turn (1, 2, ...); a queued item
            carries the step of the call that queued it.
        tool: the tool's name (a queued item: its queue's name).
        args: the tool's arguments.
        effect: the tool's declared effect ("none", "complete", "compensate").
        kind: effect or compensation.
        status: see :class:`IntentStatus`.
        result: the call's answer (text), once done; None for one a
            lookup confirmed done (:func:`turn.reversal.answered`).
        error: the last error, for humans.
        attempts: calls or lookups made so far (compensation and
            reconciliation count their attempts here).
        next_attempt_at: when a worker should try again (UTC).
        created_at / updated_at / done_at: UTC; ``done_at`` is when the
            effect was confirmed (kept when it is later compensated).
        version: bumped by every change (compare-and-set).
    """

    model_config = ConfigDict(frozen=True)

    key: str
    turn_id: str
    step: int
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    effect: str = "none"
    kind: IntentKind = IntentKind.EFFECT
    status: IntentStatus = IntentStatus.PENDING
    result: str | None = None
    error: str | None = None
    attempts: int = 0
    next_attempt_at: datetime | None = None
    created_at: datetime
    updated_at: datetime
    done_at: datetime | None = None
    version: int = 1


class AuditRow(BaseModel):
    """One thing done to an intent (an attempt, an answer, a decision).

    Attributes:
        key: the intent's key.
        at: when (UTC).
        action: e.g. "intent", "done", "compensate", "lookup", "retry".
        detail: what happened, for humans.
    """

    model_config = ConfigDict(frozen=True)

    key: str
    at: datetime
    action: str
    detail: str = ""


class LookupAnswer(StrEnum):
    """What the external system says about an idempotency key."""

    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"


def effect_key(turn_id: str, step: int) -> str:
    """The idempotency key of a turn's step: ``"<turn_id>:<step>"``."""
    return f"{turn_id}:{step}"


def compensation_key(key: str) -> str:
    """The compensation job's own idempotency key."""
    return f"{key}:compensate"
