"""web/devices/framing.py against the firmware's binary protocol
(78/xiaozhi-esp32 docs/websocket.md section 3; big-endian as the
firmware's htons/htonl write it)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from web.devices.framing import TYPE_JSON, TYPE_OPUS, DeviceFrame, FramingError, frame, parse


def test_the_firmware_s_own_bytes_parse() -> None:
    """A version 2 message as SendAudio builds it: version 2, type 0,
    reserved 0, timestamp 1000 ms, size 3; and version 3: type 0,
    reserved 0, size 3."""
    v2 = bytes.fromhex("0002" "0000" "00000000" "000003e8" "00000003") + b"abc"
    assert parse(v2, 2) == DeviceFrame(b"abc", TYPE_OPUS, 1000)
    v3 = bytes.fromhex("00" "00" "0003") + b"abc"
    assert parse(v3, 3) == DeviceFrame(b"abc", TYPE_OPUS)
    assert parse(b"abc", 1) == DeviceFrame(b"abc")
    assert frame(b"abc", 2, timestamp_ms=1000) == v2 and frame(b"abc", 3) == v3


@given(st.binary(max_size=4000), st.sampled_from([1, 2, 3]), st.integers(0, 2**32 - 1), st.sampled_from([TYPE_OPUS, TYPE_JSON]))
def test_framing_round_trips(payload: bytes, version: int, ts: int, kind: int) -> None:
    got = parse(frame(payload, version, timestamp_ms=ts, type=kind), version)
    assert got.payload == payload
    if version == 2:
        assert (got.type, got.timestamp_ms) == (kind, ts)
    if version == 3:
        assert got.type == kind


@pytest.mark.parametrize(
    ("message", "version", "match"),
    [
        (b"\x00\x02\x00", 2, "header alone"),
        (b"\x00", 3, "header alone"),
        (bytes.fromhex("0003" "0000" "00000000" "00000000" "00000000"), 2, "says version 3"),
        (bytes.fromhex("0002" "0000" "00000000" "00000000" "00000009") + b"abc", 2, "size 9"),
        (bytes.fromhex("00" "00" "0001") + b"abc", 3, "size 1"),
        (b"abc", 4, "unknown protocol version 4"),
    ],
)
def test_malformed_messages_are_refused_by_name(message: bytes, version: int, match: str) -> None:
    with pytest.raises(FramingError, match=match):
        parse(message, version)


@given(st.binary(max_size=64), st.sampled_from([2, 3]))
def test_any_bytes_parse_or_are_refused_cleanly(message: bytes, version: int) -> None:
    try:
        parse(message, version)
    except FramingError:
        pass


def test_a_version_3_payload_over_its_size_field_is_refused() -> None:
    with pytest.raises(FramingError, match="65535"):
        frame(bytes(70_000), 3)
