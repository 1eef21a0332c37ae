"""Binary framing of the xiaozhi-esp32 device socket (78/xiaozhi-esp32,
docs/websocket.md section 3, and main/protocols/websocket_protocol.cc):
each binary WebSocket message is one Opus packet, framed by the protocol
version the device announced (``Protocol-Version`` header and ``hello``):

- version 1: the raw Opus packet, no header;
- version 2: a 16-byte header ``BinaryProtocol2``: version (uint16), type
  (uint16, 0 = Opus, 1 = JSON), reserved (uint32), timestamp (uint32, ms,
  for server-side echo cancellation), payload size (uint32), then the
  payload;
- version 3: a 4-byte header ``BinaryProtocol3``: type (uint8), reserved
  (uint8), payload size (uint16), then the payload.

Integers are big-endian (the firmware's ``htons``/``htonl``). The server
frames its downlink the same way for the same version.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

#: the protocol versions the firmware speaks
VERSIONS = (1, 2, 3)
#: the ``type`` of an Opus payload (versions 2 and 3)
TYPE_OPUS = 0
#: the ``type`` of a JSON payload (version 2; the firmware sends JSON as text frames)
TYPE_JSON = 1
_V2 = struct.Struct(">HHIII")
_V3 = struct.Struct(">BBH")


class FramingError(ValueError):
    """A binary message that does not parse for its protocol version."""


@dataclass(frozen=True)
class DeviceFrame:
    """One binary message's content.

    Attributes:
        payload: the Opus packet (or JSON bytes for type 1).
        type: :data:`TYPE_OPUS` or :data:`TYPE_JSON` (version 1: always Opus).
        timestamp_ms: the device's timestamp (version 2 only; else None), ms.
    """

    payload: bytes
    type: int = TYPE_OPUS
    timestamp_ms: int | None = None


def parse(message: bytes, version: int) -> DeviceFrame:
    """Parse one binary message of protocol ``version``.

    Raises:
        FramingError: an unknown version, a header cut short, a payload size
            that disagrees with the message's length, or (version 2) a
            header whose version field is not 2.
    """
    if version == 1:
        return DeviceFrame(bytes(message))
    if version == 2:
        if len(message) < _V2.size:
            raise FramingError(f"version 2 message of {len(message)} bytes: its header alone is {_V2.size}")
        header_version, kind, _reserved, timestamp, size = _V2.unpack_from(message)
        if header_version != 2:
            raise FramingError(f"version 2 header says version {header_version}")
        payload = message[_V2.size :]
        if size != len(payload):
            raise FramingError(f"payload size {size} in the header, {len(payload)} bytes follow")
        return DeviceFrame(bytes(payload), kind, timestamp)
    if version == 3:
        if len(message) < _V3.size:
            raise FramingError(f"version 3 message of {len(message)} bytes: its header alone is {_V3.size}")
        kind, _reserved, size = _V3.unpack_from(message)
        payload = message[_V3.size :]
        if size != len(payload):
            raise FramingError(f"payload size {size} in the header, {len(payload)} bytes follow")
        return DeviceFrame(bytes(payload), kind)
    raise FramingError(f"unknown protocol version {version} (one of {VERSIONS})")


def frame(payload: bytes, version: int, *, timestamp_ms: int = 0, type: int = TYPE_OPUS) -> bytes:
    """One binary message of protocol ``version`` carrying ``payload``.

    Raises:
        FramingError: an unknown version, or a payload too long for the
            header's size field (version 3: 65,535 bytes).
    """
    if version == 1:
        return bytes(payload)
    if version == 2:
        return _V2.pack(2, type, 0, timestamp_ms & 0xFFFFFFFF, len(payload)) + payload
    if version == 3:
        if len(payload) > 0xFFFF:
            raise FramingError(f"a version 3 payload is at most 65535 bytes, not {len(payload)}")
        return _V3.pack(type, 0, len(payload)) + payload
    raise FramingError(f"unknown protocol version {version} (one of {VERSIONS})")
