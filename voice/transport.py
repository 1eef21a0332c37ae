"""The transport seam (DESIGN.md, "Transports"): how one kind of client
reaches a voice session.

Every transport (WebRTC for browsers, :class:`web.webrtc_transport.WebRtcTransport`;
a telephony media stream; a device socket; a WAV file in tests,
:class:`testkit.wav_transport.WavTransport`) gives the agent session the same
things, so the session, the Turn Manager, barge-in policy, budget and ledger
never know which one a call came in on. Protocol parsing lives in ``web/``,
codecs in ``media/``; nothing here knows aiortc:

1. inbound audio: 16 kHz mono 20 ms frames with their media time and the
   barge-in detector's decisions (:class:`media.inbound_frame.InboundFrame`,
   made by :func:`media.inbound_frame.analyse_frame`);
2. an output sink of generation-tagged 20 ms frames (48 kHz) that can pause,
   resume and clear (:class:`OutputSink`);
3. the playout position the far end has actually played, per generation
   (:meth:`OutputSink.played_samples`: what "heard" is cut at);
4. control input: push-to-talk, abort, DTMF (:class:`Control`), with a way
   to refuse one (:meth:`Transport.refuse`);
5. event output: the session emits into its log
   (:class:`turn.events.EventSink`); whoever follows that log
   (:class:`turn.events.EventFollower`) hands each event read back to
   :meth:`Transport.deliver`, so a client only sees what was persisted;
6. the end of the call (:meth:`Transport.on_close`).

:class:`ControlInbox` and :class:`CloseNotice` are the plumbing every
transport needs for 4 and 6.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from media.inbound_frame import InboundFrame
from media.playout import PlayoutFrame
from turn.models import StopReasonKind


class ControlKind(StrEnum):
    """What a client can ask of the session besides speaking."""

    PTT_START = "ptt.start"  # push-to-talk pressed: a committed barge-in
    PTT_END = "ptt.end"  # released: the utterance ends at once
    ABORT = "abort"  # stop the turn in flight (xiaozhi ``abort``; a stop button)
    DTMF = "dtmf"  # a telephone key
    DETECT = "detect"  # a wake word's text said on the device (xiaozhi ``listen detect``): the user's input


@dataclass(frozen=True)
class Control:
    """One control input.

    Attributes:
        kind: which.
        at: clock seconds when it arrived (the session's monotonic clock).
        digit: for ``dtmf``: the key ("0"-"9", "*", "#", "A"-"D").
        text: for ``detect``: the words the device recognised.
        initiator: for ``abort``: who pressed it, as the stop reason records
            it (None: ``user``; a device socket says ``device``).
    """

    kind: ControlKind
    at: float
    digit: str | None = None
    text: str | None = None
    initiator: str | None = None


class OutputSink(Protocol):
    """Where the agent's audio goes: 20 ms frames at ``rate`` Hz (48 kHz),
    tagged with their generation, paced out by the transport. The agent
    session uses exactly this; :class:`media.playout.PlayoutBuffer` is one
    (its frames' way out, e.g. :class:`media.outbound.PacedAudioTrack`,
    calls its ``note_played``)."""

    rate: int

    def push(self, frame: PlayoutFrame) -> None:
        """Queue one frame (never blocks).

        Raises:
            ValueError: the frame is not exactly 20 ms at ``rate``.
        """
        ...

    def pause(self, trial: bool = False) -> bool:
        """Hold playout where it is (queued frames stay). True if it was
        playing. ``trial``: the pause may be taken back within tens of ms
        (a stage-1 pause on trial); a sink whose far end buffers (a phone)
        lets that buffer play instead of recalling it."""
        ...

    def resume(self) -> bool:
        """Go on from where :meth:`pause` held it. True if it was paused."""
        ...

    def rewind_to_word(self, paused_ms: float) -> int:
        """While paused (for ``paused_ms``): go back to the start of the word
        the pause fell in, so :meth:`resume` plays it whole (0 where the
        sink cannot tell what its far end played, or for a pause too short
        to be worth a word said again). Returns the audio to be played
        again, ms."""
        ...

    def clear(self) -> int:
        """Drop everything queued, at once (a barge-in; a telephony ``clear``).
        Returns how many 20 ms frames went."""
        ...

    def played_samples(self, generation: int) -> int:
        """How far the far end got into ``generation``'s audio, in samples
        at ``rate`` (0 if none was played): what left the delivery gate for
        WebRTC, the last acknowledged ``mark`` for telephony."""
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
        kind: ``"webrtc"``, ``"telephony"``, ``"device"``, ``"wav"`` (for
            metrics and logs only: nothing may branch on it).
        output: the client's output sink.
    """

    @property
    def kind(self) -> str:
        """``"webrtc"``, ``"telephony"`` or ``"device"`` (logs and metrics only)."""
        ...

    @property
    def output(self) -> OutputSink:
        """The client's output sink (48 kHz, 20 ms generation-tagged frames)."""
        ...

    def frames(self) -> AsyncIterator[InboundFrame]:
        """Inbound audio until the client goes away (then the iterator
        ends). A stretch with no audio is filled with silence, so the
        detector's timers run on. Iterated once, by the session."""
        ...

    def controls(self) -> AsyncIterator[Control]:
        """Control input, in arrival order, while the session takes it
        (:class:`ControlInbox`). Iterated once, by the session."""
        ...

    def refuse(self, control: Control, code: str) -> None:
        """Tell the client ``control`` was refused, with an ``error`` code
        of :data:`turn.event_catalogue.ErrorCode` (``ptt_already_active``,
        ``ptt_not_active``), in the transport's own framing and not through
        the log. Never raises."""
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
        """Call ``callback`` once with the reason when the call ends (the
        client is gone: ``transport_disconnected``; the server ends it),
        before the session is stopped; the session settles its turns with
        that reason (:class:`CloseNotice`)."""
        ...


class ControlInbox:
    """Control input waiting for the session: what a transport puts in
    (:meth:`put`) comes out of :meth:`items` (its ``controls()``) in order.

    A control put while no session takes them (before the session runs,
    after it ended) is not kept: :meth:`put` says so, and the transport
    refuses it (``session_not_ready``). Not thread-safe: one event loop.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Control | None] = asyncio.Queue()
        #: a session is iterating :meth:`items`
        self.taking = False

    def put(self, control: Control) -> bool:
        """Queue ``control`` for the session. Returns False (and drops it)
        if no session takes controls now."""
        if not self.taking:
            return False
        self._queue.put_nowait(control)
        return True

    def end(self) -> None:
        """The call is over: :meth:`items` ends after what is queued."""
        self._queue.put_nowait(None)

    async def items(self) -> AsyncIterator[Control]:
        """The controls, in order, until :meth:`end` (or the iterating task
        is cancelled)."""
        self.taking = True
        try:
            while (control := await self._queue.get()) is not None:
                yield control
        finally:
            self.taking = False


class CloseNotice:
    """The end of a call, told once: :meth:`Transport.on_close` registers
    with :meth:`subscribe`; the transport calls :meth:`close`."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[StopReasonKind], None]] = []
        #: why the call ended (None: it has not)
        self.reason: StopReasonKind | None = None

    def subscribe(self, callback: Callable[[StopReasonKind], None]) -> None:
        """Call ``callback`` with the reason when the call ends (at once if
        it already has)."""
        self._callbacks.append(callback)
        if self.reason is not None:
            callback(self.reason)

    def close(self, reason: StopReasonKind) -> bool:
        """The call ends for ``reason``: tell every subscriber, the first
        time only. Returns False if it had already ended."""
        if self.reason is not None:
            return False
        self.reason = reason
        for callback in self._callbacks:
            callback(reason)
        return True
