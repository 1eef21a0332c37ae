"""The event catalogue: every type accepts what its emitter sends and
refuses what it does not, its JSON Schema says the same, and its literals
follow the enums they copy."""

from __future__ import annotations

import logging
import typing
from datetime import UTC, datetime
from typing import Any

import jsonschema
import pytest

from clock import SystemClock
from media.bargein import DetectorEventKind
from turn import event_catalogue as cat
from turn.catalogue_schema import catalogue_schema
from turn.client_messages import validate_client_message
from turn.conformance import Conformance
from turn.delivery_gate import OUTPUT_TYPES
from turn.event_catalogue import EventMismatch, validate_event
from turn.events import SessionEventLog, event_json
from turn.intents import IntentStatus
from turn.ledger import LEDGER_EVENTS
from turn.models import EventRecord, Session, StopReason, StopReasonKind, TurnStatus, UsageRecord
from voice.tools import Effect

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
REASON = StopReason(kind=StopReasonKind.BARGE_IN, initiator="vad", at=NOW).model_dump(mode="json")
TURN = {"status": "CANCELLED", "label": "cancelled", "stop_reason": REASON, "error": None, "transcript": "hi", "reply": None}
CALL = {"call_id": "c1", "name": "get_weather"}
LEDGER = {"key": "t1:1", "step": 1, "name": "order_coffee", "arguments": {"size": "large"}, "effect": "compensate",
          "kind": "effect", "output": None, "error": None}

#: one payload per type, as its emitter sends it (envelope fields included
#: where the emitter passes them to SessionEventLog.emit)
SAMPLES: dict[str, dict[str, Any]] = {
    "session.ready": {"generation": 0, "session_id": "s1"},
    "session.draining": {"generation": 3, "left_s": 19.5, "reason": "SIGTERM"},
    "vad": {"generation": 0, "event": "speech_started"},
    "false_interruption": {"generation": 1, "paused_ms": 420.5},
    "backchannel": {"generation": 1, "paused_ms": 0, "text": "uh huh", "syllables": 2},
    "end_of_turn": {"generation": 1, "turn_id": "t1", "outcome": "confirmed", "by": "model", "speculative": True,
                    "wait_ms": 231.4, "probability": 0.93, "judge_ms": 61.2, "words_complete": True},
    "barge_in": {"generation": 2, "old_turn_id": "t1", "old_generation": 1, "initiator": "vad",
                 "onset_to_fence_ms": 3.25, "paused_ms": 150.0, "cleared_ms": 2400},
    "stop_deferred": {"generation": 1, "turn_id": "t1", "why": "must_complete"},
    "turn": {"generation": 1, "turn_id": "t1", **TURN},
    "agent.state": {"generation": 1, "turn_id": "t1", "phase": "thinking"},
    "transcript": {"generation": 1, "turn_id": "t1", "role": "user", "text": ""},
    "agent.delta": {"generation": 1, "turn_id": "t1", "text": "It is "},
    "agent.done": {"generation": 1, "turn_id": "t1", "text": "It is sunny."},
    "agent.interrupted": {"generation": 1, "turn_id": "t1", "heard": "It is", "played_ms": 480, "reply_chars": 12},
    "agent.restart": {"generation": 1, "turn_id": "t1", "reason": "taken_over"},
    "audio.start": {"generation": 1, "turn_id": None, "sample": 0},
    "audio.end": {"generation": 1, "turn_id": "t1", "samples_sent": 96_000},
    "usage": {"generation": 1, "turn_id": "t1", **UsageRecord(request=1, prompt_tokens=30, completion_tokens=4).model_dump()},
    "stt.failover": {"generation": 2, "provider": "deepgram", "error": "dropped", "action": "fallback", "fallback": "pocketsphinx",
                     "message": "deepgram: connection reset"},
    "stt.usage": {"generation": 3, "provider": "deepgram", "audio_s": 12.48, "connection_s": 95.2, "reported_audio_s": 12.5,
                  "input_tokens": 0, "output_tokens": 0, "cents": 0.1602},
    "tts.failover": {"generation": 2, "provider": "cartesia", "error": "dropped", "action": "fallback", "fallback": "espeak-ng",
                     "message": "cartesia: connection reset"},
    "tts.usage": {"generation": 1, "turn_id": "t1", "provider": "elevenlabs", "characters": 84, "characters_after_stop": 0,
                  "characters_unspoken_at_stop": 31, "after_stop": "unconfirmed", "audio_s": 2.64, "cents": 0.0252,
                  "stop_told_ms": 0.41, "late_audio_ms": 180.0},
    "error": {"code": "ptt_not_active", "message": "ptt.end without ptt.start"},
    "tool.started": {"generation": 1, "turn_id": "t1", **CALL, "arguments": {"city": "Paris"}, "effect": "none"},
    "tool.error": {"generation": 1, "turn_id": "t1", **CALL, "error": "unknown tool"},
    "tool.not_started": {"generation": 1, "turn_id": "t1", **CALL, "reason": "no_budget", "detail": "tool expects 900 ms, 10 ms left"},
    "tool.cancelled": {"generation": 1, "turn_id": "t1", **CALL},
    "tool.intent": {"generation": 1, "turn_id": "t1", **LEDGER, "status": "pending"},
    "tool.done": {"generation": 1, "turn_id": "t1", **LEDGER, "status": "done", "output": "ordered"},
    "tool.compensated": {"generation": 1, "turn_id": "t1", **LEDGER, "status": "compensated"},
    "tool.abandoned": {"generation": 1, "turn_id": "t1", **LEDGER, "status": "abandoned"},
    "tool.effect_unknown": {"generation": 1, "turn_id": "t1", **LEDGER, "status": "effect_unknown", "error": "timeout"},
    "tool.human_required": {"generation": 1, "turn_id": "t1", **LEDGER, "status": "human_required", "kind": "compensation"},
    "pong": {"id": 3},
    "stream.start": {"session_id": "s1", "after_seq": 0, "resume_token": "tok", "expires_in_s": 3600},
    "stream.end": {"reason": "shutting_down", "last_seq": 41},
    "snapshot": {"turns": [{"turn_id": "t1", "generation": 1, **TURN, "owner_lost": False}]},
}

