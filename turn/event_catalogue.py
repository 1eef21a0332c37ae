"""The event catalogue: every event a client sees, declared once (issue 12,
item 4); what a client may send is :mod:`turn.client_messages`, the JSON
Schema of both :mod:`turn.catalogue_schema`.

Most server events are logged (:class:`turn.events.SessionEventLog`) and read
back, so they carry the log's :class:`Envelope` (``seq``, ``turn_id``,
``generation``, ``at``, as :func:`turn.events.event_json` gives them) beside
``type`` and their own fields. A few are sent directly, with no envelope:
``pong`` and refusals (``error``) on the data channel, ``stream.start`` and
``snapshot`` on an SSE stream.

Every model is strict (``"3"`` is no integer) and forbids undeclared fields;
a field an emitter sometimes leaves out has a default, one always sent but
nullable has none. :data:`Event` is the union on ``type``,
:func:`validate_event` checks one event; what a mismatch does is
:mod:`turn.conformance`'s. Imports nothing from media, voice or web.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

TurnStatusName = Literal["QUEUED", "RUNNING", "CANCEL_REQUESTED", "CANCELLED", "COMPLETED", "FAILED", "RECONCILE_REQUIRED"]
StopKindName = Literal["user_cancel", "barge_in", "deadline_exceeded", "budget_exceeded", "max_steps", "loop_detected",
                       "safety_abort", "worker_shutdown", "transport_disconnected", "speculation_withdrawn"]
#: what the barge-in detector decided (media.bargein.DetectorEventKind), or the endpointer
VadEventName = Literal["speech_started", "speech_confirmed", "speech_rejected", "speech_stopped", "end_of_turn"]
#: who took the turn in a barge-in: voice activity, push-to-talk or a telephone key (DTMF)
BargeInInitiator = Literal["vad", "ptt", "dtmf", "wake_word"]
#: what the agent is doing for a voice turn
AgentPhase = Literal["thinking", "speaking", "idle"]
#: a tool's declared effect (voice.tools.Effect)
EffectName = Literal["none", "complete", "compensate"]
#: every ``error`` code the server sends
ErrorCode = Literal[
    "ptt_too_long", "store_error", "turn_failed",  # logged by the agent session
    "session_failed", "bad_message", "message_too_large", "unknown_type", "rate_limited",  # sent directly (web.peer) ...
    "ptt_already_active", "ptt_not_active", "session_not_ready",  # ... refusing a push-to-talk message
]


class EventMismatch(ValueError):
    """An event the catalogue does not declare, or whose fields do not
    match its declaration.

    Attributes:
        type: the event's type as given.
        problems: what is wrong, one ``"field: message"`` per problem.
    """

    def __init__(self, type: str, problems: list[str]) -> None:
        super().__init__(f"event {type!r}: " + "; ".join(problems))
        self.type = type
        self.problems = problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _type_required(schema: dict[str, Any]) -> None:
    required = schema.setdefault("required", [])
    if "type" not in required:
        required.insert(0, "type")


class CatalogueModel(_Strict):
    """The base of every catalogue model (server events and client
    messages): strict, no undeclared fields, frozen, ``type`` required in
    its JSON Schema."""

    model_config = ConfigDict(json_schema_extra=_type_required)

    type: str  # each event narrows it to its own Literal


class Envelope(CatalogueModel):
    """What the event log adds to every event it delivers (all four are
    present on an event read back from the log; none on a direct send).
    An emitter sets ``turn_id`` and ``generation``, the log ``seq`` and
    ``at``."""

    seq: int | None = Field(None, description="position in the session's log: 1, 2, 3, ...")
    turn_id: str | None = Field(None, description="the turn it concerns (null: the session's)")
    generation: int | None = Field(None, description="the session's generation it belongs to")
    at: float | None = Field(None, description="when it was logged, Unix seconds (3 decimals)")


class _Turnless(Envelope):
    turn_id: None = Field(None, description="always null: this event concerns the session, not one turn")


class StopReasonView(_Strict):
    """A turn's stop reason as sent (``turn.models.StopReason`` in JSON)."""

    kind: StopKindName
    initiator: str = Field(description='who asked, e.g. "user", "vad", "ptt", "api:<tenant>", "server"')
    at: Annotated[datetime, Field(strict=False, description="when it was asked, ISO 8601 UTC")]
    request_id: str
    detail: str | None


