"""What a simulated phone provider says on the media-stream WebSocket, per
provider ("dialect"), and how it reads what the agent server sends back.

Twilio Media Streams (docs: "Media Streams - WebSocket Messages",
twilio.com/docs/voice/media-streams/websocket-messages), bidirectional
``<Connect><Stream>``:

- provider -> server: ``connected`` {protocol "Call", version "1.0.0"};
  ``start`` {sequenceNumber "1", start {accountSid, streamSid, callSid,
  tracks ["inbound"], customParameters, mediaFormat {encoding
  "audio/x-mulaw", sampleRate 8000, channels 1}}, streamSid}; ``media``
  {sequenceNumber, media {track "inbound", chunk (from "1"), timestamp (ms
  from the start of the stream), payload (base64 mu-law)}, streamSid};
  ``dtmf`` {dtmf {track "inbound_track", digit}}; ``mark`` {mark {name}}
  (the echo); ``stop`` {stop {accountSid, callSid}}. Every message but
  ``connected`` carries ``sequenceNumber`` (a string counting from "1")
  and ``streamSid``.
- server -> provider: ``media`` {streamSid, media {payload}}, ``mark``
  {streamSid, mark {name}}, ``clear`` {streamSid}.

Telnyx media streaming over WebSockets (developers.telnyx.com, "Media
Streaming", bidirectional ``stream_bidirectional_mode: rtp``): the same
events with snake_case fields: ``connected`` {version}; ``start``
{sequence_number, start {user_id, call_control_id, call_session_id, from,
to, client_state, custom_parameters, media_format {encoding "PCMU",
sample_rate 8000, channels 1}}, stream_id}; ``media`` {sequence_number,
media {track, chunk, timestamp, payload}, stream_id}; ``dtmf``
{occurred_at, dtmf {digit}}; ``mark``; ``stop`` {stop {user_id,
call_control_id}}. Telnyx does not guarantee frame order ("use
media.chunk, media.timestamp and sequence_number to order frames"), which
the simulator can reproduce. The server sends ``media`` {media {payload}},
``mark`` {mark {name}} and ``clear``; a ``stream_id`` on them is optional.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol


class ProtocolViolation(ValueError):
    """The server sent something the provider's protocol does not allow
    (not JSON, an unknown event, a bad payload, another stream's id)."""


@dataclass(frozen=True)
class ServerMedia:
    """Audio to play: mu-law 8 kHz bytes, decoded from base64."""

    payload: bytes


@dataclass(frozen=True)
class ServerMark:
    """A mark to echo once the audio queued before it has played."""

    name: str


@dataclass(frozen=True)
class ServerClear:
    """Drop every buffered sample; echo the pending marks."""


ServerMessage = ServerMedia | ServerMark | ServerClear


def _new_sid(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class Dialect(Protocol):
    """One provider's message shapes. ``stream_id`` identifies the stream
    (Twilio's streamSid, Telnyx's stream_id); ``call_id`` the call."""

    name: str
    path: str
    stream_id: str
    call_id: str

    def connected(self) -> dict[str, Any]: ...
    def start(self, custom_parameters: dict[str, str]) -> dict[str, Any]: ...
    def media(self, chunk: int, timestamp_ms: int, payload: bytes) -> dict[str, Any]: ...
    def dtmf(self, digit: str) -> dict[str, Any]: ...
    def mark(self, name: str) -> dict[str, Any]: ...
    def stop(self) -> dict[str, Any]: ...
    def parse(self, message: Any) -> ServerMessage: ...


def _b64(payload: bytes) -> str:
    return base64.b64encode(payload).decode("ascii")


def _payload(media: Any) -> bytes:
    if not isinstance(media, dict) or not isinstance(media.get("payload"), str):
        raise ProtocolViolation("media without a media.payload string")
    try:
        return base64.b64decode(media["payload"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolViolation(f"media.payload is not base64: {exc}") from exc


def _mark_name(mark: Any) -> str:
    if not isinstance(mark, dict) or not isinstance(mark.get("name"), str):
        raise ProtocolViolation("mark without a mark.name string")
    return mark["name"]


class _Sequenced:
    def __init__(self) -> None:
        self._seq = 0

    def next_seq(self) -> str:
        """The next sequence number, as the providers send it (a string, from "1")."""
        self._seq += 1
        return str(self._seq)


class TwilioDialect(_Sequenced):
    """Twilio Media Streams, bidirectional (see the module docstring).

    Args:
        stream_sid / call_sid / account_sid: ids (fresh ``MZ``/``CA``/``AC``
            ones by default).
    """

    name = "twilio"
    path = "/v1/telephony/twilio"

    def __init__(self, stream_sid: str | None = None, call_sid: str | None = None, account_sid: str | None = None) -> None:
        super().__init__()
        self.stream_id = stream_sid or _new_sid("MZ")
        self.call_id = call_sid or _new_sid("CA")
        self.account_sid = account_sid or _new_sid("AC")

    def connected(self) -> dict[str, Any]:
        return {"event": "connected", "protocol": "Call", "version": "1.0.0"}

    def start(self, custom_parameters: dict[str, str]) -> dict[str, Any]:
        return {
            "event": "start",
            "sequenceNumber": self.next_seq(),
            "start": {
                "accountSid": self.account_sid,
                "streamSid": self.stream_id,
                "callSid": self.call_id,
                "tracks": ["inbound"],
                "customParameters": dict(custom_parameters),
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            },
            "streamSid": self.stream_id,
        }

    def media(self, chunk: int, timestamp_ms: int, payload: bytes) -> dict[str, Any]:
        return {
            "event": "media",
            "sequenceNumber": self.next_seq(),
            "media": {"track": "inbound", "chunk": str(chunk), "timestamp": str(timestamp_ms), "payload": _b64(payload)},
            "streamSid": self.stream_id,
        }

    def dtmf(self, digit: str) -> dict[str, Any]:
        return {
            "event": "dtmf",
            "streamSid": self.stream_id,
            "sequenceNumber": self.next_seq(),
            "dtmf": {"track": "inbound_track", "digit": digit},
        }

    def mark(self, name: str) -> dict[str, Any]:
        return {"event": "mark", "sequenceNumber": self.next_seq(), "streamSid": self.stream_id, "mark": {"name": name}}

    def stop(self) -> dict[str, Any]:
        return {
            "event": "stop",
            "sequenceNumber": self.next_seq(),
            "stop": {"accountSid": self.account_sid, "callSid": self.call_id},
            "streamSid": self.stream_id,
        }

    def parse(self, message: Any) -> ServerMessage:
        """Read one server message (parsed JSON).

        Raises:
            ProtocolViolation: not an object, an unknown event, a missing
                or foreign ``streamSid``, a bad payload or mark.
        """
        if not isinstance(message, dict):
            raise ProtocolViolation(f"not a JSON object: {message!r:.80}")
        event = message.get("event")
        if event not in ("media", "mark", "clear"):
            raise ProtocolViolation(f"unknown event {event!r}")
        if message.get("streamSid") != self.stream_id:
            raise ProtocolViolation(f"{event} for streamSid {message.get('streamSid')!r}, not {self.stream_id!r}")
        if event == "media":
            return ServerMedia(_payload(message.get("media")))
        if event == "mark":
            return ServerMark(_mark_name(message.get("mark")))
        return ServerClear()


class TelnyxDialect(_Sequenced):
    """Telnyx media streaming, bidirectional RTP mode (see the module
    docstring). Custom parameters go in ``start.custom_parameters``.

    Args:
        stream_id / call_control_id: ids (fresh ones by default).
    """

    name = "telnyx"
    path = "/v1/telephony/telnyx"

    def __init__(self, stream_id: str | None = None, call_control_id: str | None = None) -> None:
        super().__init__()
        self.stream_id = stream_id or str(uuid.uuid4())
        self.call_id = call_control_id or "v3:" + uuid.uuid4().hex
        self.user_id = str(uuid.uuid4())
        self.call_session_id = str(uuid.uuid4())

    def connected(self) -> dict[str, Any]:
        return {"event": "connected", "version": "1.0.0"}

    def start(self, custom_parameters: dict[str, str]) -> dict[str, Any]:
        return {
            "event": "start",
            "sequence_number": self.next_seq(),
            "start": {
                "user_id": self.user_id,
                "call_control_id": self.call_id,
                "call_session_id": self.call_session_id,
                "from": "+15550100001",
                "to": "+15550100002",
                "custom_parameters": dict(custom_parameters),
                "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1},
            },
            "stream_id": self.stream_id,
        }

    def media(self, chunk: int, timestamp_ms: int, payload: bytes) -> dict[str, Any]:
        return {
            "event": "media",
            "sequence_number": self.next_seq(),
            "media": {"track": "inbound", "chunk": str(chunk), "timestamp": str(timestamp_ms), "payload": _b64(payload)},
            "stream_id": self.stream_id,
        }

    def dtmf(self, digit: str) -> dict[str, Any]:
        return {
            "event": "dtmf",
            "stream_id": self.stream_id,
            "occurred_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            "sequence_number": self.next_seq(),
            "dtmf": {"digit": digit},
        }

    def mark(self, name: str) -> dict[str, Any]:
        return {"event": "mark", "sequence_number": self.next_seq(), "stream_id": self.stream_id, "mark": {"name": name}}

    def stop(self) -> dict[str, Any]:
        return {
            "event": "stop",
            "sequence_number": self.next_seq(),
            "stop": {"user_id": self.user_id, "call_control_id": self.call_id},
            "stream_id": self.stream_id,
        }

    def parse(self, message: Any) -> ServerMessage:
        """Read one server message (parsed JSON).

        Raises:
            ProtocolViolation: not an object, an unknown event, a foreign
                ``stream_id``, a bad payload or mark.
        """
        if not isinstance(message, dict):
            raise ProtocolViolation(f"not a JSON object: {message!r:.80}")
        event = message.get("event")
        if event not in ("media", "mark", "clear"):
            raise ProtocolViolation(f"unknown event {event!r}")
        if "stream_id" in message and message["stream_id"] != self.stream_id:
            raise ProtocolViolation(f"{event} for stream_id {message['stream_id']!r}, not {self.stream_id!r}")
        if event == "media":
            return ServerMedia(_payload(message.get("media")))
        if event == "mark":
            return ServerMark(_mark_name(message.get("mark")))
        return ServerClear()


def dialect(name: str) -> Dialect:
    """A fresh dialect by provider name (``twilio`` or ``telnyx``).

    Raises:
        ValueError: another name.
    """
    if name == "twilio":
        return TwilioDialect()
    if name == "telnyx":
        return TelnyxDialect()
    raise ValueError(f"unknown phone provider {name!r} (twilio or telnyx)")