SCHEMA = catalogue_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def test_every_type_has_a_sample() -> None:
    assert set(SAMPLES) == set(cat.MODEL_OF)


@pytest.mark.parametrize("type", sorted(SAMPLES))
def test_what_the_emitter_sends_validates(type: str) -> None:
    event = validate_event(type, SAMPLES[type])
    assert event.type == type
    assert not list(VALIDATOR.iter_errors({"type": type, **SAMPLES[type]}))


@pytest.mark.parametrize("type", sorted(cat.LOGGED_TYPES))
def test_what_a_follower_delivers_validates(type: str) -> None:
    payload = {k: v for k, v in SAMPLES[type].items() if k not in ("generation", "turn_id")}
    record = EventRecord(session_id="s", seq=4, turn_id=SAMPLES[type].get("turn_id"), generation=1, type=type, at=NOW, payload=payload)
    out = event_json(record)
    validate_event(type, out)
    assert not list(VALIDATOR.iter_errors(out))


def _bad_variants(type: str) -> list[tuple[str, dict[str, Any]]]:
    """(the field that is wrong, the payload): an undeclared field, each
    required field missing, each field of the wrong JSON type."""
    sample = SAMPLES[type]
    model = cat.MODEL_OF[type]
    out = [("bogus", {**sample, "bogus": 1})]
    for name, field in model.model_fields.items():
        if name == "type":
            continue
        if field.is_required():
            out.append((name, {k: v for k, v in sample.items() if k != name}))
        out.append((name, {**sample, name: {"not": "this"}} if name != "arguments" else {**sample, name: ["a list"]}))
    return out


@pytest.mark.parametrize("type", sorted(SAMPLES))
def test_bad_fields_are_refused_and_named(type: str) -> None:
    variants = _bad_variants(type)
    assert len(variants) >= 2
    for name, payload in variants:
        with pytest.raises(EventMismatch) as err:
            validate_event(type, payload)
        assert err.value.type == type and name in str(err.value), (name, str(err.value))
        assert list(VALIDATOR.iter_errors({"type": type, **payload})), f"the JSON Schema accepts {type} with a bad {name}"


def test_strict_types() -> None:
    with pytest.raises(EventMismatch, match="sample"):
        validate_event("audio.start", {"generation": 1, "sample": "0"})
    with pytest.raises(EventMismatch, match="turn_id"):
        validate_event("barge_in", {**SAMPLES["barge_in"], "turn_id": "t1"})  # a barge-in names old_turn_id, never turn_id
    with pytest.raises(EventMismatch, match="status"):
        validate_event("tool.done", {**SAMPLES["tool.done"], "status": "pending"})
    with pytest.raises(EventMismatch, match="code"):
        validate_event("error", {"code": "no_such_code", "message": "x"})


def test_unknown_type() -> None:
    with pytest.raises(EventMismatch, match="unknown event type") as err:
        validate_event("agent.deltas", {"text": "x"})
    assert err.value.type == "agent.deltas"
    assert list(VALIDATOR.iter_errors({"type": "agent.deltas", "text": "x"}))


def test_client_messages() -> None:
    assert validate_client_message({"type": "ptt.start"}).type == "ptt.start"
    assert validate_client_message({"type": "ptt.end"}).type == "ptt.end"
    assert validate_client_message({"type": "ping", "id": 7}).type == "ping"
    with pytest.raises(EventMismatch, match="unknown client message type"):
        validate_client_message({"type": "ptt.stop"})
    with pytest.raises(EventMismatch, match="extra"):
        validate_client_message({"type": "ptt.start", "extra": True})
    client = jsonschema.Draft202012Validator({**SCHEMA, **SCHEMA["$defs"]["ClientMessage"]})
    assert not list(client.iter_errors({"type": "ping", "id": "a"}))
    assert list(client.iter_errors({"type": "ptt.stop"}))


