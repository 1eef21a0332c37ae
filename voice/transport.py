"""The transport seam (DESIGN.md, "Transports"): how one kind of client
reaches a voice session. A sketch: nothing implements or uses it yet.

Every transport (WebRTC for browsers, a telephony media stream, a device
socket) gives the agent session the same five things, so the session, the
Turn Manager, barge-in policy, budget and ledger never know which one a call
came in on. Protocol parsing lives in ``web/``, codecs in ``media/``:

1. inbound audio: 16 kHz mono 20 ms frames with their media time and the
   barge-in detector's decisions (:class:`media.inbound.InboundFrame`);
2. an output sink of generation-tagged 20 ms frames (48 kHz) that can pause,
   resume and clear (:class:`OutputSink`);
3. the playout position the far end has actually played, per generation
   (:meth:`OutputSink.played_samples`: what "heard" is cut at);
4. control input: push-to-talk, abort, DTMF (:class:`Control`);
5. event output: the session emits into its log
   (:class:`turn.events.EventSink`); the transport's follower of that log
   (:class:`turn.events.EventFollower`) hands each event read back to
   :meth:`Transport.deliver`, so a client only sees what was persisted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from media.inbound import InboundFrame
from media.playout import PlayoutFrame
from turn.models import StopReasonKind


class ControlKind(StrEnum):
    """What a client can ask of the session besides speaking."""

    PTT_START = "ptt.start"  # push-to-talk pressed: a committed barge-in
    PTT_END = "ptt.end"  # released: the utterance ends at once
    ABORT = "abort"  # stop the turn in flight (xiaozhi ``abort``; a stop button)
    DTMF = "dtmf"  # a telephone key


@dataclass(frozen=True)
class Control:
    """One control input.

    Attributes:
        kind: which.
        at: clock seconds when it arrived (the session's monotonic clock).
        digit: for ``dtmf``: the key ("0"-"9", "*", "#", "A"-"D").
    """

    kind: ControlKind
    at: float
    digit: str | None = None


class OutputSink(Protocol):
    """Where the agent's audio goes: 20 ms frames at ``rate`` Hz, tagged
    with their generation, paced out by the transport. The agent session
    uses exactly this (today's :class:`media.playout.PlayoutBuffer`)."""

    rate: int

    def push(self, frame: PlayoutFrame) -> None:
        """Queue one frame (never blocks)."""
        ...

    def pause(self) -> bool:
        """Hold playout where it is (queued frames stay). True if it was playing."""
        ...

    def resume(self) -> bool:
        """Go on from where :meth:`pause` held it. True if it was paused."""
        ...

    def clear(self) -> int:
        """Drop everything queued, at once (a barge-in; a telephony ``clear``).
        Returns how many 20 ms frames went."""
        ...

    def played_samples(self, generation: int) -> int:
        """How far the far end got into ``generation``'s audio, in samples
        at ``rate`` (0 if none was played): the wire position for WebRTC,
        the last acknowledged ``mark`` for telephony."""
        ...

    def audible_pending(self, generation: int) -> bool:
        """A frame of ``generation`` with sound is still queued."""
        ...

    async def wait_empty(self) -> None:
        """Return once every queued frame was played (or cleared)."""
        ...

    def __len__(self) -> int:
        """Frames queued."""
        ...


class Transport(Protocol):
    """One connected client, as the agent session sees it.

    Attributes:
        kind: ``"webrtc"``, ``"telephony"`` or ``"device"`` (for metrics and
            logs only: nothing may branch on it).
        output: the client's output sink.
    """

    kind: str
    output: OutputSink

    def frames(self) -> AsyncIterator[InboundFrame]:
        """Inbound audio until the client goes away (then the iterator
        ends). A stretch with no audio is filled with silence, so the
        detector's timers run on."""
        ...

    def controls(self) -> AsyncIterator[Control]:
        """Control input, in arrival order, until the client goes away."""
        ...

    def deliver(self, event: dict[str, Any]) -> None:
        """Send one event, as read back from the session's log
        (:func:`turn.events.event_json`), in the transport's own framing
        (a data-channel JSON message, a device ``tts``/``stt`` message).
        Never blocks and never raises: an event it cannot send is dropped."""
        ...

    def reset_detector(self) -> None:
        """Forget the barge-in detector's current run (push-to-talk pressed
        or released)."""
        ...

    def on_close(self, callback: Callable[[StopReasonKind], None]) -> None:
        """Call ``callback`` once with the reason when the client is gone
        (``transport_disconnected``) or the server ends it; the session
        stops its turns for that reason."""
        ...
