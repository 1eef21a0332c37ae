"""What a headless call says and what it observed: the :class:`Utterance`
script, each turn as the client saw it (:class:`TurnView`), each barge-in's
measurement (:class:`BargeInMeasure`) and the whole :class:`CallResult`.
:class:`client.call.CallClient` fills them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class CallError(RuntimeError):
    """The server refused the call or the connection failed."""


@dataclass
class Utterance:
    """Something the client says.

    Attributes:
        pcm: 48 kHz mono s16.
        at_s: for barge-ins, seconds after the agent starts talking; None for
            the opening utterance.
        label: for the timeline (e.g. the file name).
        kind: what it is, for scoring: ``speech`` (should barge in),
            ``backchannel`` or ``noise`` (should cancel nothing).
        ptt: sent with push-to-talk (ptt.start before, ptt.end after).
        keys: phone calls only: telephone keys pressed (``dtmf`` messages,
            100 ms apart) instead of saying ``pcm``.
        abort: device calls (:mod:`client.device_call`): press abort at
            ``at_s`` instead of saying ``pcm``.
        speech_end_s: WebRTC calls: where the speech in ``pcm`` ends, s
            from its start, when a labelled corpus knows it; None: where its
            level last exceeds -40 dBFS (:func:`media.frames.last_sound_sample`).
    """

    pcm: bytes
    at_s: float | None = None
    label: str = ""
    kind: str = "speech"
    ptt: bool = False
    keys: str = ""
    abort: bool = False
    speech_end_s: float | None = None


@dataclass
class BargeInMeasure:
    """One barge-in as the client measured it (all times in the client clock's seconds)."""

    label: str
    at_s: float
    kind: str = "speech"
    agent_started_at: float | None = None
    onset_sent_at: float | None = None
    sent_from: float | None = None
    sent_until: float | None = None
    silent_at: float | None = None
    speaking_at_onset: bool = False
    server_onset_to_fence_ms: float | None = None
    #: the server committed a barge-in for it
    barged_in: bool = False
    #: it paused the agent, which then resumed (false_interruption / backchannel)
    resumed: str | None = None
    #: silence it inserted into the agent's reply, ms, as the caller heard it
    #: (None: not judged; filled by a listening measure against a reference
    #: reception, e.g. ``tests/listening.py``)
    gap_ms: float | None = None
    #: the caller's verdict from the same measure: ``kept talking``,
    #: ``paused and resumed`` or ``stopped`` (None: not judged)
    outcome: str | None = None
    #: phone calls only (:mod:`client.phone_call`), None elsewhere:
    #: ms from the server's fence (its ``barge_in`` event) to the ``clear``
    #: reaching the provider (None: no clear came)
    clear_after_fence_ms: float | None = None
    #: ms of old-generation audio that reached the provider after the clear
    #: and played audibly (should be 0)
    old_audio_after_clear_ms: float | None = None
    #: ms of the interrupted reply the caller's ear played (stream bytes
    #: from the reply's first to the clear), and what the server counted
    #: (``agent.interrupted`` played_ms) and said was heard; device calls:
    #: what the device's speaker played of it before the interruption
    played_ms_at_ear: float | None = None
    server_played_ms: int | None = None
    server_heard: str | None = None
    #: the interrupted turn (its id), for matching its reply
    old_turn_id: str | None = None
    #: device calls only (:mod:`client.device_call`), None elsewhere: what
    #: interrupted (``abort``, ``ptt`` press, ``voice``); ``onset_sent_at``
    #: is then the press (abort or button) or the first speech sample sent
    initiator: str | None = None
    #: ms from the interruption to the server's ``tts stop`` at the device
    tts_stop_ms: float | None = None
    #: ms from the interruption to the last old-generation packet received
    received_stop_ms: float | None = None
    #: ms of sound the server sent after its ``tts stop`` and before the
    #: next reply's ``tts start`` (should be 0)
    old_audio_after_tts_stop_ms: float | None = None
    #: WebRTC calls: voice-to-voice for speech that barged in, ms: from the
    #: last sample of it sent to the arrival of the next reply's first sound
    #: (None: not measured)
    reply_after_ms: float | None = None
    #: for a clip that paused the agent and let it go on (a backchannel, a
    #: false interruption), ms from the last sample of its speech sent to
    #: the agent's sound again at the client (WebRTC: its arrival; phone:
    #: the ear; device: the speaker): the silence the caller hears after
    #: they stopped (issue 32 asks <= 300 ms p95)
    resumed_after_end_ms: float | None = None

    @property
    def stop_ms(self) -> float | None:
        """Audible stop time in ms, or None if it could not be measured."""
        if self.onset_sent_at is None or self.silent_at is None:
            return None
        return max(0.0, (self.silent_at - self.onset_sent_at) * 1000)

    @property
    def into_reply_s(self) -> float | None:
        """When its first sample was sent, s after the agent's reply was
        first heard at the client (the moment of the reply it interrupted);
        None if either is unknown."""
        if self.onset_sent_at is None or self.agent_started_at is None:
            return None
        return self.onset_sent_at - self.agent_started_at

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "at_s": self.at_s,
            "barged_in": self.barged_in,
            "resumed": self.resumed,
            "stop_ms": None if self.stop_ms is None else round(self.stop_ms, 1),
            "speaking_at_onset": self.speaking_at_onset,
            "server_onset_to_fence_ms": self.server_onset_to_fence_ms,
            "gap_ms": self.gap_ms,
            "outcome": self.outcome,
            "reply_after_ms": self.reply_after_ms,
            "resumed_after_end_ms": self.resumed_after_end_ms,
        } | ({} if self.initiator is not None or (self.played_ms_at_ear is None and self.clear_after_fence_ms is None) else {
            "clear_after_fence_ms": self.clear_after_fence_ms,
            "old_audio_after_clear_ms": self.old_audio_after_clear_ms,
            "played_ms_at_ear": self.played_ms_at_ear,
            "server_played_ms": self.server_played_ms,
            "server_heard": self.server_heard,
        }) | ({} if self.initiator is None else {
            "initiator": self.initiator,
            "tts_stop_ms": self.tts_stop_ms,
            "received_stop_ms": self.received_stop_ms,
            "played_ms_at_device": self.played_ms_at_ear,
            "server_played_ms": self.server_played_ms,
            "server_heard": self.server_heard,
            "old_audio_after_tts_stop_ms": self.old_audio_after_tts_stop_ms,
        })


