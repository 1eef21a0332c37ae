"""What a telephony media-stream provider says and is told, independent of
its JSON spelling: the inbound events every provider sends (connected,
start, media, dtmf, mark, stop) and the outbound messages (media, mark,
clear). A dialect (:class:`Dialect`) reads and writes one provider's JSON;
Twilio (:mod:`web.telephony.twilio`) and Telnyx (:mod:`web.telephony.telnyx`)
are one small file each, and so would Plivo (``playAudio``, ``clearAudio``,
``checkpoint``/``playedStream``) or Vonage be.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from media.g711 import MULAW_FRAME_BYTES


class ProtocolError(ValueError):
    """A message that breaks the provider's protocol.

    Attributes:
        code: short machine name (``bad_json``, ``unknown_event``,
            ``bad_base64``, ``bad_payload_size``, ``stream_mismatch``,
            ``before_start``, ``bad_field``, ``unsupported_format``).
        fatal: nothing can recover from it: the socket is closed.
    """

    def __init__(self, code: str, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.fatal = fatal


@dataclass(frozen=True)
class Connected:
    """The socket is open (Twilio ``connected``)."""


@dataclass(frozen=True)
class Start:
    """The stream starts.

    Attributes:
        stream_id: the provider's id of this stream (Twilio ``streamSid``,
            Telnyx ``stream_id``); every later message must carry it.
        call_id: the call's id (Twilio ``callSid``, Telnyx ``call_control_id``).
        parameters: the custom parameters we put in the TwiML (Twilio
            ``customParameters``) or the call's ``client_state``.
        encoding: the audio's encoding as the provider names it.
        sample_rate: Hz.
    """

    stream_id: str
    call_id: str
    parameters: dict[str, str] = field(default_factory=dict)
    encoding: str = "audio/x-mulaw"
    sample_rate: int = 8000


@dataclass(frozen=True)
class Media:
    """20 ms of the caller's audio.

    Attributes:
        payload: 160 bytes of mu-law 8 kHz.
        chunk: the provider's chunk number (1 first), for ordering.
        stream_id: as given (checked by the transport against ``start``'s).
    """

    payload: bytes
    chunk: int
    stream_id: str | None


@dataclass(frozen=True)
class Dtmf:
    """A telephone key was pressed (``digit``: "0"-"9", "*", "#", "A"-"D")."""

    digit: str
    stream_id: str | None


@dataclass(frozen=True)
class Mark:
    """The provider echoes our mark ``name``: its audio played (or was cleared)."""

    name: str
    stream_id: str | None


@dataclass(frozen=True)
class Stop:
    """The stream ends (the call hung up, or the stream was stopped)."""

    stream_id: str | None


Inbound = Connected | Start | Media | Dtmf | Mark | Stop

#: DTMF keys a telephone has (RFC 4733 events 0-15)
DTMF_DIGITS = frozenset("0123456789*#ABCD")


class Dialect(Protocol):
    """One provider's JSON, both ways.

    Attributes:
        name: ``"twilio"``, ``"telnyx"`` (logs, metrics).
        reorders: its media may arrive out of order (reorder by ``chunk``).
    """

    name: str
    reorders: bool

    def parse(self, message: dict[str, Any]) -> Inbound:
        """One inbound JSON object as a typed event.

        Raises:
            ProtocolError: an unknown event, a missing or ill-typed field,
                bad base64, a payload that is not 160 bytes.
        """
        ...

    def media(self, stream_id: str, payload: bytes) -> dict[str, Any]:
        """An outbound ``media`` message (``payload``: mu-law bytes)."""
        ...

    def mark(self, stream_id: str, name: str) -> dict[str, Any]:
        """An outbound ``mark`` message."""
        ...

    def clear(self, stream_id: str) -> dict[str, Any]:
        """An outbound ``clear`` message."""
        ...


def loads(text: str | bytes) -> dict[str, Any]:
    """A WebSocket text message as a JSON object.

    Raises:
        ProtocolError: not JSON (``bad_json``), or not an object with a
            string ``event``.
    """
    try:
        msg = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("bad_json", f"message is not JSON: {str(exc)[:80]}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
        raise ProtocolError("bad_json", "message is not a JSON object with a string event")
    return msg


def dumps(message: dict[str, Any]) -> str:
    """An outbound message as compact JSON."""
    return json.dumps(message, separators=(",", ":"))


def section(message: dict[str, Any], key: str) -> dict[str, Any]:
    """``message[key]``, which must be an object.

    Raises:
        ProtocolError: it is missing or not an object (``bad_field``).
    """
    value = message.get(key)
    if not isinstance(value, dict):
        raise ProtocolError("bad_field", f"{message.get('event')}: {key!r} must be an object")
    return value


def text(obj: dict[str, Any], key: str, *, required: bool = True, max_len: int = 256) -> str:
    """``obj[key]`` as a string (numbers are accepted as their text).

    Raises:
        ProtocolError: missing (if ``required``), not a string, or too long.
    """
    value = obj.get(key)
    if value is None and not required:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ProtocolError("bad_field", f"{key!r} must be a string")
    out = str(value)
    if len(out) > max_len:
        raise ProtocolError("bad_field", f"{key!r} is longer than {max_len} characters")
    return out


def number(obj: dict[str, Any], key: str, default: int = 0) -> int:
    """``obj[key]`` as an int (providers send numbers as strings).

    Raises:
        ProtocolError: present but not an integer (``bad_field``).
    """
    value = obj.get(key)
    if value is None:
        return default
    try:
        if isinstance(value, bool):
            raise ValueError
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ProtocolError("bad_field", f"{key!r} must be an integer") from exc


def payload_of(media: dict[str, Any]) -> bytes:
    """The base64 ``payload`` of a media section: 160 bytes of mu-law.

    Raises:
        ProtocolError: missing, bad base64 (``bad_base64``), or not 160
            bytes (``bad_payload_size``).
    """
    value = media.get("payload")
    if not isinstance(value, str):
        raise ProtocolError("bad_field", "media: 'payload' must be a base64 string")
    if len(value) > 4 * MULAW_FRAME_BYTES:
        raise ProtocolError("bad_payload_size", f"media payload of {len(value)} base64 characters; 20 ms is 160 bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError("bad_base64", "media payload is not valid base64") from exc
    if len(raw) != MULAW_FRAME_BYTES:
        raise ProtocolError("bad_payload_size", f"media payload of {len(raw)} bytes; 20 ms of mu-law is 160")
    return raw


def b64(payload: bytes) -> str:
    """Bytes as base64 text."""
    return base64.b64encode(payload).decode("ascii")
