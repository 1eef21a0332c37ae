"""What a client may send the server on the data channel, declared once
(issue 12, item 4): each message a strict catalogue model
(:class:`turn.event_catalogue.CatalogueModel`), :data:`ClientMessage` their
union on ``type``, :func:`validate_client_message` the check of one. The
JSON Schema of them is ``$defs.ClientMessage`` of
:func:`turn.catalogue_schema.catalogue_schema`. Imports nothing from media,
voice or web.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from turn.event_catalogue import CatalogueModel, validate_as


class PttStart(CatalogueModel):
    """Push-to-talk pressed: a committed barge-in; the user's turn begins."""

    type: Literal["ptt.start"] = "ptt.start"


class PttEnd(CatalogueModel):
    """Push-to-talk released: the user's turn ends at once."""

    type: Literal["ptt.end"] = "ptt.end"


class Ping(CatalogueModel):
    """A round-trip probe; answered by ``pong`` with the same id."""

    type: Literal["ping"] = "ping"
    id: int | float | str | None = Field(None, description="echoed back if a number or a string of at most 64 characters")


CLIENT_MODELS: tuple[type[CatalogueModel], ...] = (PttStart, PttEnd, Ping)
#: every client message: a discriminated union on ``type``
ClientMessage = Annotated[Union[*CLIENT_MODELS], Field(discriminator="type")]  # type: ignore[valid-type]
CLIENT_MODEL_OF: dict[str, type[CatalogueModel]] = {m.model_fields["type"].default: m for m in CLIENT_MODELS}


def validate_client_message(message: dict[str, Any]) -> CatalogueModel:
    """The catalogue model of a client -> server message (a JSON object).

    Raises:
        turn.event_catalogue.EventMismatch: unknown type or bad fields.
    """
    return validate_as(CLIENT_MODEL_OF, "client message", message.get("type"), message)  # type: ignore[arg-type]