class TurnFields(_Strict):
    """A turn's state as clients see it (``turn.manager.turn_event``)."""

    status: TurnStatusName
    label: Literal["queued", "running", "stopping", "cancelled", "completed", "failed", "reconcile_required"] = Field(
        description='the status as shown to users: CANCEL_REQUESTED is "stopping", never "cancelled"'
    )
    stop_reason: StopReasonView | None
    error: str | None = Field(description='why it failed, e.g. "no_speech_recognized"')
    transcript: str | None = Field(description="the user's words")
    reply: str | None = Field(description="the reply as recorded (an interrupted one: the part heard)")


# -- session and voice activity -------------------------------------------------


class SessionReady(_Turnless):
    """The agent session is running: it hears the caller from now on."""

    type: Literal["session.ready"] = "session.ready"
    session_id: str


class SessionDraining(_Turnless):
    """This instance is draining (a deploy): the session may go on for
    ``left_s`` more, then it ends ``worker_shutdown``. A client can
    reconnect to another instance between turns."""

    type: Literal["session.draining"] = "session.draining"
    left_s: float = Field(description="how long the session may go on, s")
    reason: str = Field(description='why the instance drains, e.g. "SIGTERM", "admin"')


class Vad(_Turnless):
    """A decision of the barge-in detector (media.bargein.DetectorEventKind)
    or the endpointer's ``end_of_turn``."""

    type: Literal["vad"] = "vad"
    event: VadEventName


class FalseInterruption(_Turnless):
    """A sound that paused the agent was no speech: playout resumed."""

    type: Literal["false_interruption"] = "false_interruption"
    paused_ms: float = Field(description="how long playout was paused, ms (1 decimal; 0 if it was not)")
    replayed_ms: int = Field(0, description="the reply went on this far back from where it paused, ms: from the "
                             "start of the word it paused in (0: from the very frame: a pause under 120 ms, between words, or a "
                             "device still playing what it held)")


class Backchannel(_Turnless):
    """A short reply ("uh-huh") while the agent spoke: it talks on."""

    type: Literal["backchannel"] = "backchannel"
    paused_ms: float = Field(description="how long playout was paused, ms (1 decimal; 0 if it was not)")
    replayed_ms: int = Field(0, description="the reply went on this far back from where it paused, ms: from the "
                             "start of the word it paused in (0: from the very frame: a pause under 120 ms, between words, or a "
                             "device still playing what it held)")
    text: str = Field(description="what the recogniser heard (may be empty)")
    syllables: int = Field(description="syllable nuclei counted in the user's speech")


class EndOfTurn(Envelope):
    """How the end of the user's turn was decided (voice.endpointing): sent
    when a tentative end is confirmed, or taken back because the user went
    on. A speculative turn taken back ends CANCELLED, stop reason
    ``speculation_withdrawn``; none of its output is delivered."""

    type: Literal["end_of_turn"] = "end_of_turn"
    outcome: Literal["confirmed", "withdrawn"]
    by: Literal["model", "silence", "incomplete_bound", "user_went_on"] = Field(
        description='what decided: the judge said complete ("model"), the fixed silence, the longer silence '
        'after an "incomplete" verdict or a judge that did not answer, or the user speaking again ("user_went_on": withdrawn)'
    )
    speculative: bool = Field(description="its reply had started at the tentative end, held until now")
    wait_ms: float = Field(description="from the end of the user's speech to this decision, ms (1 decimal)")
    probability: float | None = Field(None, description="the judge's probability that the turn was complete, if it answered")
    judge_ms: float | None = Field(None, description="how long the judge took, ms (1 decimal), if it answered")
    words_complete: bool | None = Field(
        None, description="whether the words heard end like a finished request (None: not read, e.g. no speculative reply)"
    )


