"""web/devices/messages.py against the firmware's messages (78/xiaozhi-esp32
docs/websocket.md section 4): what a board sends parses, extra fields of
newer firmware are ignored, bad ones are refused by name."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from web.devices.messages import (
    MAX_TEXT_BYTES,
    Abort,
    AudioParams,
    DeviceMessageError,
    Hello,
    Ignored,
    Listen,
    parse_device_message,
    server_hello,
    tts,
)


def test_the_documented_messages_parse() -> None:
    hello = parse_device_message(json.dumps({
        "type": "hello", "version": 1, "features": {"mcp": True}, "transport": "websocket",
        "audio_params": {"format": "opus", "sample_rate": 16000, "channels": 1, "frame_duration": 60},
    }))
    assert isinstance(hello, Hello) and hello.version == 1 and hello.audio_params.frame_duration == 60
    listen = parse_device_message('{"session_id": "xxx", "type": "listen", "state": "start", "mode": "manual"}')
    assert listen == Listen(type="listen", state="start", mode="manual")
    detect = parse_device_message('{"session_id": "xxx", "type": "listen", "state": "detect", "text": "Hello Xiao Ming"}')
    assert isinstance(detect, Listen) and detect.text == "Hello Xiao Ming"
    abort = parse_device_message('{"session_id": "xxx", "type": "abort", "reason": "wake_word_detected"}')
    assert abort == Abort(type="abort", reason="wake_word_detected")
    mcp = parse_device_message('{"session_id": "xxx", "type": "mcp", "payload": {"jsonrpc": "2.0", "id": 1, "result": {}}}')
    assert mcp == Ignored(type="mcp")


def test_the_server_hello_is_what_the_device_checks() -> None:
    msg = server_hello("s1", AudioParams(sample_rate=24000))
    assert msg["type"] == "hello" and msg["transport"] == "websocket" and msg["session_id"] == "s1"
    assert msg["audio_params"] == {"format": "opus", "sample_rate": 24000, "channels": 1, "frame_duration": 60}
    assert tts("s1", "sentence_start", "Hi.") == {"type": "tts", "session_id": "s1", "state": "sentence_start", "text": "Hi."}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"state": "start"}', "no string 'type'"),
        ('{"type": 7}', "no string 'type'"),
        ('{"type": "listen", "state": "pause"}', "bad 'listen' message: state"),
        ('{"type": "listen"}', "bad 'listen' message: state"),
        ('{"type": "hello", "version": 9}', "bad 'hello' message: version"),
        ('{"type": "hello", "audio_params": {"format": "pcm"}}', "bad 'hello' message: audio_params.format"),
        ('{"type": "hello", "transport": "udp"}', "bad 'hello' message: transport"),
        ('{"type": "abort", "reason": "' + "x" * 500 + '"}', "bad 'abort' message: reason"),
        ("[" * 100_000, "over"),
        ('{"type": "listen", "state": "start", "pad": "' + "x" * MAX_TEXT_BYTES + '"}', "over"),
    ],
)
def test_bad_messages_are_refused_by_name(text: str, match: str) -> None:
    with pytest.raises(DeviceMessageError, match=match):
        parse_device_message(text)


@given(st.text(max_size=200))
def test_any_text_parses_or_is_refused_cleanly(text: str) -> None:
    try:
        parse_device_message(text)
    except DeviceMessageError:
        pass
