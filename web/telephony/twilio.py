"""Twilio Media Streams, bidirectional (``<Connect><Stream>``): the JSON of
Twilio's "Media Streams - WebSocket Messages".

From Twilio: ``connected``, ``start`` (``streamSid``, ``start.callSid``,
``start.tracks``, ``start.customParameters``, ``start.mediaFormat``),
``media`` (``media.payload``, ``media.track``, ``media.chunk``,
``media.timestamp``), ``dtmf`` (``dtmf.digit``), ``mark`` (``mark.name``),
``stop``. To Twilio: ``media`` (``media.payload``: base64 mu-law 8 kHz),
``mark`` (``mark.name``), ``clear``; each with ``streamSid``.
"""

from __future__ import annotations

from typing import Any

from web.telephony.dialect import (
    DTMF_DIGITS,
    Connected,
    Dtmf,
    Inbound,
    Mark,
    Media,
    ProtocolError,
    Start,
    Stop,
    b64,
    number,
    payload_of,
    section,
    text,
)

#: the only audio a bidirectional stream carries (Twilio: mediaFormat)
MULAW_ENCODING = "audio/x-mulaw"


class TwilioDialect:
    """Twilio Media Streams' messages (see the module doc)."""

    name = "twilio"
    reorders = False

    def parse(self, message: dict[str, Any]) -> Inbound:
        """One message from Twilio as a typed event.

        Raises:
            web.telephony.dialect.ProtocolError: see :meth:`web.telephony.dialect.Dialect.parse`;
                a ``start`` whose mediaFormat is not mu-law 8 kHz mono is fatal.
        """
        event = message["event"]
        sid = message.get("streamSid")
        stream_id = sid if isinstance(sid, str) else None
        if event == "media":
            media = section(message, "media")
            track = media.get("track", "inbound")
            if track not in ("inbound", "inbound_track"):
                raise ProtocolError("bad_field", f"media of track {str(track)[:20]!r}: only the caller's is read")
            return Media(payload_of(media), number(media, "chunk"), stream_id)
        if event == "mark":
            return Mark(text(section(message, "mark"), "name"), stream_id)
        if event == "dtmf":
            digit = text(section(message, "dtmf"), "digit", max_len=1)
            if digit not in DTMF_DIGITS:
                raise ProtocolError("bad_field", f"dtmf digit {digit!r} is not a telephone key")
            return Dtmf(digit, stream_id)
        if event == "start":
            start = section(message, "start")
            sid = text(start, "streamSid", required=False) or (stream_id or "")
            if not sid:
                raise ProtocolError("bad_field", "start without a streamSid", fatal=True)
            fmt = start.get("mediaFormat") or {}
            if not isinstance(fmt, dict):
                raise ProtocolError("bad_field", "start: mediaFormat must be an object", fatal=True)
            encoding = str(fmt.get("encoding", MULAW_ENCODING))
            rate = number(fmt, "sampleRate", 8000)
            if encoding != MULAW_ENCODING or rate != 8000 or number(fmt, "channels", 1) != 1:
                raise ProtocolError(
                    "unsupported_format", f"media format {encoding} at {rate} Hz: only mu-law 8 kHz mono", fatal=True
                )
            params = start.get("customParameters") or {}
            if not isinstance(params, dict):
                raise ProtocolError("bad_field", "start: customParameters must be an object", fatal=True)
            return Start(
                stream_id=sid,
                call_id=text(start, "callSid", required=False),
                parameters={str(k)[:64]: str(v)[:1024] for k, v in list(params.items())[:32]},
                encoding=encoding,
                sample_rate=rate,
            )
        if event == "connected":
            return Connected()
        if event == "stop":
            return Stop(stream_id)
        raise ProtocolError("unknown_event", f"unknown event {event[:40]!r}")

    def media(self, stream_id: str, payload: bytes) -> dict[str, Any]:
        """``{"event": "media", "streamSid", "media": {"payload"}}``."""
        return {"event": "media", "streamSid": stream_id, "media": {"payload": b64(payload)}}

    def mark(self, stream_id: str, name: str) -> dict[str, Any]:
        """``{"event": "mark", "streamSid", "mark": {"name"}}``."""
        return {"event": "mark", "streamSid": stream_id, "mark": {"name": name}}

    def clear(self, stream_id: str) -> dict[str, Any]:
        """``{"event": "clear", "streamSid"}``."""
        return {"event": "clear", "streamSid": stream_id}
