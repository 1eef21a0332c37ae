"""The JSON Schema of the event catalogue, served at
``/v1/events.schema.json``: the server events of
:mod:`turn.event_catalogue` and, under ``$defs.ClientMessage``, the client
messages of :mod:`turn.client_messages`. Imports nothing from media, voice
or web.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from turn.client_messages import ClientMessage
from turn.event_catalogue import Event

#: the JSON Schema dialect pydantic writes
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def catalogue_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the catalogue: the document
    validates one server event (:data:`turn.event_catalogue.Event`);
    ``$defs.ClientMessage`` is the union of client messages
    (:data:`turn.client_messages.ClientMessage`). Every model is under
    ``$defs`` by its class name."""
    ref = "#/$defs/{model}"
    events = TypeAdapter(Event).json_schema(ref_template=ref)
    client = TypeAdapter(ClientMessage).json_schema(ref_template=ref)
    defs = {**events.pop("$defs", {}), **client.pop("$defs", {})}
    defs["ClientMessage"] = client
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "turnkeeper events",
        "description": "Every event the server sends (data channel, SSE); $defs.ClientMessage: what a client sends.",
        **events,
        "$defs": defs,
    }