class BargeIn(_Turnless):
    """The user took the turn: the generation moved on, output was cleared.
    ``generation`` is the new one."""

    type: Literal["barge_in"] = "barge_in"
    old_turn_id: str
    old_generation: int
    initiator: BargeInInitiator
    onset_to_fence_ms: float = Field(description="speech onset to the fence moving, ms (2 decimals)")
    paused_ms: float = Field(description="how long playout had been paused before, ms (1 decimal; 0 if not)")
    cleared_ms: int = Field(description="audio dropped from the playout buffer, ms (20 ms frames)")


class StopDeferred(Envelope):
    """A barge-in during a must-complete commit: the turn is silenced now and
    stopped when the commit ends."""

    type: Literal["stop_deferred"] = "stop_deferred"
    why: Literal["must_complete"]


# -- a turn's state and output --------------------------------------------------


class TurnEvent(TurnFields, Envelope):
    """A turn changed state (every applied transition)."""

    type: Literal["turn"] = "turn"


class AgentState(Envelope):
    """What the agent is doing for a voice turn."""

    type: Literal["agent.state"] = "agent.state"
    phase: AgentPhase


class Transcript(Envelope):
    """The user's words of a turn (empty: nothing was recognised)."""

    type: Literal["transcript"] = "transcript"
    role: Literal["user"]
    text: str


class AgentDelta(Envelope):
    """A piece of the reply as the model streamed it."""

    type: Literal["agent.delta"] = "agent.delta"
    text: str


class AgentDone(Envelope):
    """The turn completed: its whole reply as recorded."""

    type: Literal["agent.done"] = "agent.done"
    text: str


class AgentRestart(Envelope):
    """The turn runs on at another worker (a drain released it, or its
    worker died and it was taken over) and its reply streams again from
    the start: discard the ``agent.delta`` text shown for it so far."""

    type: Literal["agent.restart"] = "agent.restart"
    reason: Literal["adopted", "taken_over"] = Field(
        description="adopted: released by a draining worker; taken_over: its worker stopped renewing its lease"
    )


class AgentInterrupted(Envelope):
    """How much of an interrupted reply was heard (told once per turn)."""

    type: Literal["agent.interrupted"] = "agent.interrupted"
    heard: str = Field(description="the words played before the interruption, cut to whole words")
    played_ms: int = Field(description="the reply's audio played, ms")
    reply_chars: int = Field(description="characters of the reply generated so far")


class AudioStart(Envelope):
    """A turn's audio started leaving on the wire (``turn_id`` null if the
    turn is no longer known)."""

    type: Literal["audio.start"] = "audio.start"
    sample: int = Field(description="position of its first frame in the turn's audio, 48 kHz samples")


class AudioEnd(Envelope):
    """A turn's audio stopped leaving on the wire."""

    type: Literal["audio.end"] = "audio.end"
    samples_sent: int = Field(description="samples of that turn sent in all, 48 kHz")


class Usage(Envelope):
    """One model request's usage (``turn.models.UsageRecord``; sent for an
    aborted request too: it is billed)."""

    type: Literal["usage"] = "usage"
    request: int = Field(description="its number in the turn, 1, 2, ...")
    prompt_tokens: int = Field(description="tokens")
    completion_tokens: int = Field(description="tokens")
    completion_tokens_after_stop: int = Field(description="of those, streamed after the stop request, tokens")
    partial: bool
    source: Literal["usage_chunk", "counted", "not_billed"]
    started_after_stop: bool
    max_tokens: int | None = Field(description="the completion cap sent, tokens (null: none)")
    after_stop: Literal["confirmed", "unconfirmed"] | None
    completion_tokens_after_stop_bound: int | None = Field(description="tokens (null: no bound known)")