@dataclass
class RequestMeasure:
    """One request of a conversation (:meth:`client.call.CallClient.converse`)
    as the client measured it. Times are the client clock's seconds.

    Attributes:
        label / kind: the :class:`Utterance`'s.
        frames_sent: when each 20 ms frame of its PCM (48 kHz, 960 samples)
            was handed to the RTP sender, in order.
        speech_end_sample: the sample just past its speech, 48 kHz (from
            ``Utterance.speech_end_s``, else found by level); None: no sound.
        waited_until: when the wait for its reply ended (the next request
            was said after it, following the gap).
        first_reply_at: RTP arrival of the first agent sound after its
            speech ended and before the next request's first frame was sent
            (the last request: before ``waited_until``; None: none came).
        sound_before_end: agent sound arrived after its first frame was
            sent and before its speech ended (the agent talked before the
            caller finished).
        no_turn: the server started no turn for it within ``NO_SPEECH_S``
            of its end (it heard no speech).
        reply_timed_out: its reply was not over within the wait's bound.
    """

    label: str
    kind: str = "speech"
    frames_sent: list[float] = field(default_factory=list)
    speech_end_sample: int | None = None
    waited_until: float | None = None
    first_reply_at: float | None = None
    sound_before_end: bool = False
    no_turn: bool = False
    reply_timed_out: bool = False

    def sent_at(self, sample: int) -> float | None:
        """When the frame carrying ``sample`` (48 kHz, from the start of the
        PCM) was handed to the RTP sender (None: not sent, or out of range)."""
        i = sample // 960
        return self.frames_sent[i] if 0 <= i < len(self.frames_sent) else None

    @property
    def sent_from(self) -> float | None:
        """When its first frame was handed to the sender."""
        return self.frames_sent[0] if self.frames_sent else None

    @property
    def speech_end_sent(self) -> float | None:
        """When the last sample of its speech was handed to the sender: the
        departure of the frame carrying it (None: no speech, not sent)."""
        return None if not self.speech_end_sample else self.sent_at(self.speech_end_sample - 1)

    @property
    def voice_to_voice_ms(self) -> float | None:
        """The last sample of its speech sent to the RTP arrival of the
        reply's first sound, ms (None: no reply, or not measured)."""
        end = self.speech_end_sent
        return None if end is None or self.first_reply_at is None else round((self.first_reply_at - end) * 1000, 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "voice_to_voice_ms": self.voice_to_voice_ms,
            "sound_before_end": self.sound_before_end,
            "no_turn": self.no_turn,
            "reply_timed_out": self.reply_timed_out,
        }


@dataclass
class TurnView:
    """A turn as the client saw it through events."""

    id: str
    generation: int
    status: str = "QUEUED"
    label: str = "queued"
    transcript: str | None = None
    reply: str = ""
    stop_reason: str | None = None
    error: str | None = None
    states: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "transcript": self.transcript,
            "reply": self.reply,
            "generation": self.generation,
            "state": self.status,
            "stop_reason": self.stop_reason,
            "error": self.error,
            "states": self.states,
        }


