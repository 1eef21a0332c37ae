"""TwiML for the voice webhook: connect the call to our media stream
(Twilio, "TwiML Voice: <Stream>": ``<Connect><Stream url="wss://...">``
opens a *bidirectional* stream; ``<Parameter name value>`` children arrive
as ``start.customParameters``)."""

from __future__ import annotations

import xml.etree.ElementTree as ET


def connect_stream(url: str, parameters: dict[str, str]) -> str:
    """The TwiML document (UTF-8 XML text) that connects the call to the
    WebSocket ``url`` (``wss://``), passing ``parameters``.

    Raises:
        ValueError: ``url`` is not a ``ws://`` or ``wss://`` URL.
    """
    if not url.startswith(("wss://", "ws://")):
        raise ValueError(f"a stream URL is ws:// or wss://, got {url[:40]!r}")
    response = ET.Element("Response")
    stream = ET.SubElement(ET.SubElement(response, "Connect"), "Stream", url=url)
    for name, value in parameters.items():
        ET.SubElement(stream, "Parameter", name=name, value=value)
    return '<?xml version="1.0" encoding="UTF-8"?>' + ET.tostring(response, encoding="unicode")
