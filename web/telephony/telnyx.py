"""Telnyx media streaming over WebSocket, bidirectional RTP mode (Telnyx,
"Stream call media over WebSocket"): the same shape as Twilio's with its
own spelling, and one difference that matters: "Media frame order is not
guaranteed", so media is put back in order by ``media.chunk`` before it is
decoded (``reorders``; :class:`media.reorder.ReorderBuffer`).

From Telnyx: ``connected``; ``start`` (``stream_id``,
``start.call_control_id``, ``start.client_state``, ``start.media_format``
with ``encoding`` ``PCMU``, ``sample_rate``, ``channels``); ``media``
(``media.payload``, ``media.track``, ``media.chunk``, ``media.timestamp``,
``sequence_number``); ``dtmf`` (``dtmf.digit``); ``mark`` (``mark.name``);
``error``; ``stop``. To Telnyx: ``media`` (``media.payload``), ``mark``,
``clear``.

The tenant travels in ``client_state`` (base64 of a JSON object with
``tenant`` and ``tenant_sig``, set by whoever started the stream with our
signature; :mod:`web.telephony.signature`).
"""

from __future__ import annotations

import base64
import binascii
import json
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

#: Telnyx's name for G.711 mu-law
PCMU = "PCMU"


def client_state_parameters(client_state: str) -> dict[str, str]:
    """The parameters carried in a ``client_state`` (base64 JSON object);
    empty if it is empty.

    Raises:
        ProtocolError: it is not base64 of a JSON object of strings (fatal:
            the call's tenant cannot be known).
    """
    if not client_state:
        return {}
    try:
        data = json.loads(base64.b64decode(client_state, validate=True))
    except (binascii.Error, ValueError, RecursionError) as exc:
        raise ProtocolError("bad_field", "start: client_state is not base64 JSON", fatal=True) from exc
    if not isinstance(data, dict):
        raise ProtocolError("bad_field", "start: client_state is not a JSON object", fatal=True)
    return {str(k)[:64]: str(v)[:1024] for k, v in list(data.items())[:32]}


def encode_client_state(parameters: dict[str, str]) -> str:
    """``parameters`` as a ``client_state`` value (what :func:`client_state_parameters` reads)."""
    return base64.b64encode(json.dumps(parameters, separators=(",", ":")).encode()).decode()


class TelnyxDialect:
    """Telnyx media streaming's messages (see the module doc)."""

    name = "telnyx"
    reorders = True

    def parse(self, message: dict[str, Any]) -> Inbound:
        """One message from Telnyx as a typed event.

        Raises:
            web.telephony.dialect.ProtocolError: see :meth:`web.telephony.dialect.Dialect.parse`;
                a ``start`` whose media_format is not PCMU 8 kHz mono is
                fatal; Telnyx's own ``error`` event is reported as
                ``provider_error``.
        """
        event = message["event"]
        sid = message.get("stream_id")
        stream_id = sid if isinstance(sid, str) else None
        if event == "media":
            media = section(message, "media")
            track = media.get("track", "inbound")
            if track not in ("inbound", "inbound_track"):
                raise ProtocolError("bad_field", f"media of track {str(track)[:20]!r}: only the caller's is read")
            seq = number(media, "chunk", number(message, "sequence_number", -1))
            if seq < 0:
                raise ProtocolError("no_sequence", "media without chunk or sequence_number cannot be put in order: dropped")
            return Media(payload_of(media), seq, stream_id)
        if event == "mark":
            return Mark(text(section(message, "mark"), "name"), stream_id)
        if event == "dtmf":
            digit = text(section(message, "dtmf"), "digit", max_len=1)
            if digit not in DTMF_DIGITS:
                raise ProtocolError("bad_field", f"dtmf digit {digit!r} is not a telephone key")
            return Dtmf(digit, stream_id)
        if event == "start":
            start = section(message, "start")
            if not stream_id:
                raise ProtocolError("bad_field", "start without a stream_id", fatal=True)
            fmt = start.get("media_format") or {}
            if not isinstance(fmt, dict):
                raise ProtocolError("bad_field", "start: media_format must be an object", fatal=True)
            encoding = str(fmt.get("encoding", PCMU))
            rate = number(fmt, "sample_rate", 8000)
            if encoding != PCMU or rate != 8000 or number(fmt, "channels", 1) != 1:
                raise ProtocolError(
                    "unsupported_format", f"media format {encoding} at {rate} Hz: only PCMU 8 kHz mono", fatal=True
                )
            return Start(
                stream_id=stream_id,
                call_id=text(start, "call_control_id", required=False),
                parameters=client_state_parameters(text(start, "client_state", required=False, max_len=4096)),
                encoding=encoding,
                sample_rate=rate,
            )
        if event == "connected":
            return Connected()
        if event == "stop":
            return Stop(stream_id)
        if event == "error":
            detail = message.get("payload")
            raise ProtocolError("provider_error", f"Telnyx reports an error: {str(detail)[:200]}")
        raise ProtocolError("unknown_event", f"unknown event {event[:40]!r}")

    def media(self, stream_id: str, payload: bytes) -> dict[str, Any]:
        """``{"event": "media", "media": {"payload"}}``."""
        return {"event": "media", "media": {"payload": b64(payload)}}

    def mark(self, stream_id: str, name: str) -> dict[str, Any]:
        """``{"event": "mark", "mark": {"name"}}``."""
        return {"event": "mark", "mark": {"name": name}}

    def clear(self, stream_id: str) -> dict[str, Any]:
        """``{"event": "clear"}``."""
        return {"event": "clear"}