#: why a recogniser failed (voice.recognition.RecognitionError.kind), or a final owed too long
RecognitionErrorKind = Literal["unreachable", "unauthorized", "dropped", "closed", "protocol", "provider", "timeout"]


class SttFailover(_Turnless):
    """The speech recogniser failed during the session, and what followed:
    the same one reconnected (what was said since its last final is sent
    again), the fallback took over, or none is left (the utterances waiting
    fail, their turns end FAILED; the next utterance tries again)."""

    type: Literal["stt.failover"] = "stt.failover"
    provider: str = Field(description='the recogniser that failed, e.g. "deepgram"')
    error: RecognitionErrorKind
    action: Literal["reconnect", "fallback", "failed"]
    fallback: str | None = Field(description="the recogniser used from now on (null: none)")
    message: str = Field(description="for humans")


#: why a speech synthesiser failed (voice.synthesis.SynthesisError.kind)
SynthesisErrorKind = Literal["unreachable", "unauthorized", "dropped", "closed", "protocol", "provider"]


class TtsFailover(_Turnless):
    """The speech synthesiser failed during a reply, and what followed: the
    same one reconnected (the clauses not yet spoken whole are sent again),
    espeak-ng took over for the rest of the reply, or none is left (the
    reply ends with the error; what was not heard is not in the history)."""

    type: Literal["tts.failover"] = "tts.failover"
    provider: str = Field(description='the synthesiser that failed, e.g. "cartesia"')
    error: SynthesisErrorKind
    action: Literal["reconnect", "fallback", "failed"]
    fallback: str | None = Field(description="the synthesiser saying the rest (null: none)")
    message: str = Field(description="for humans")


class TtsUsage(Envelope):
    """What speaking one reply cost on one synthesiser stream
    (``turn.models.SynthesisRecord``), sent as the reply's synthesis ends,
    however it ends; a reply that failed over has one per stream. With a
    stop, how the provider was told."""

    type: Literal["tts.usage"] = "tts.usage"
    provider: str = Field(description='"espeak-ng", "openai", "elevenlabs", "cartesia", "deepgram"')
    characters: int = Field(description="characters sent to it")
    characters_after_stop: int = Field(description="characters sent after the stop (0)")
    characters_unspoken_at_stop: int = Field(
        description="characters sent whose audio had not all arrived at the stop: what it may still bill")
    after_stop: Literal["confirmed", "unconfirmed"] | None = Field(
        description="with text in flight at a stop: did the provider acknowledge it (null: no such stop)")
    audio_s: float = Field(description="audio received from it, s (3 decimals)")
    cents: float = Field(description="its price by the settings, US cents (4 decimals)")
    stop_told_ms: float | None = Field(
        None, description="the stop requested to the provider told on the wire, ms (null: not stopped or nothing to tell)")
    late_audio_ms: float = Field(0.0, description="audio of this reply that arrived after its stop and was dropped, ms")


class SttUsage(_Turnless):
    """What the session's speech recognition used, per recogniser, sent as
    the session ends (each turn's share is in its record's ``usage.recognition``)."""

    type: Literal["stt.usage"] = "stt.usage"
    provider: str
    audio_s: float = Field(description="audio sent to it, s (3 decimals; a replay after a reconnect counts again)")
    connection_s: float = Field(description="how long its connections were open, s (3 decimals)")
    reported_audio_s: float = Field(description="audio it reported billing, s (0: it reports none)")
    input_tokens: int = Field(description="tokens it reported")
    output_tokens: int = Field(description="tokens it reported")
    cents: float = Field(description="its price by the settings, US cents (4 decimals)")


class ErrorEvent(Envelope):
    """Something went wrong, or a client message was refused. Logged ones
    carry the envelope; direct refusals (web.peer) carry none."""

    type: Literal["error"] = "error"
    code: ErrorCode
    message: str = Field(description="for humans")


