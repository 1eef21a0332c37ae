"""A headless WebRTC client: the main job's driver and the end-to-end tests'.
What it says and observes is in :mod:`client.results`.

:class:`CallClient` connects to a turnkeeper server as an aiortc peer, plays
an utterance (mono s16 PCM) as its microphone, optionally interrupts the
agent with further utterances a set time after the agent starts talking, and
records everything: the agent's audio (to a WAV file if asked), the events
from the data channel, and for each barge-in the audible stop time.

Audible stop time = from the moment the first sample of barge-in speech was
handed to the RTP sender, to the point where the agent's sound ends in the
audio received, on the RTP packet-arrival timeline: the arrival of the RTP
packet of the last frame with agent sound plus where in that frame the sound
ends (Opus carries a few ms of tail into the frame after the last one sent),
provided the agent then stays silent for ``SILENT_RUN_MS``. Arrival is taken
when the packet reaches the client's RTP receiver, before its jitter buffer
(as a browser's ``getStats`` would see it); ``jitter_prefetch`` only changes
when the audio is heard, not the figure.

Voice-to-voice = from the moment the frame carrying the last sample of the
user's speech was handed to the RTP sender (the sample leaves with its
frame; where in the frame it lies does not delay it) to the RTP arrival of
the first packet of agent sound after it. :meth:`CallClient.converse` says
several requests in one call, each once the reply to the one before is
over, and measures each (:class:`client.results.RequestMeasure`).

A client can also behave like a speakerphone (``echo_gain_db``): whatever
agent audio it receives is played back into its own microphone, attenuated
and delayed, mixed with what it says; the server's echo guard must not take
it for the user. Utterances can be sent with push-to-talk (``ptt.start`` on
the data channel before the audio, ``ptt.end`` after it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import wave
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import aiohttp
import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av.audio.frame import AudioFrame

from client.results import (
    BargeInMeasure,
    CallError,
    CallResult,
    RequestMeasure,
    TurnView,
    Utterance,
    caller_turns,
    track_turn,
)
from clock import Clock, SystemClock
from media.frames import PLAYOUT_RATE, PcmResampler, Reframer, first_sound_sample, last_sound_sample, rms_dbfs
from media.inbound import set_jitter_prefetch
from media.outbound import PacedAudioTrack
from media.playout import PlayoutBuffer, PlayoutFrame

log = logging.getLogger(__name__)

SILENCE_DBFS = -50.0  # a received 20 ms frame quieter than this is silence
SILENT_RUN_MS = 500  # agent counts as stopped once silent this long
LEAD_SILENCE_MS = 300  # microphone silence before the first utterance
NO_SPEECH_S = 5.0  # an opening utterance that starts no turn within this is not speech
VERDICT_WAIT_S = 1.5  # events this long after an utterance ends still count as about it
REVIVE_AFTER_S = 5.0  # agent silent this long before a scripted barge-in: say the revive utterance
QUIET_MS = 300  # a conversation's reply is over once its turns are terminal and no agent sound came for this long
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "RECONCILE_REQUIRED"})


def _send_everything(generation: int) -> bool:
    """The client's microphone has no delivery gate: everything queued is sent."""
    return True


class _SpeakerphoneMic(PacedAudioTrack):
    """The client's microphone: what it says, plus (speakerphone) the agent's
    audio it played, attenuated, mixed in."""

    def __init__(self, buffer: PlayoutBuffer, clock: Clock, on_sent: Any, echo: deque[np.ndarray] | None) -> None:
        super().__init__(buffer, _send_everything, clock, on_sent=on_sent)
        self.echo = echo

    def _next_deliverable(self) -> PlayoutFrame | None:
        frame = super()._next_deliverable()
        if not self.echo:
            return frame
        echo = self.echo.popleft()
        if frame is None:
            return PlayoutFrame(echo.astype("<i2").tobytes(), generation=-1)
        mixed = np.frombuffer(frame.pcm, dtype="<i2").astype(np.int32) + echo
        return PlayoutFrame(mixed.clip(-32768, 32767).astype("<i2").tobytes(), frame.generation, frame.sample)


