"""The agent session's settings (env ``TURNKEEPER_SESSION__*``)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from voice.backchannel import BackchannelConfig
from voice.dtmf import DtmfConfig
from voice.endpointing import EndpointConfig


class SessionConfig(BaseModel):
    """Agent session settings (env ``TURNKEEPER_SESSION__*``).

    Attributes:
        stop_grace_ms: how long a stopped turn's work may take to wind down
            before its terminal state is written anyway (ms).
        history_messages: how many past messages the model sees at most
            (whole earlier turns are dropped, oldest first; see
            :mod:`voice.history`).
        backchannel: see :class:`voice.backchannel.BackchannelConfig`.
        endpoint: see :class:`voice.endpointing.EndpointConfig`.
        dtmf: telephone keys as input, see :class:`voice.dtmf.DtmfConfig`.
    """

    stop_grace_ms: int = Field(250, ge=0, le=10_000)
    history_messages: int = Field(40, ge=2, le=1000)
    backchannel: BackchannelConfig = BackchannelConfig()
    endpoint: EndpointConfig = EndpointConfig()
    dtmf: DtmfConfig = DtmfConfig()
