"""The JSON messages of the xiaozhi-esp32 device socket (78/xiaozhi-esp32,
docs/websocket.md section 4), device -> server parsed into models, server
-> device built from them.

Boards in the field run many firmware releases that add fields
(``features``, ``session_id``, ``wake_word``...), so a message's unknown
fields are ignored rather than refused; its ``type`` and the fields we act
on are checked. ``mcp`` and any type we do not know are returned as
:class:`Ignored` (answered by nothing, logged once per type), as the
reference server does for messages it does not handle.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class _DeviceModel(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class AudioParams(_DeviceModel):
    """A stream's audio: Opus, ``sample_rate`` Hz, mono, ``frame_duration`` ms a packet."""

    format: Literal["opus"] = "opus"
    sample_rate: Literal[8000, 12000, 16000, 24000, 48000] = 16000
    channels: Literal[1] = 1
    frame_duration: Literal[10, 20, 40, 60] = 60


class Hello(_DeviceModel):
    """The device's first message: its protocol version and uplink audio."""

    type: Literal["hello"]
    version: Literal[1, 2, 3] = 1
    transport: Literal["websocket"] = "websocket"
    audio_params: AudioParams = Field(default_factory=AudioParams)
    features: dict[str, Any] = Field(default_factory=dict)


class Listen(_DeviceModel):
    """The microphone: ``start`` (``mode`` manual = push-to-talk, auto =
    endpointing, realtime = open microphone), ``stop``, or ``detect`` (a
    wake word, its ``text``)."""

    type: Literal["listen"]
    state: Literal["start", "stop", "detect"]
    mode: Literal["manual", "auto", "realtime"] | None = None
    text: str | None = Field(None, max_length=200)


class Abort(_DeviceModel):
    """Stop the agent's speech (the button, or a wake word during it)."""

    type: Literal["abort"]
    reason: str | None = Field(None, max_length=100)


class Ignored(_DeviceModel):
    """A message we do not act on (``mcp``, or a type we do not know)."""

    type: str


DeviceMessage = Annotated[Hello | Listen | Abort, Field(discriminator="type")]
_ADAPTER: TypeAdapter[Hello | Listen | Abort] = TypeAdapter(DeviceMessage)
_KNOWN = {"hello", "listen", "abort"}
#: a text message longer than this is refused unread, bytes
MAX_TEXT_BYTES = 16_384


class DeviceMessageError(ValueError):
    """A text message that is not a device message we can act on; the
    string says why (for the log and the connection's close reason)."""


def parse_device_message(text: str) -> Hello | Listen | Abort | Ignored:
    """One text message from a device.

    Raises:
        DeviceMessageError: longer than :data:`MAX_TEXT_BYTES`, not a JSON
            object, no string ``type``, or a known type with bad fields.
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        raise DeviceMessageError(f"text message over {MAX_TEXT_BYTES} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise DeviceMessageError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DeviceMessageError("not a JSON object")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise DeviceMessageError("no string 'type'")
    if kind not in _KNOWN:
        return Ignored(type=kind[:64])
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or kind
        raise DeviceMessageError(f"bad {kind!r} message: {where}: {first['msg']}") from None


def server_hello(session_id: str, downlink: AudioParams) -> dict[str, Any]:
    """The server's ``hello``: must say transport "websocket" (the device
    checks it and waits 10 s for it), with the session id and the downlink
    audio the server will send."""
    return {"type": "hello", "transport": "websocket", "session_id": session_id, "audio_params": downlink.model_dump()}


def stt(session_id: str, text: str) -> dict[str, Any]:
    """What the server recognised (the device shows it)."""
    return {"type": "stt", "session_id": session_id, "text": text}


def llm_emotion(session_id: str, emotion: str, text: str) -> dict[str, Any]:
    """An expression for the device's face (``emotion`` such as "happy", ``text`` an emoji)."""
    return {"type": "llm", "session_id": session_id, "emotion": emotion, "text": text}


def tts(session_id: str, state: Literal["start", "sentence_start", "stop"], text: str | None = None) -> dict[str, Any]:
    """The speaking state: ``start`` (the device stops recording and plays),
    ``sentence_start`` with the sentence's ``text`` (shown), ``stop`` (the
    end, or the answer to an ``abort``: the device goes back to idle or
    listening)."""
    out: dict[str, Any] = {"type": "tts", "session_id": session_id, "state": state}
    if text is not None:
        out["text"] = text
    return out


def alert(session_id: str, message: str, *, status: str = "error", emotion: str = "sad") -> dict[str, Any]:
    """An alert the device shows (``status`` as its title, ``message``,
    an ``emotion`` for its face): how a bad message is told to the device
    (the firmware's ``alert`` message, application.cc)."""
    return {"type": "alert", "session_id": session_id, "status": status, "message": message, "emotion": emotion}