@dataclass
class CallResult:
    """Everything a call observed: turns (by generation), barge-in
    measurements, raw events, ms of agent audio received, and whether it ended
    early (timeout, or the server hung up).

    ``received`` is the reception itself, one entry per 20 ms frame of agent
    audio in order: (RTP arrival, client clock seconds; level, dBFS RMS;
    where its sound ends, ms into the frame, 0 if silent). ``event_times``
    pairs each data-channel event with its arrival (client clock seconds).
    """

    session_id: str
    #: the caller's turns, by generation (not the speculative ones taken back: ``withdrawn``)
    turns: list[TurnView]
    barge_ins: list[BargeInMeasure]
    events: list[dict[str, Any]]
    received_audio_ms: int
    timed_out: bool
    server_hung_up: bool = False
    received: list[tuple[float, float, float]] = field(default_factory=list)
    event_times: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    #: ``webrtc``, the phone provider (``twilio``, ``telnyx``) or ``device``
    transport: str = "webrtc"
    #: phone and device calls: the server's protocol violations the far end saw
    protocol_errors: list[str] = field(default_factory=list)
    #: device calls: protocol version, listening mode, downlink audio
    transport_info: dict[str, Any] = field(default_factory=dict)
    #: WebRTC calls: voice-to-voice of the opening utterance, ms: from the
    #: last sample of its speech sent to the arrival of the reply's first
    #: sound, as a caller hears the wait (None: no reply came)
    voice_to_voice_ms: float | None = None
    #: WebRTC conversations (:meth:`client.call.CallClient.converse`): each request said, in order
    requests: list[RequestMeasure] = field(default_factory=list)
    #: WebRTC calls: received frames whose RTP packet's arrival was not
    #: found, timed when decoded instead (after the jitter buffer): 0 when
    #: every time in ``received`` is an RTP arrival
    arrival_unknown: int = 0
    #: speculative turns the server took back (stop reason
    #: ``speculation_withdrawn``: started at a pause the user went on
    #: from; nothing of them was played or shown), by generation
    withdrawn: list[TurnView] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The call ran its whole script."""
        return not (self.timed_out or self.server_hung_up)

    def as_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "turns": [t.as_dict() for t in self.turns],
            "withdrawn": [t.as_dict() for t in self.withdrawn],
            "barge_ins": [b.as_dict() for b in self.barge_ins],
            "received_audio_ms": self.received_audio_ms,
            "timed_out": self.timed_out,
            "server_hung_up": self.server_hung_up,
            "voice_to_voice_ms": self.voice_to_voice_ms,
        } | ({"requests": [r.as_dict() for r in self.requests]} if self.requests else {}) | (
            {} if self.transport == "webrtc" else {"transport": self.transport, "protocol_errors": self.protocol_errors}) | (
            {"device": self.transport_info} if self.transport_info else {})


#: the stop reason of a speculative turn taken back (turn.models.StopReasonKind)
WITHDRAWN = "speculation_withdrawn"


def caller_turns(turns: list[TurnView]) -> tuple[list[TurnView], list[TurnView]]:
    """``turns`` split in two, each by generation: the caller's turns, and
    the speculative ones the server took back (``WITHDRAWN``), which the
    caller never saw answered (DESIGN.md "speculative turn")."""
    ordered = sorted(turns, key=lambda t: t.generation)
    return [t for t in ordered if t.stop_reason != WITHDRAWN], [t for t in ordered if t.stop_reason == WITHDRAWN]


def track_turn(turns: dict[str, TurnView], ev: dict[str, Any]) -> None:
    """Update the turns a client saw (by turn id) with one server event
    (``turn``, ``transcript``, ``agent.delta``, ``agent.restart``; others
    change nothing)."""
    kind = ev.get("type")
    if kind not in ("turn", "transcript", "agent.delta", "agent.restart"):
        return
    t = turns.setdefault(ev["turn_id"], TurnView(id=ev["turn_id"], generation=ev["generation"]))
    if kind == "turn":
        t.status, t.label = ev["status"], ev["label"]
        t.states.append(ev["status"])
        if ev.get("transcript") is not None:
            t.transcript = ev["transcript"]
        if ev.get("reply"):
            t.reply = ev["reply"]
        if ev.get("stop_reason"):
            t.stop_reason = ev["stop_reason"]["kind"]
        t.error = ev.get("error")
    elif kind == "transcript":
        t.transcript = ev["text"]
    elif kind == "agent.restart":  # resumed at another worker: the reply comes again from its start
        t.reply = ""
    elif kind == "agent.delta" and t.status not in ("COMPLETED", "CANCELLED"):
        t.reply += ev["text"]
