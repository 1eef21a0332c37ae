"""Telephony media-stream bridges: a phone call reaches a voice session over
a provider's WebSocket (Twilio Media Streams, Telnyx), through the transport
seam (:mod:`web.telephony.transport`). Each provider is one dialect file
(:mod:`web.telephony.dialect`)."""