def test_schema_is_json_schema_and_lists_every_type() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(SCHEMA["discriminator"]["mapping"]) == set(cat.MODEL_OF)
    assert len(SCHEMA["oneOf"]) == len(cat.MODEL_OF)
    for ref in SCHEMA["oneOf"]:
        model = SCHEMA["$defs"][ref["$ref"].rsplit("/", 1)[1]]
        assert model["required"][0] == "type" and model["additionalProperties"] is False
    assert set(SCHEMA["$defs"]["ClientMessage"]["discriminator"]["mapping"]) == {"ptt.start", "ptt.end", "ping"}


def _literal(alias: Any) -> set[str]:
    return set(typing.get_args(alias))


def test_literals_follow_the_enums_they_copy() -> None:
    assert _literal(cat.TurnStatusName) == {s.value for s in TurnStatus}
    assert _literal(cat.StopKindName) == {k.value for k in StopReasonKind}
    assert _literal(cat.TurnFields.model_fields["label"].annotation) == {s.label for s in TurnStatus}
    # every detector decision is announced but a trial pause's verification (internal to playout)
    announced = {k.value for k in DetectorEventKind if k is not DetectorEventKind.SPEECH_VERIFIED}
    assert _literal(cat.Vad.model_fields["event"].annotation) == announced | {"end_of_turn"}
    assert _literal(cat.EffectName) == _literal(Effect)
    ledger = {m.model_fields["status"].annotation for m in cat.EVENT_MODELS if issubclass(m, cat.LedgerEvent)}
    statuses = set().union(*(_literal(a) for a in ledger))
    assert statuses == {s.value for s in IntentStatus} - {"retrying"}  # only compensation jobs retry, never told
    assert {m.model_fields["status"].annotation for m in LEDGER_EVENTS.values()} == ledger  # the ledger tells each one
    payload = set(cat.Usage.model_fields) - set(cat.Envelope.model_fields) - {"type"}
    assert payload == set(UsageRecord.model_fields)
    # tool.output is an output type nothing emits (reported in issue 12)
    assert OUTPUT_TYPES - {"tool.output"} <= cat.LOGGED_TYPES


@pytest.fixture
async def session(store):
    await store.create_session(Session(id="s", created_at=NOW))
    return store


async def test_emit_event_logs_what_emit_would(session) -> None:
    log = SessionEventLog(session, "s", SystemClock())
    log.emit("agent.delta", generation=1, turn_id="t1", text="a")
    log.emit_event(cat.AgentDelta(generation=1, turn_id="t1", text="a"))
    log.emit("backchannel", generation=1, paused_ms=0, text="mhm", syllables=1)
    log.emit_event(cat.Backchannel(generation=1, paused_ms=0, text="mhm", syllables=1))
    log.emit_event(cat.AgentDelta(generation=1, turn_id="t1", text="b"), withheld=True)
    assert await log.flush()
    a, b, c, d, e = await session.read_events("s")
    assert (a.type, a.turn_id, a.generation, a.payload) == (b.type, b.turn_id, b.generation, b.payload)
    assert (c.type, c.turn_id, c.generation, c.payload) == (d.type, d.turn_id, d.generation, d.payload)
    assert e.fenced and not a.fenced
    with pytest.raises(ValueError, match="generation"):
        log.emit_event(cat.AgentDelta(turn_id="t1", text="x"))
    await log.aclose()


async def test_production_logs_a_mismatch_once_and_counts_it(session, monkeypatch, caplog) -> None:
    check = Conformance(strict=False)
    monkeypatch.setattr("turn.events.CONFORMANCE", check)
    log = SessionEventLog(session, "s", SystemClock())
    with caplog.at_level(logging.ERROR, logger="turn.conformance"):
        log.emit("vad", generation=0, event="speech_maybe")
        log.emit("vad", generation=0, event="speech_maybe")
        log.emit("agent.delta", generation=1, turn_id="t1", text="fine")
    assert await log.flush()
    assert [e.type for e in await session.read_events("s")] == ["vad", "vad", "agent.delta"]  # logged anyway
    assert check.mismatches == {"vad": 2} and check.seen == []
    [record] = caplog.records  # once per type
    assert "'vad'" in record.getMessage() and "event" in record.getMessage()
    await log.aclose()


def test_strict_raises_and_remembers() -> None:
    check = Conformance(strict=True)
    assert check.check("agent.delta", {"generation": 1, "text": "ok"})
    with pytest.raises(EventMismatch, match="text"):
        check.check("agent.delta", {"generation": 1, "text": 5})
    assert check.mismatches["agent.delta"] == 1 and len(check.seen) == 1