class CallClient:
    """One call against ``base_url`` (e.g. ``http://127.0.0.1:8080``).

    Args:
        base_url: the server.
        clock: pacing clock for the microphone (system clock by default).
        jitter_prefetch: the client's inbound jitter buffer, 20 ms packets.
        echo_gain_db: None, or play the agent's audio back into the
            microphone at this gain (dB, e.g. -10), as a speakerphone does.
        echo_delay_ms: extra delay of that echo (acoustic path and the
            device's buffers), ms, multiple of 20.
        token: credentials for the offer: a client token (``ck_...``,
            presented as is: one call), or a tenant API token, with which
            the client does what an app's backend does, minting a client
            token (``POST /v1/sessions``) for each offer. None: no
            credentials (a development server).
        echo_cancellation: what the offer declares of the microphone's
            echo canceller, as the browser page does from
            ``MediaTrackSettings.echoCancellation``: True, a browser with
            its canceller on (or a headset); False, one with it off; None,
            nothing declared.
    """

    def __init__(
        self,
        base_url: str,
        *,
        clock: Clock | None = None,
        jitter_prefetch: int = 1,
        echo_gain_db: float | None = None,
        echo_delay_ms: int = 60,
        token: str | None = None,
        echo_cancellation: bool | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.echo_cancellation = echo_cancellation
        self.clock = clock or SystemClock()
        self.jitter_prefetch = jitter_prefetch
        self.echo_gain = None if echo_gain_db is None else 10 ** (echo_gain_db / 20)
        self._echo: deque[np.ndarray] | None = None
        if echo_gain_db is not None:
            self._echo = deque(np.zeros(960, dtype=np.int32) for _ in range(max(0, echo_delay_ms // 20)))
        self._rtp_arrival: dict[int, float] = {}
        self._rtp_receiver: Any = None
        self._arrival_unknown = 0  # frames timed when decoded: their packet's arrival was not found
        self._channel: Any = None
        self._revive: Utterance | None = None
        self._event_times: list[tuple[float, dict[str, Any]]] = []
        self.session_id = ""
        self._turns: dict[str, TurnView] = {}
        self._events: list[dict[str, Any]] = []
        self._event_cond = asyncio.Condition()
        #: per 20 ms frame received: (arrival, dBFS, ms into the frame where its sound ends)
        self._received: list[tuple[float, float, float]] = []
        self._pcm_out = bytearray()
        self._sound_cond = asyncio.Condition()
        self._onsets: dict[int, int] = {}  # utterance index -> onset sample
        self._onset_sent: dict[int, float] = {}
        self._ends: dict[int, int] = {}  # utterance index -> sample just past its last sound
        self._end_sent: dict[int, float] = {}
        self._frames_sent: dict[int, list[float]] = {}  # utterance index -> when each of its frames was handed to the sender
        self._turn_seen: dict[str, float] = {}  # turn id -> arrival of its first event
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(
        self,
        opening: Utterance,
        barge_ins: list[Utterance] = (),  # type: ignore[assignment]
        *,
        out_wav: Path | None = None,
        timeout_s: float = 60.0,
        settle_s: float = 0.5,
        revive: Utterance | None = None,
        hangup_after_s: float | None = None,
    ) -> CallResult:
        """Make the call and return what happened.

        ``hangup_after_s``: hang up this many seconds after the last barge-in
        utterance has been handed to the sender, instead of waiting for the
        last turn to end (a soak that judges each clip need not hear a whole
        story out). None (default): wait for every turn to be terminal.

        ``revive``: said (and not measured) when the agent stays silent for
        ``REVIVE_AFTER_S`` while the script waits for it to talk before the
        next barge-in, e.g. when the recogniser misheard the last one and the
        agent answered briefly.

        Raises:
            CallError: the server cannot be reached, rejected the offer, did
                not answer like turnkeeper, or never connected.
            OSError: ``out_wav`` cannot be written.
        """
        measures = [BargeInMeasure(label=u.label, at_s=u.at_s or 0.0, kind=u.kind) for u in barge_ins]
        self._revive = revive
        timed_out, server_hung_up = await self._call(
            lambda mic: self._script(mic, opening, barge_ins, measures, hangup_after_s), timeout_s, settle_s
        )
        self._measure(measures)
        opening_end = self._end_sent.get(1)
        first_reply = self._first_sound_after(opening_end) if opening_end is not None else None
        if out_wav is not None:
            _write_wav(out_wav, bytes(self._pcm_out), PLAYOUT_RATE)
        return self._result(measures, timed_out, server_hung_up,
                            voice_to_voice_ms=None if first_reply is None or opening_end is None
                            else round((first_reply - opening_end) * 1000, 1))

    async def converse(
        self,
        requests: list[Utterance],
        *,
        out_wav: Path | None = None,
        timeout_s: float | None = None,
        reply_timeout_s: float = 30.0,
        gap_s: float = 1.0,
        settle_s: float = 0.5,
    ) -> CallResult:
        """Say ``requests`` one after another, each once the reply to the
        one before is over, and measure each (``CallResult.requests``).

        A reply is over when every turn the call has seen is terminal and
        no agent sound has arrived for ``QUIET_MS``; the wait ends anyway
        ``reply_timeout_s`` after the request was sent (``reply_timed_out``),
        or ``NO_SPEECH_S`` after it when no turn began since it started
        (``no_turn``). Then ``gap_s`` of microphone silence, and the next.

        Per request: when each frame of it was handed to the RTP sender, the
        RTP arrival of the reply's first sound after its last speech sample
        (voice-to-voice), and whether agent sound arrived before its speech
        ended. The ``at_s``, ``ptt``, ``keys`` and ``abort`` of ``requests``
        are not used.

        Args:
            requests: what the caller says, 48 kHz mono s16 each.
            timeout_s: the whole call at most, s (None: as long as the waits
                allow: the sum of the requests, their bounds and gaps, plus 30 s).

        Raises:
            ValueError: no requests, a request without audio or whose
                ``speech_end_s`` lies outside it, or a wait out of range.
            CallError: as :meth:`run`.
            OSError: ``out_wav`` cannot be written.
        """
        if not requests:
            raise ValueError("converse needs at least one request")
        if reply_timeout_s <= 0 or gap_s < 0:
            raise ValueError(f"reply_timeout_s must be > 0 and gap_s >= 0 (got {reply_timeout_s}, {gap_s})")
        for i, u in enumerate(requests, start=1):
            length_s = len(u.pcm) // 2 / PLAYOUT_RATE
            if not length_s:
                raise ValueError(f"request {i} ({u.label or 'unlabelled'}) has no audio")
            if u.speech_end_s is not None and not 0 < u.speech_end_s <= length_s:
                raise ValueError(f"request {i} ({u.label or 'unlabelled'}): speech_end_s {u.speech_end_s} s "
                                 f"is outside its audio (0 to {length_s} s)")
        if timeout_s is None:
            said_s = sum(len(u.pcm) for u in requests) / 2 / PLAYOUT_RATE
            timeout_s = said_s + len(requests) * (reply_timeout_s + gap_s) + 30.0
        measures = [RequestMeasure(label=u.label, kind=u.kind) for u in requests]
        timed_out, server_hung_up = await self._call(
            lambda mic: self._say_in_turn(mic, requests, measures, reply_timeout_s, gap_s), timeout_s, settle_s
        )
        self._measure_requests(measures)
        if out_wav is not None:
            _write_wav(out_wav, bytes(self._pcm_out), PLAYOUT_RATE)
        return self._result([], timed_out, server_hung_up, voice_to_voice_ms=measures[0].voice_to_voice_ms, requests=measures)

    async def _call(
        self, script: Callable[[PlayoutBuffer], Coroutine[Any, Any, None]], timeout_s: float, settle_s: float
    ) -> tuple[bool, bool]:
        """Connect, run ``script`` (given the microphone's buffer) until it
        ends, the server hangs up or ``timeout_s`` passes, wait ``settle_s``,
        and hang up.

        Returns:
            (timed_out, server_hung_up).

        Raises:
            CallError: as :meth:`run`; or what ``script`` raised.
        """
        pc = RTCPeerConnection()
        mic_buffer = PlayoutBuffer()
        mic = _SpeakerphoneMic(mic_buffer, self.clock, self._on_mic_sent, self._echo)
        pc.addTrack(mic)
        channel = self._channel = pc.createDataChannel("events")
        channel.on("message", self._on_event)
        receive_task: asyncio.Task[None] | None = None
        connected = asyncio.Event()

        @pc.on("track")
        def _track(track: MediaStreamTrack) -> None:
            nonlocal receive_task
            if track.kind == "audio" and receive_task is None:
                receive_task = asyncio.get_running_loop().create_task(self._receive(track))

        disconnected = asyncio.Event()

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState == "connected":
                connected.set()
            elif pc.connectionState in ("failed", "closed"):
                disconnected.set()

        channel.on("close", disconnected.set)

        timed_out = server_hung_up = False
        try:
            await pc.setLocalDescription(await pc.createOffer())
            body = await self._post_offer(pc.localDescription.sdp)
            self.session_id = body["session_id"]
            await pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type="answer"))
            for tr in pc.getTransceivers():
                if tr.kind == "audio":
                    set_jitter_prefetch(tr.receiver, self.jitter_prefetch)
                    self._note_rtp_arrival(tr.receiver)
            try:
                await asyncio.wait_for(connected.wait(), 15)
            except TimeoutError as exc:
                raise CallError(f"not connected after 15 s (state {pc.connectionState})") from exc
            task = asyncio.ensure_future(script(mic_buffer))
            hangup = asyncio.ensure_future(disconnected.wait())
            try:
                done, _ = await asyncio.wait({task, hangup}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (task, hangup):
                    t.cancel()
                await asyncio.gather(task, hangup, return_exceptions=True)
            if task in done:
                task.result()  # re-raise a failure of the script itself (e.g. no speech heard)
            elif hangup in done:
                server_hung_up = True
            else:
                timed_out = True
            await asyncio.sleep(settle_s)
        finally:
            await pc.close()
            if receive_task is not None:
                receive_task.cancel()
                await asyncio.gather(receive_task, return_exceptions=True)
        return timed_out, server_hung_up

    def _result(self, measures: list[BargeInMeasure], timed_out: bool, server_hung_up: bool, *,
                voice_to_voice_ms: float | None, requests: list[RequestMeasure] | None = None) -> CallResult:
        turns, withdrawn = caller_turns(list(self._turns.values()))
        return CallResult(
            session_id=self.session_id,
            turns=turns,
            withdrawn=withdrawn,
            barge_ins=measures,
            events=list(self._events),
            received_audio_ms=len(self._received) * 20,
            timed_out=timed_out,
            server_hung_up=server_hung_up,
            received=list(self._received),
            event_times=list(self._event_times),
            voice_to_voice_ms=voice_to_voice_ms,
            requests=requests or [],
            arrival_unknown=self._arrival_unknown,
        )

    def reception(self) -> list[tuple[float, float, float]]:
        """What this call has received so far, one entry per 20 ms frame of
        agent audio: (RTP arrival, client monotonic s; level, dBFS RMS; where
        its sound ends, ms into the frame, 0 if silent). A copy: safe to
        read while the call goes on (``CallResult.received`` at its end)."""
        return list(self._received)

    def _first_sound_after(self, t: float) -> float | None:
        """Arrival of the first received frame with agent sound after ``t``
        (client seconds), None if none came."""
        return next((at for at, level, _ in self._received if at > t and level > SILENCE_DBFS), None)

    def _sound_again_after(self, t: float) -> float | None:
        """Arrival of the first received frame with agent sound after ``t``
        (client seconds) that follows a silent one: where the agent's sound
        comes back after a pause; None if it never did."""
        quiet = False
        for at, level, _ in self._received:
            if at <= t:
                quiet = level <= SILENCE_DBFS
                continue
            if level > SILENCE_DBFS and quiet:
                return at
            quiet = level <= SILENCE_DBFS
        return None

    async def _client_token(self, http: aiohttp.ClientSession) -> str | None:
        """The client token the offer presents (see ``token``).

        Raises:
            CallError: the server refused to mint one.
        """
        if self.token is None or self.token.startswith("ck_"):
            return self.token
        async with http.post(f"{self.base_url}/v1/sessions", json={},
                             headers={"Authorization": f"Bearer {self.token}"}) as resp:
            body = await resp.json(content_type=None)
            if resp.status != 201 or not isinstance(body, dict) or not isinstance(body.get("client_token"), str):
                raise CallError(f"cannot mint a client token at {self.base_url}/v1/sessions (HTTP {resp.status})")
            return str(body["client_token"])

    async def _post_offer(self, sdp: str) -> dict[str, Any]:
        url = f"{self.base_url}/v1/webrtc/offer"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                token = await self._client_token(http)
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                offer: dict[str, Any] = {"type": "offer", "sdp": sdp}
                if self.echo_cancellation is not None:
                    offer["echo_cancellation"] = self.echo_cancellation
                async with http.post(url, json=offer, headers=headers) as resp:
                    text = await resp.text()
                    status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise CallError(f"cannot reach {url}: {exc or type(exc).__name__}") from exc
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if status != 200:
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                err = body["error"]
                raise CallError(f"offer rejected ({status} {err.get('code')}): {err.get('message')}")
            raise CallError(f"{url} did not answer like a turnkeeper server (HTTP {status})")
        if not isinstance(body, dict) or not isinstance(body.get("sdp"), str) or not isinstance(body.get("session_id"), str):
            raise CallError(f"{url} did not answer like a turnkeeper server: {text[:200]!r}")
        return body

    # -- microphone ------------------------------------------------------------

    def _queue(self, buffer: PlayoutBuffer, index: int, pcm: bytes, speech_end_s: float | None = None) -> None:
        onset = first_sound_sample(pcm)
        if onset is not None:
            self._onsets[index] = onset
        end = last_sound_sample(pcm) if speech_end_s is None else min(len(pcm) // 2, round(speech_end_s * PLAYOUT_RATE))
        if end is not None:
            self._ends[index] = end
        reframer = Reframer(PLAYOUT_RATE)
        frames = reframer.push(pcm)
        tail = reframer.flush()
        if tail:
            frames.append(tail)
        for i, f in enumerate(frames):
            buffer.push(PlayoutFrame(f, generation=index, sample=i * 960))

    def _note_rtp_arrival(self, receiver: Any) -> None:
        """Record when each RTP packet reaches the receiver, by its RTP
        timestamp, before the jitter buffer holds it (:meth:`_arrival`
        finds it again from the decoded frame).

        Raises:
            RuntimeError: this aiortc no longer maps RTP timestamps to
                frame times where expected (an upgrade changed it).
        """
        if not hasattr(getattr(receiver, "_RTCRtpReceiver__timestamp_mapper", None), "_origin"):
            raise RuntimeError("aiortc's RTCRtpReceiver no longer has the expected RTP timestamp mapper")
        self._rtp_receiver = receiver
        handle = receiver._handle_rtp_packet

        async def timed(packet: Any, arrival_time_ms: int) -> None:
            self._rtp_arrival[packet.timestamp] = self.clock.monotonic()
            if len(self._rtp_arrival) > 2000:
                for key in list(self._rtp_arrival)[:1000]:
                    del self._rtp_arrival[key]
            await handle(packet, arrival_time_ms)

        receiver._handle_rtp_packet = timed

    def _arrival(self, pts: int | None, decoded_at: float) -> float:
        """When the RTP packet of the decoded frame with ``pts`` arrived.
        aiortc numbers frames from the stream's first RTP timestamp (its
        receiver's timestamp mapper), so the packet's own timestamp is
        ``pts`` plus that origin, modulo 2^32. A packet not found (none
        recorded) counts in ``CallResult.arrival_unknown`` and is timed at
        ``decoded_at``, after the jitter buffer (should not happen)."""
        mapper = getattr(self._rtp_receiver, "_RTCRtpReceiver__timestamp_mapper", None)
        origin = getattr(mapper, "_origin", None)
        at = None if pts is None or origin is None else self._rtp_arrival.pop((pts + origin) % (1 << 32), None)
        if at is None:
            self._arrival_unknown += 1
            return decoded_at
        return at

    def _send(self, message: dict[str, Any]) -> None:
        if self._channel is not None and self._channel.readyState == "open":
            self._channel.send(json.dumps(message))

    def _on_mic_sent(self, frame: PlayoutFrame | None, at: float) -> None:
        if frame is None or frame.generation < 0:
            return
        if frame.generation > 0:
            self._frames_sent.setdefault(frame.generation, []).append(at)
        onset = self._onsets.get(frame.generation)
        if onset is not None and frame.generation not in self._onset_sent and frame.sample + 960 > onset:
            self._onset_sent[frame.generation] = at + max(0, onset - frame.sample) / PLAYOUT_RATE
        end = self._ends.get(frame.generation)
        if end is not None and frame.generation not in self._end_sent and frame.sample + 960 >= end:
            # the last speech sample leaves with this frame: sent now, not
            # where in the frame it lies (that would shorten voice-to-voice
            # by up to 20 ms)
            self._end_sent[frame.generation] = at

    async def _script(
        self,
        mic: PlayoutBuffer,
        opening: Utterance,
        barge_ins: list[Utterance],
        measures: list[BargeInMeasure],
        hangup_after_s: float | None = None,
    ) -> None:
        mic.push(PlayoutFrame(bytes(1920), generation=0))
        for _ in range(LEAD_SILENCE_MS // 20 - 1):
            mic.push(PlayoutFrame(bytes(1920), generation=0))
        self._queue(mic, 1, opening.pcm)
        await mic.wait_empty()
        await self._expect_a_turn()
        for k, (utt, m) in enumerate(zip(barge_ins, measures, strict=True), start=2):
            m.kind = utt.kind
            sent_at = self.clock.monotonic()
            while True:
                try:
                    async with asyncio.timeout(REVIVE_AFTER_S if self._revive is not None else None):
                        m.agent_started_at = await self._wait_sound_after(sent_at)
                    break
                except TimeoutError:
                    assert self._revive is not None
                    self._queue(mic, -2, self._revive.pcm)  # not measured
                    await mic.wait_empty()
                    sent_at = self.clock.monotonic()
            await asyncio.sleep(max(0.0, m.agent_started_at + (utt.at_s or 0.0) - self.clock.monotonic()))
            if utt.ptt:
                self._send({"type": "ptt.start"})
            m.sent_from = self.clock.monotonic()
            self._queue(mic, k, utt.pcm)
            await mic.wait_empty()
            m.sent_until = self.clock.monotonic()
            if utt.ptt:
                self._send({"type": "ptt.end"})
            last = k - 1 == len(barge_ins)
            if utt.kind != "speech" and not (last and hangup_after_s is not None):
                # Let its verdict come (a confirmation times out after 600 ms
                # by default) before the next one.
                await asyncio.sleep(1.0)
        if hangup_after_s is not None:
            await asyncio.sleep(hangup_after_s)
            return
        # Wait for the last turn to reach a terminal state.
        await self._wait_last_turn_terminal()

    async def _say_in_turn(
        self, mic: PlayoutBuffer, requests: list[Utterance], measures: list[RequestMeasure], reply_timeout_s: float, gap_s: float
    ) -> None:
        """:meth:`converse`'s script: each request, then its reply waited
        out, then ``gap_s`` of silence."""
        for _ in range(LEAD_SILENCE_MS // 20):
            mic.push(PlayoutFrame(bytes(1920), generation=0))
        for k, (utt, m) in enumerate(zip(requests, measures, strict=True), start=1):
            started = self.clock.monotonic()
            self._queue(mic, k, utt.pcm, utt.speech_end_s)
            await mic.wait_empty()
            sent = self.clock.monotonic()
            m.no_turn, m.reply_timed_out = await self._wait_reply_over(started, sent, reply_timeout_s)
            m.waited_until = self.clock.monotonic()
            await asyncio.sleep(gap_s)  # the microphone sends silence meanwhile

    async def _wait_reply_over(self, started: float, sent: float, reply_timeout_s: float) -> tuple[bool, bool]:
        """Wait until the reply to a request (its first frame queued at
        ``started``, its last sent at ``sent``, client clock s) is over: a
        turn began since ``started``, every turn seen is terminal and no
        agent sound came for ``QUIET_MS``; at most ``reply_timeout_s``
        after ``sent``, or ``NO_SPEECH_S`` after it while no turn began.

        Returns:
            (no turn began, the bound was reached with a turn still open or sounding).
        """
        while True:
            now = self.clock.monotonic()
            began = any(at >= started for at in self._turn_seen.values())
            if not began and now - sent >= NO_SPEECH_S:
                return True, False
            if began and all(t.status in TERMINAL for t in self._turns.values()):
                last_sound = next((at for at, level, _ in reversed(self._received) if level > SILENCE_DBFS), None)
                if last_sound is None or now - last_sound >= QUIET_MS / 1000:
                    return False, False
            if now - sent >= reply_timeout_s:
                return not began, began
            await asyncio.sleep(0.05)

    async def _expect_a_turn(self) -> None:
        """After the opening utterance was sent, the server must have heard
        speech (a turn) within ``NO_SPEECH_S``.

        Raises:
            CallError: it heard none (a silent or non-speech file).
        """
        try:
            async with asyncio.timeout(NO_SPEECH_S):
                async with self._event_cond:
                    await self._event_cond.wait_for(lambda: bool(self._turns))
        except TimeoutError:
            raise CallError(f"the server heard no speech in the opening audio ({NO_SPEECH_S:.0f} s after it ended)") from None

    async def _wait_sound_after(self, t: float) -> float:
        """Arrival time of the first non-silent agent frame after ``t``."""
        i = 0
        async with self._sound_cond:
            while True:
                while i < len(self._received):
                    at, level, _ = self._received[i]
                    i += 1
                    if at > t and level > SILENCE_DBFS:
                        return at
                await self._sound_cond.wait()

    async def _wait_last_turn_terminal(self) -> None:
        async with self._event_cond:
            await self._event_cond.wait_for(
                lambda: bool(self._turns)
                and max(self._turns.values(), key=lambda t: t.generation).status in TERMINAL
                and not any(t.status not in TERMINAL for t in self._turns.values())
            )

    # -- receiving ---------------------------------------------------------------

    async def _receive(self, track: MediaStreamTrack) -> None:
        resampler = PcmResampler(PLAYOUT_RATE)
        reframer = Reframer(PLAYOUT_RATE)
        while True:
            try:
                # an audio track's recv() gives decoded av.AudioFrames (aiortc types it Frame | Packet)
                frame = cast(AudioFrame, await track.recv())
            except MediaStreamError:
                return
            now = self.clock.monotonic()
            at = self._arrival(frame.pts, now)
            for f in reframer.push(resampler.frame(frame)):
                self._pcm_out += f
                self._received.append((at, rms_dbfs(f), sound_end_ms(f)))
                if self._echo is not None and self.echo_gain is not None:
                    self._echo.append((np.frombuffer(f, dtype="<i2") * self.echo_gain).astype(np.int32))
            async with self._sound_cond:
                self._sound_cond.notify_all()

    def _on_event(self, message: Any) -> None:
        try:
            ev = json.loads(message)
        except (TypeError, ValueError):
            log.warning("non-JSON event of %d characters", len(str(message)))  # its text may quote the user
            return
        now = self.clock.monotonic()
        self._events.append(ev)
        self._event_times.append((now, ev))
        if isinstance(ev.get("turn_id"), str):
            self._turn_seen.setdefault(ev["turn_id"], now)
        track_turn(self._turns, ev)
        task = asyncio.get_running_loop().create_task(self._notify_events())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _notify_events(self) -> None:
        async with self._event_cond:
            self._event_cond.notify_all()

    # -- measuring ---------------------------------------------------------------

    def _measure(self, measures: list[BargeInMeasure]) -> None:
        run = SILENT_RUN_MS // 20
        for k, m in enumerate(measures, start=2):
            if m.sent_from is not None:
                # What the server decided about it: events from its start to
                # a little after its end (the verdict can take 600 ms).
                until = (m.sent_until or m.sent_from) + VERDICT_WAIT_S
                nxt = measures[k - 1].sent_from if k - 1 < len(measures) else None
                if nxt is not None:
                    until = min(until, nxt)
                for at, ev in self._event_times:
                    if not m.sent_from <= at <= until:
                        continue
                    if ev.get("type") == "barge_in" and not m.barged_in:
                        m.barged_in = True
                        m.server_onset_to_fence_ms = ev.get("onset_to_fence_ms")
                    elif ev.get("type") in ("false_interruption", "backchannel") and m.resumed is None:
                        m.resumed = ev["type"]
            end = self._end_sent.get(k)
            if m.barged_in and m.kind == "speech" and end is not None:
                reply = self._first_sound_after(end)
                m.reply_after_ms = None if reply is None else round((reply - end) * 1000, 1)
            elif m.resumed is not None and not m.barged_in and end is not None:
                again = self._sound_again_after(end)
                m.resumed_after_end_ms = None if again is None else round((again - end) * 1000, 1)
            t = self._onset_sent.get(k)
            m.onset_sent_at = t
            if t is None:
                continue
            m.speaking_at_onset = any(t - 0.1 <= at <= t and lv > SILENCE_DBFS for at, lv, _ in self._received)
            rx = self._received
            start = next((i for i, (at, _, _) in enumerate(rx) if at >= t), len(rx))
            for i in range(start, len(rx)):
                window = rx[i : i + run]
                if len(window) == run and all(lv <= SILENCE_DBFS for _, lv, _ in window):
                    # The agent's sound ends inside the frame before the silent
                    # run (codec overlap carries a few ms into it): count the
                    # stop at that point, not at the next frame's arrival.
                    prev = rx[i - 1] if i > start else None
                    m.silent_at = prev[0] + prev[2] / 1000 if prev is not None else rx[i][0]
                    break

    def _measure_requests(self, measures: list[RequestMeasure]) -> None:
        """Fill each request of a conversation (the utterance of index k+1
        is ``measures[k]``) from what was sent and received: its frames'
        departures, its speech end, and the agent sound that arrived from
        its first frame on until the next request's first frame (the last
        request: until its wait ended, or the end of the call)."""
        for k, m in enumerate(measures, start=1):
            m.frames_sent = self._frames_sent.get(k, [])
            m.speech_end_sample = self._ends.get(k)
            end, start = m.speech_end_sent, m.sent_from
            until = measures[k].sent_from if k < len(measures) else None
            if until is None:
                until = m.waited_until if m.waited_until is not None else float("inf")
            if end is None or start is None:
                continue
            sound = [at for at, level, _ in self._received if level > SILENCE_DBFS and start <= at < until]
            m.sound_before_end = any(at <= end for at in sound)
            m.first_reply_at = next((at for at in sound if at > end), None)


def sound_end_ms(pcm: bytes, window: int = 120) -> float:
    """Where the sound in a 48 kHz s16 frame ends, in ms from its start: the
    end of its last 2.5 ms window louder than ``SILENCE_DBFS`` (0 if none)."""
    n = len(pcm) // 2
    for start in range((n - 1) // window * window, -1, -window):
        if rms_dbfs(pcm[start * 2 : (start + window) * 2]) > SILENCE_DBFS:
            return min(n, start + window) * 1000 / PLAYOUT_RATE
    return 0.0


def _write_wav(path: Path, pcm: bytes, rate: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