# -- tool calls (voice.respond) and the side-effect ledger (turn.ledger) ----------


class _ToolCallEvent(Envelope):
    call_id: str = Field(description="the model's id of the call")
    name: str = Field(description="the tool's name")


class ToolStarted(_ToolCallEvent):
    """A tool call begins (its arguments validated)."""

    type: Literal["tool.started"] = "tool.started"
    #: open-ended: each tool's own arguments, already validated by its schema
    arguments: dict[str, Any]
    effect: EffectName


class ToolError(_ToolCallEvent):
    """A tool call failed, or named no known tool, or had bad arguments."""

    type: Literal["tool.error"] = "tool.error"
    error: str


class ToolNotStarted(_ToolCallEvent):
    """A tool call was not started: the turn had less time left than it needs."""

    type: Literal["tool.not_started"] = "tool.not_started"
    reason: Literal["no_budget"]
    detail: str


class ToolCancelled(_ToolCallEvent):
    """A tool call was cut off by the turn's stop."""

    type: Literal["tool.cancelled"] = "tool.cancelled"


class LedgerEvent(Envelope):
    """A side-effect ledger row changed (DESIGN.md: ledger); one subclass per status."""

    key: str = Field(description='the idempotency key, "<turn_id>:<step>" (compensation: "...:compensate")')
    step: int
    name: str = Field(description="the tool's (a queued item: its queue's) name")
    #: open-ended: the tool's own arguments, as written in the ledger
    arguments: dict[str, Any]
    effect: EffectName
    kind: Literal["effect", "compensation"]
    output: str | None = Field(description="the call's answer (text), once done")
    error: str | None


class ToolIntent(LedgerEvent):
    """The intent of a tool call was written, before the call."""

    type: Literal["tool.intent"] = "tool.intent"
    status: Literal["pending"]
    kind: Literal["effect"]


class ToolDone(LedgerEvent):
    """The effect happened (the call answered, or a lookup confirmed it)."""

    type: Literal["tool.done"] = "tool.done"
    status: Literal["done"]
    kind: Literal["effect"]


class ToolCompensated(LedgerEvent):
    """The effect was reversed by its compensation."""

    type: Literal["tool.compensated"] = "tool.compensated"
    status: Literal["compensated"]
    kind: Literal["effect"]


class ToolAbandoned(LedgerEvent):
    """Never sent, or confirmed not applied."""

    type: Literal["tool.abandoned"] = "tool.abandoned"
    status: Literal["abandoned"]
    kind: Literal["effect"]


class ToolEffectUnknown(LedgerEvent):
    """Sent, outcome unknown: reconciliation asks the external system."""

    type: Literal["tool.effect_unknown"] = "tool.effect_unknown"
    status: Literal["effect_unknown"]
    kind: Literal["effect"]


class ToolHumanRequired(LedgerEvent):
    """Reconciliation or compensation gave up: a person must decide."""

    type: Literal["tool.human_required"] = "tool.human_required"
    status: Literal["human_required"]


# -- direct sends ------------------------------------------------------------------


class Pong(CatalogueModel):
    """The answer to a client's ``ping`` (data channel, no envelope)."""

    type: Literal["pong"] = "pong"
    id: int | float | str | None = Field(description="the ping's id (null if it had none or one over 64 characters)")


class StreamStart(CatalogueModel):
    """The first message of an SSE event stream (no envelope)."""

    type: Literal["stream.start"] = "stream.start"
    session_id: str
    after_seq: int = Field(description="the cursor: events with a greater seq follow")
    resume_token: str = Field(description="resumes this stream (?resume_token=)")
    expires_in_s: int = Field(description="the token's lifetime, s")


