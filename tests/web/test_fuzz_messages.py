"""Telephony media-stream and device-socket messages fuzzed at their real
parsers (issue 16): malformed JSON, wrong types, huge strings, non-UTF-8.
Each input parses or is refused with the protocol's own error
(``ProtocolError``, ``DeviceMessageError``); nothing else escapes.
(tests/web/test_device_messages.py holds the device's named cases.)"""

from __future__ import annotations

import json

from fuzz_support import fuzz_settings, record
from hypothesis import given
from hypothesis import strategies as st

from web.devices.messages import DeviceMessageError, parse_device_message
from web.telephony.dialect import ProtocolError, loads
from web.telephony.telnyx import TelnyxDialect
from web.telephony.twilio import TwilioDialect

CASES = 100
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40), st.text(min_size=5000, max_size=6000))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                      max_leaves=12)
EVENTS = ["connected", "start", "media", "dtmf", "mark", "stop", "closed", "error", "x"]
KEYS = ["event", "streamSid", "stream_id", "start", "media", "payload", "track", "chunk", "timestamp", "dtmf", "digit", "mark",
        "name", "sequenceNumber", "callSid", "customParameters", "mediaFormat", "encoding", "sample_rate", "channels", "type",
        "state", "mode", "text", "reason", "version", "audio_params", "transport", "format", "frame_duration", "session_id"]
objects = st.fixed_dictionaries({"event": st.sampled_from(EVENTS)}, optional={k: values for k in KEYS if k != "event"}) | st.dictionaries(
    st.sampled_from(KEYS), values, max_size=8)
raw = st.one_of(objects.map(json.dumps), st.text(max_size=300), st.binary(max_size=300),
                objects.map(lambda o: json.dumps(o)[: len(json.dumps(o)) // 2]))


@fuzz_settings(CASES)
@given(raw)
def test_telephony_messages_parse_or_are_refused(message: str | bytes) -> None:
    for dialect in (TwilioDialect(), TelnyxDialect()):
        record(f"ws {dialect.name}")
        try:
            dialect.parse(loads(message))
        except ProtocolError:
            pass


@fuzz_settings(CASES)
@given(raw)
def test_device_messages_parse_or_are_refused(message: str | bytes) -> None:
    record("device socket")
    text = message.decode("utf-8", "surrogateescape") if isinstance(message, bytes) else message
    try:
        parse_device_message(text)
    except DeviceMessageError:
        pass