class StreamEnd(CatalogueModel):
    """The last message of an SSE event stream the server ends (no
    envelope): every event logged before it was sent. ``shutting_down``:
    the instance is draining; resume on another with the last event's id."""

    type: Literal["stream.end"] = "stream.end"
    reason: Literal["shutting_down"]
    last_seq: int = Field(description="the seq of the last event sent (resume after it)")


class SnapshotTurn(TurnFields):
    """One turn of a resumed stream's snapshot, as stored now."""

    turn_id: str
    generation: int
    owner_lost: bool = Field(description="open, and its worker stopped heartbeating")


class Snapshot(CatalogueModel):
    """A resumed SSE stream's second message: the session's last turns as
    stored (the authority), before the events after the cursor."""

    type: Literal["snapshot"] = "snapshot"
    turns: list[SnapshotTurn]


EVENT_MODELS: tuple[type[CatalogueModel], ...] = (
    SessionReady, SessionDraining, Vad, FalseInterruption, Backchannel, EndOfTurn, BargeIn, StopDeferred,
    TurnEvent, AgentState, Transcript, AgentDelta, AgentDone, AgentRestart, AgentInterrupted, AudioStart, AudioEnd,
    Usage, SttFailover, SttUsage, TtsFailover, TtsUsage, ErrorEvent,
    ToolStarted, ToolError, ToolNotStarted, ToolCancelled,
    ToolIntent, ToolDone, ToolCompensated, ToolAbandoned, ToolEffectUnknown, ToolHumanRequired,
    Pong, StreamStart, StreamEnd, Snapshot,
)  # fmt: skip

#: every server event: a discriminated union on ``type``
Event = Annotated[Union[*EVENT_MODELS], Field(discriminator="type")]  # type: ignore[valid-type]
#: the model of each event type; the types that are logged (carry the envelope)
MODEL_OF: dict[str, type[CatalogueModel]] = {m.model_fields["type"].default: m for m in EVENT_MODELS}
LOGGED_TYPES = frozenset(t for t, m in MODEL_OF.items() if issubclass(m, Envelope))


def validate_as(models: dict[str, type[CatalogueModel]], what: str, type: str, fields: dict[str, Any]) -> CatalogueModel:
    """The model of ``models`` (type -> model) for ``type``, made from
    ``fields`` (``type`` in them is ignored); ``what`` names the kind of
    message in the error.

    Raises:
        EventMismatch: ``type`` is not in ``models``, or a field is
            missing, of the wrong type or not declared (says which).
    """
    model = models.get(type) if isinstance(type, str) else None
    if model is None:
        raise EventMismatch(str(type), [f"unknown {what} type (known: {', '.join(sorted(models))})"])
    try:
        return model.model_validate({**fields, "type": type})
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc'])) or 'event'}: {e['msg']}" for e in exc.errors()]
        raise EventMismatch(type, problems) from None


def validate_event(type: str, payload: dict[str, Any]) -> CatalogueModel:
    """The catalogue model of a server event.

    Args:
        type: the event's type.
        payload: its fields: what an emitter passes (``generation`` and
            ``turn_id`` may be among them) or what a client receives
            (:func:`turn.events.event_json`; ``type`` in it is ignored).

    Raises:
        EventMismatch: ``type`` is not in the catalogue, or a field is
            missing, of the wrong type or not declared (says which).
    """
    return validate_as(MODEL_OF, "event", type, payload)


def payload_of(event: CatalogueModel) -> dict[str, Any]:
    """What an emitter logs for ``event`` (``SessionEventLog.emit``'s
    ``**payload``): the fields it was given, in JSON form, without ``type``
    and the envelope."""
    return event.model_dump(mode="json", exclude_unset=True, exclude={*Envelope.model_fields, "type"})


def wire_of(event: CatalogueModel) -> dict[str, Any]:
    """A directly sent event as its JSON object: ``type`` and the fields it
    was given."""
    return {"type": event.type, **event.model_dump(mode="json", exclude_unset=True, exclude={"type"})}
